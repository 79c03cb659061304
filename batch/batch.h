/* The job runner core behind `quern run`: claim queued items, admit them into the engine,
 * collect finished outputs into records, and commit them to zstd JSONL shards with the
 * exactly-once protocol (a flush writes one zstd frame and fsyncs it, then ONE queue
 * transaction marks its items done or failed and stores the shard's committed length), recover
 * the open shards of dead runs, and write each job's manifest. Also the job's output directory
 * (location, ownership marker, manifest) and the live progress numbers a run publishes, both
 * shared with `quern status` and `export`. The CLI (runner/) parses options and prints; this
 * module never prints results and depends on queue/, io/, jobs/, engine/ and common/ only.
 *
 * Files: batch/run.c the run and its per-job loop (claim, admit, step, collect, heartbeat,
 * stop); batch/commit.c the shard writer (struct batch_out) and recovery; batch/output.c
 * output directories and manifest.json; batch/progress.c the progress numbers. */
#ifndef BATCH_BATCH_H
#define BATCH_BATCH_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "engine/engine.h"
#include "kernels/kernels.h"
#include "queue/queue.h"

/* ---- Output directories and manifests (batch/output.c) --------------------------------- */

#define BATCH_MARKER_NAME ".quern-job.json" /* the marker file inside OUT/<job> */

/* Absolute form of a working-directory-relative path (no links resolved, trailing '/'
 * dropped) into out; ST_ERR_RANGE when it does not fit. */
enum status batch_abspath(const char *p, char *out, size_t cap, struct err_detail *err);

/* The job's output directory OUT/<name> into dir (absolute). Without out_flag it is where the
 * job's shards are (out_dir set to match with create), or for a job without shards its out_dir
 * (absolute, or relative to the database's directory). out_flag (relative to the working
 * directory) must name where the job's shards already are, else ST_ERR_INVALID_ARG (a job never
 * splits across directories); a job without shards yet records it as its out_dir. With create,
 * the directories are made and the marker is checked or written (batch_outdir_claim). */
enum status batch_job_dir(struct queue *q, const struct queue_job *job, const char *out_flag,
                          int create, char *dir, size_t cap, struct err_detail *err);

/* ST_ERR_CONFLICT when the job already has a shard outside dir: the check a run makes in the
 * transaction that records each new shard, so that two runs started with different --out
 * before either made a shard (batch_job_dir cannot see a run that is still loading its model)
 * never split the job: the second to make a shard stops instead. Without --out, batch_job_dir
 * follows the shards. */
enum status batch_job_dir_check(struct queue *q, int64_t job_id, const char *dir,
                                struct err_detail *err);

/* The shard's stored path resolved as queue_resolve_path does into out, except that a relative
 * one (a quern before 2026-12-01 stored them relative to the directory it ran in) whose file is
 * not under the queue's directory but is under the working directory (a regular file of at
 * least its committed bytes) is ST_ERR_NOT_FOUND, saying what to move where: without it the
 * shard would read as deleted. */
enum status batch_shard_path(struct queue *q, const struct queue_shard *sh, char *out, size_t cap,
                             struct err_detail *err);

/* Claim dir for the job: create the marker (exclusively, never through a link) or check that
 * the one there names this database (its db_uuid) and job id; a directory that belongs to
 * another job or database is refused with ST_ERR_EXISTS, naming its owner. */
enum status batch_outdir_claim(struct queue *q, const struct queue_job *job, const char *dir,
                               struct err_detail *err);

/* 1 when dir holds a job's marker (some run claimed it for a job's output), its owner described
 * in owner ("job 'x' (id 1) of database /q.db (uuid ...)") and its database's path in db ("" if
 * the marker names none); else 0. */
int batch_outdir_owner(const char *dir, char *owner, size_t cap, char *db, size_t db_cap);

/* Every closed, non-empty shard of the job is a regular file of its committed length where the
 * queue says; else ST_ERR_NOT_FOUND naming the first that is not (its output was deleted, moved
 * or cut since: nothing may claim it complete). */
enum status batch_check_shard_files(struct queue *q, int64_t job_id, struct err_detail *err);

/* Write dir/manifest.json from the job's closed, non-empty shards (atomic, see io/manifest.h),
 * after batch_check_shard_files: "complete" when no item of the job is queued or leased and no
 * shard is open. Runs of one job write it one at a time (an flock on the directory's marker,
 * given up after 30 s), each from the queue as it is under that lock. */
enum status batch_manifest_write(struct queue *q, const struct queue_job *job, const char *dir,
                                 struct err_detail *err);

/* For a part of a partitioned queue, whose job directory dir is OUT/<job>/part-NNNN: rebuild
 * the job's combined manifest above it from every part's (batch_parts_manifest; a failure is
 * only warned: the part's own manifest stands, and the next part manifest written rebuilds
 * it). Nothing for a plain queue. batch_manifest_write calls it. */
enum status batch_manifest_combined(struct queue *q, const char *dir, struct err_detail *err);

/* 1 when dir/manifest.json says complete and lists exactly the job's closed, non-empty shards
 * with their bytes, records and sha256; 0 otherwise (missing, unreadable, stale, incomplete). */
int batch_manifest_current(struct queue *q, const struct queue_job *job, const char *dir);

/* The JSON document in the file at path (caller frees with cJSON_Delete), or NULL when it is
 * missing, unreadable or not JSON. */
struct cJSON *batch_json_file(const char *path);

/* ---- Partitioned queues (batch/parts.c) ------------------------------------------------ */

/* A job split over N queue files in one directory, for Slurm arrays across hosts (SQLite's
 * WAL cannot be shared between hosts, so one queue file cannot serve them): DIR holds the
 * catalogue BATCH_PARTS_CATALOG (the job's name, N, the id the parts share) and the parts
 * DIR/part-NNNN.db, each a whole queue holding the same job (same name, model, parameters and
 * seed, so a request's output does not depend on its part) with a share of its items. A part
 * is always opened exclusively (queue_options.exclusive: rollback journal, its lock held by
 * one process from open to close), which is safe on network file systems; its meta says which
 * part it is. A run on part k writes OUT/<job>/part-NNNN/ (shards, marker, manifest), and each
 * part manifest written refreshes the combined OUT/<job>/manifest.json (every part's shards,
 * complete once every part's is). Beside each part, files for processes that cannot open it
 * while its run holds it: part-NNNN.progress.json (the run's live numbers, replaced as it
 * publishes them) and part-NNNN.cancel (a cancel request its run acts on). */
#define BATCH_PARTS_CATALOG "quern-parts.json"
#define BATCH_PARTS_MAX     4096 /* most parts a job may have */

struct batch_parts {
    char dir[4096];  /* the directory, as given */
    char job[129];   /* the job's name */
    int n;           /* parts, 1..BATCH_PARTS_MAX */
    char set_id[33]; /* id the parts share (their meta 'part_set'), 32 hex digits */
};

/* Is path a partitioned queue? 1 with *p filled when it is a directory holding a catalogue;
 * 0 when it is not a directory (a queue file, or nothing yet); -1 with err set for a directory
 * without a valid catalogue. */
int batch_parts_find(const char *path, struct batch_parts *p, struct err_detail *err);

/* Prepare dir (created if missing; it must hold no catalogue and no parts yet) as the home of
 * job `name` in n parts: fills *p with a new set id. The parts are then created with
 * batch_parts_open (create), and the directory becomes a partitioned queue when
 * batch_parts_publish writes its catalogue (atomically), after the last part is written.
 * The directory is claimed first: *lock_fd holds an exclusive flock on
 * dir/BATCH_PARTS_SUBMIT_LOCK, which the caller keeps open until its submit has published or
 * undone its parts (a second submit into the same directory is ST_ERR_BUSY, so it can neither
 * race for the parts nor delete the first's in its undo). *lock_fd is -1 on failure. */
#define BATCH_PARTS_SUBMIT_LOCK ".quern-submit.lock"
enum status batch_parts_create(const char *dir, const char *name, int n, struct batch_parts *p,
                               int *lock_fd, struct err_detail *err);
enum status batch_parts_publish(const struct batch_parts *p, const struct cJSON *inputs,
                                struct err_detail *err);
/* The catalogue's inputs (the sources of the job's lines in input order, as the items name
 * them), a cJSON array the caller deletes; NULL when it has none (a submit before they were
 * kept). */
struct cJSON *batch_parts_inputs(const struct batch_parts *p);

/* DIR/part-NNNN<suffix> into out (suffix ".db", ".progress.json", ".cancel"). */
void batch_parts_path(const struct batch_parts *p, int k, const char *suffix, char *out,
                      size_t cap);

/* Open part k exclusively (busy_ms: how long to wait for a process that holds it; a part in use
 * is ST_ERR_BUSY). flags: BATCH_PART_CREATE creates a missing part and marks it (else a missing
 * one is ST_ERR_NOT_FOUND), BATCH_PART_CHECK checks the whole file first (queue_options
 * check_integrity: for commands that write). A part whose meta names another part or set is
 * ST_ERR_FORMAT. */
#define BATCH_PART_CREATE 1
#define BATCH_PART_CHECK  2
#define BATCH_PART_READ   4 /* only reads: read-only media are fine (queue_options.read_only_ok) */
enum status batch_parts_open(const struct batch_parts *p, int k, int busy_ms, int flags,
                             struct queue **q, struct err_detail *err);

/* When q is part of a partitioned queue: *k its index and *n the count (else *n = 0). */
enum status batch_parts_which(struct queue *q, int *k, int *n, struct err_detail *err);

/* Rewrite job_root/manifest.json from the part manifests job_root/part-NNNN/manifest.json
 * (k < n): every part's shards (file "part-NNNN/<name>", with "part"), totals summed, complete
 * when every part's manifest is; parts without a complete manifest are listed in
 * "parts_incomplete"; "cancelled": true when a part's manifest has it. *complete (may be
 * NULL) gets that. */
enum status batch_parts_manifest(const char *job_root, int n, int *complete,
                                 struct err_detail *err);

/* ---- The run report (batch/report.c) --------------------------------------------------- */

struct batch_report_opts {
    double cost_per_hour; /* cost of one run's device or node per hour; 0: no cost figures */
};

/* Write out_path (replaced atomically) as one self-contained HTML file about job (id or name;
 * NULL for a partitioned queue's own job) of the queue file or partitioned queue db: summary
 * figures, output tokens per second over time with every run's start and end (killed runs
 * marked), batch size and KV use over time, TTFT/TPOT and prompt/output length histograms with
 * P50/P90/P99, errors by code with examples, progress by part, the runs, and the cost per
 * million output tokens. Inline SVG and CSS only: no script, nothing fetched. A part in use by
 * a run contributes its counts from its progress file and nothing else. */
enum status batch_report_write(const char *db, const char *job, const struct batch_report_opts *o,
                               const char *out_path, struct err_detail *err);

/* ---- The shard writer: one run's output for one job (batch/commit.c) ------------------- */

/* Records go to the open results or errors shard of the job (a shard is started, row first and
 * then the file, with its first record). batch_out_commit flushes each shard's pending records
 * as one zstd frame, fsyncs it, and commits them in one queue transaction
 * (queue_commit_shard). Items the queue refuses (taken over after our lease expired, or
 * cancelled) are dropped and the rest rewritten; a shard adopted by another run is cut back to
 * what we committed and the records go to a new shard. So a record is in a shard iff its item
 * is done or failed. A shard is sealed (sha256 of its committed bytes, closed in the queue)
 * when it reaches the size limits, and by batch_out_close. */
struct batch_out; /* opaque */

struct batch_out_spec {
    struct queue *q;        /* borrowed; outlives the writer */
    int64_t run_id;         /* the run writing (queue_run_start) */
    int64_t job_id;         /* the job; its items must be leased by run_id */
    const char *job_dir;    /* OUT/<job>, existing (copied) */
    uint64_t shard_bytes;   /* seal a shard once its committed bytes reach this */
    uint64_t shard_records; /* ... or its records */
};

/* Counts of the writer, for progress and summaries. */
struct batch_out_counts {
    size_t held;            /* items claimed and not yet committed (batch_out_hold) */
    size_t pending_results; /* result records waiting for the next commit */
    size_t pending_errors;  /* error records waiting for the next commit */
    int64_t done, failed;   /* items committed done / failed by this writer */
    int64_t discarded;      /* finished records not committed: their item was taken over or
                               cancelled before the commit */
};

/* A writer for spec (copied). Caller frees with batch_out_free. */
enum status batch_out_open(struct batch_out **out, const struct batch_out_spec *spec,
                           struct err_detail *err);
/* Close the files and free; records not committed are dropped (their items stay leased until
 * released, ended with the run, or expired). Open shards stay open in the queue, to be cut back
 * and sealed by the next recovery. NULL is a no-op. */
void batch_out_free(struct batch_out *w);

/* Note a claimed item: the run holds it until its record is committed (or the queue refuses
 * it); batch_out_release gives held items back. */
enum status batch_out_hold(struct batch_out *w, int64_t item_id, struct err_detail *err);
/* Whether item_id is held (claimed, its request in flight or its record not committed yet). */
int batch_out_holds(const struct batch_out *w, int64_t item_id);
/* Forget a held item whose lease the run has lost (cancelled, or taken over) before it has a
 * record: it is no longer counted held, nor released. */
void batch_out_drop(struct batch_out *w, int64_t item_id);
/* Append the result record `line` (one JSON line without newline; owned by the writer from now
 * on, also on failure; NULL means out of memory) of item_id, with its token usage and latencies
 * (ms; <= 0 unknown). */
enum status batch_out_result(struct batch_out *w, int64_t item_id, char *line,
                             int64_t prompt_tokens, int64_t completion_tokens, double ttft_ms,
                             double tpot_ms, struct err_detail *err);
/* Append the error record `line` (owned as above) of item_id, failing it with code and msg. */
enum status batch_out_error(struct batch_out *w, int64_t item_id, char *line, const char *code,
                            const char *msg, struct err_detail *err);
/* Commit the pending records of the results shard, then of the errors shard (see above). */
enum status batch_out_commit(struct batch_out *w, struct err_detail *err);
/* Give the held items back to the queue (queue_release: not counted as an attempt);
 * *released (may be NULL) gets how many moved. Afterwards nothing is held. */
enum status batch_out_release(struct batch_out *w, int64_t *released, struct err_detail *err);
/* Seal both shards (call after the last commit). */
enum status batch_out_close(struct batch_out *w, struct err_detail *err);
void batch_out_get_counts(const struct batch_out *w, struct batch_out_counts *c);

/* Recovery: cut every open shard of job_id left by a dead run (queue_shard_adopt with
 * stale_ms: ended, or silent that long) back to its committed length and seal it (removed
 * when empty). A shard whose file is still locked has a live writer and is left open. */
enum status batch_recover_shards(struct queue *q, int64_t job_id, int64_t run_id, int64_t stale_ms,
                                 struct err_detail *err);
/* Shards of job_id still open. */
enum status batch_count_open_shards(struct queue *q, int64_t job_id, int64_t *open,
                                    struct err_detail *err);

/* ---- Live progress numbers (batch/progress.c) ------------------------------------------ */

#define BATCH_PROGRESS_PUBLISH_S 1.0  /* how often a run stores its numbers in the queue */
#define BATCH_PROGRESS_STALE_S   30.0 /* a run silent longer adds nothing to live rates */
#define BATCH_SAMPLE_S           5.0  /* how often a run records a time-series sample */
#define BATCH_LEASE_CHECK_S      2.0  /* how often a run lists its leases to drop lost requests */

/* A job's live numbers, counted as tokens are produced, not when requests finish; published
 * with the run's heartbeat (queue_run_progress) and shown by runner/progress.h. */
struct batch_progress {
    int64_t job_id;            /* job shown, 0 for all jobs */
    char job[128];             /* its name ("" for all jobs) */
    int64_t total;             /* items */
    int64_t done;              /* finished with a result */
    int64_t failed;            /* finished with an error record */
    int64_t cancelled;         /* cancelled */
    int64_t gen_tokens;        /* tokens generated, unfinished requests included */
    int64_t prompt_tokens;     /* prompt tokens computed (prefix-cache hits excluded); with
                                * prompt_all, of the finished requests, hits included */
    int prompt_all;            /* 1: prompt_tokens are the finished requests' (status) */
    double gen_tok_s;          /* generated tokens per second, recent window */
    double prompt_tok_s;       /* prompt tokens per second, same window */
    double mean_out;           /* mean completion tokens of finished requests, 0 unknown */
    double inflight_tokens;    /* tokens generated by requests not finished yet */
    int64_t running;           /* sequences running */
    int64_t in_flight;         /* requests the engine holds (running or waiting there): their
                                  choices are `running` and `waiting` sequences */
    int64_t waiting;           /* requests admitted and waiting to run */
    int64_t kv_used, kv_total; /* KV blocks referenced, in the pool */
    int64_t spec_drafted;      /* speculative decoding: draft tokens verified (live runs) */
    int64_t spec_accepted;     /* and accepted */
    int64_t runs;              /* live runs these numbers come from */
    double elapsed_s;          /* since work on the job started */
    double eta_s;              /* seconds left, < 0 unknown */
};

/* Items not finished: total - done - failed - cancelled (>= 0). */
int64_t batch_progress_left(const struct batch_progress *p);

/* eta_s from the other fields: items left x mean_out (at least the mean over the finished and
 * in-flight requests' lengths so far), less the tokens already generated for unfinished requests
 * (a token more for each request in flight at least), over gen_tok_s; 0 when nothing is left;
 * -1 (unknown) until as many requests have finished as are running and tokens are being
 * generated. Requests, not sequences: mean_out counts all of a request's choices (in_flight;
 * from `running` when a document lacks it). */
void batch_progress_eta(struct batch_progress *p);

/* The published form: a JSON object (caller frees), and back (1 ok; 0 and *p zeroed when json
 * is not such an object; missing fields stay 0, eta_s -1). */
char *batch_progress_to_json(const struct batch_progress *p);
int batch_progress_from_json(const char *json, struct batch_progress *p);
/* Add the fields of p to the cJSON object o (eta_s null when unknown). */
struct cJSON;
void batch_progress_add_json(struct cJSON *o, const struct batch_progress *p);

/* A rate from samples of a growing count: per second over the last ~10 samples. */
#define BATCH_RATE_SAMPLES 11
struct batch_rate {
    double t[BATCH_RATE_SAMPLES]; /* sample times (monotonic s), a ring */
    double v[BATCH_RATE_SAMPLES]; /* the count at each */
    int n;                        /* samples held */
    int head;                     /* index of the newest */
};
void batch_rate_reset(struct batch_rate *r);
void batch_rate_add(struct batch_rate *r, double t, double v);
/* Change per second between the oldest and newest sample; 0 with fewer than two. */
double batch_rate_get(const struct batch_rate *r);

/* ---- A run (batch/run.c) --------------------------------------------------------------- */

/* How the run's progress is shown: called with BATCH_SHOW_LIVE every show_period seconds
 * while a job runs, and with BATCH_SHOW_FINAL once when it ends. */
enum batch_show {
    BATCH_SHOW_LIVE = 0,  /* a live update */
    BATCH_SHOW_FINAL = 1, /* the job's last word (exact counts) */
};

struct batch_opts {
    const char *db;                  /* queue database (ignored with parts) */
    const struct batch_parts *parts; /* a partitioned queue: work on its part `part` (opened
                                        exclusively), or NULL for the queue file db */
    int part;                        /* with parts: the part */
    int busy_ms;                     /* with parts: wait this long for a part in use (<= 0:
                                        the queue's default) */
    int create;                      /* create an empty queue when there is none */
    const char *out;                 /* output root (--out), or NULL: each job's own */
    const char *job;    /* only this job (id or name), or NULL: every ready job in turn */
    const char *worker; /* worker id recorded with the run, or NULL: $SLURM_JOB_ID */
    int no_wait;        /* leave items leased by other live runs (exit "work remains") */
    long claim;         /* items claimed per transaction */
    long flush_records; /* commit when this many records wait ... */
    float flush_secs;   /* ... or at least this often (s) */
    long shard_records; /* seal a shard after this many records ... */
    size_t shard_bytes; /* ... or this many compressed bytes */
    float lease;        /* item lease (s); also how long another host's run may be
                           silent before it counts as dead */
    float max_runtime;  /* stop admitting after this long (s), 0 = never */
    float grace;        /* how long in-flight requests may finish after a stop (s) */
    struct kern_backend_opts backend; /* backend for each job's model (strings borrowed) */
    struct engine_params engine;      /* engine settings (its draft_model is set per job) */
    const char *draft_model;          /* with ENGINE_SPEC_MODEL: the draft model's GGUF path */
    const char *chat_template;        /* --chat-template: every job's chat format by name
                                         (engine_chat_init_named), or NULL: each model's own */
    /* Stop signals received so far (the caller's handler counts them; may be NULL): one stops
     * admission, a second skips the grace. */
    const volatile sig_atomic_t *signals;
    const char *metrics_file; /* Prometheus text-format metrics replaced here every
                                 BATCH_SAMPLE_S (node_exporter's textfile collector), or NULL */
    double show_period;       /* seconds between BATCH_SHOW_LIVE calls */
    void (*show)(void *user, const struct batch_progress *p, enum batch_show what);
    void *show_user; /* passed to show */
};

/* How the run ended (batch_run_jobs). */
enum batch_end {
    BATCH_END_DRAINED = 0, /* every item of the selected jobs is finished */
    BATCH_END_STOPPED,     /* stopped by a signal or max_runtime; rerun to resume */
    BATCH_END_REMAINS,     /* no_wait and other live runs hold items */
    BATCH_END_FAILED,      /* an error, in *err */
};

/* The run's totals, for its summary. */
struct batch_stats {
    int64_t run_id;            /* runs.id */
    double t_start;            /* when the run began (monotonic s) */
    double waited_s;           /* seconds spent waiting for items other runs held */
    int64_t items_done;        /* items committed done by this run */
    int64_t items_failed;      /* items committed failed by this run */
    int64_t items_dropped;     /* unfinished requests dropped when their lease was lost */
    int64_t items_returned;    /* items given back to the queue uncounted: those not started
                                  when the run stopped (at once), those unfinished after its
                                  grace, a failed job's */
    int64_t records_discarded; /* finished records not committed: their lease was lost */
    int64_t prompt_tokens;     /* of the requests the engine finished */
    int64_t completion_tokens; /* likewise */
    double *ttft_ms;           /* per finished request: time to first token (ms) */
    double *tpot_ms;           /* time per output token after the first (ms) */
    size_t n_lat;              /* entries in ttft_ms and tpot_ms */
    struct engine_stats engine; /* the engine's counters in the summary (steps, preemptions,
                                 * spec_*), summed over the run's jobs; spec_ece is the last
                                 * job's */
};

struct batch_run; /* opaque */

/* Open the queue (checked with quick_check; missing is an error unless o->create; a part in
 * use by another process is ST_ERR_BUSY), take over
 * dead runs and submits on this host, choose the jobs (o->job, else every ready job not
 * cancelled) and start the run row. o is borrowed for the run's life. Caller frees with
 * batch_run_free, also after a failure (*out may then be NULL). */
enum status batch_run_open(struct batch_run **out, const struct batch_opts *o,
                           struct err_detail *err);
/* Work the chosen jobs in turn: each job drained through the engine, or (done earlier) its
 * output sealed and its manifest made current. */
enum batch_end batch_run_jobs(struct batch_run *r, struct err_detail *err);
/* Record the end of the run (queue_run_end): items still leased go back to the queue, their
 * attempt counted, except after reason "error": a run that failed (an I/O error, a full disk)
 * gives them back uncounted first, since they did not make it fail. Attempts count against
 * items only when a run dies holding them (kill -9, a crash): the guard against an input that
 * crashes quern. */
enum status batch_run_end(struct batch_run *r, const char *reason, const char *summary_json,
                          struct err_detail *err);
/* Does a stop signal still end the run's waits for a locked queue (it holds no lease and has not
 * begun an orderly stop)? Then a run that failed with ST_ERR_BUSY after a signal was stopped, not
 * failed (its caller exits 75). */
int batch_run_interruptible(const struct batch_run *r);

/* The run's totals (valid until batch_run_free). */
const struct batch_stats *batch_run_stats(struct batch_run *r);
/* Free everything (closing the queue); NULL is a no-op. */
void batch_run_free(struct batch_run *r);

#endif
