/* The SQLite job queue: jobs, their items (one per request), the runs that work on them and the
 * output shards they write, with leases for claiming work and one transaction per shard flush
 * so that a record is in a shard iff its item is done (exactly-once output).
 *
 * Connections. A struct queue is one SQLite connection. Use it from one thread at a time; give
 * every process (and every thread that touches the queue) its own queue_open. Never carry an
 * open queue across fork(): open it again in the child. Any number of processes may share one
 * file: the database is in WAL mode, every write transaction is BEGIN IMMEDIATE, and a busy
 * database is waited for (busy timeout, default 30 s) before ST_ERR_BUSY is returned.
 *
 * Durability. synchronous=NORMAL (default) or FULL (queue_options.sync_full). In WAL mode
 * NORMAL keeps every committed transaction across a killed process (SIGKILL, OOM, crash); only
 * power loss or an OS crash can roll back the last few commits, never corrupt the file. Power
 * loss is out of scope for quern; even so the shard protocol stays exactly-once under it, since
 * shard bytes are fsynced before the transaction that counts them: a lost commit only means
 * those records are truncated away on restart and their items run again.
 *
 * Item life cycle (state, who moves it):
 *   queued  --claim-->              leased (attempts + 1, lease_owner = run, lease_expiry)
 *   leased  --commit_shard-->       done | failed (with the shard that holds its record)
 *   leased  --release-->            queued (attempts - 1: a graceful stop is not an attempt)
 *   leased  --lease expiry-->       queued (attempts kept: the run died holding it; less one
 *                                     when it had begun to stop: queue_run_stopping)
 *   leased  --run_end-->            queued (attempts kept; less one after queue_run_stopping)
 *   queued|leased --job_cancel-->   cancelled
 *   failed  --job_retry_failed-->   queued (attempts reset to 0; only items with a payload)
 * Items added with an error_code (a line rejected at submit) are queued without a payload: the
 * run that claims one writes its error record (the code and message given at submit) to an
 * errors shard and commits it as failed, so the job's output accounts for every input line.
 * Retry never re-queues them. (Schema version 1 added them as failed with no shard record.)
 *
 * Jobs being submitted. A submit writes its job in bounded transactions, so that it never
 * holds the write lock for long, yet the job appears all at once: queue_job_create with
 * spec.submit_run (a run of kind 'submit') creates the job not ready, the submit adds items
 * and heartbeats its run (queue_run_heartbeat) in transactions of its own size, and
 * queue_job_publish makes the job ready and ends the submit run in one transaction. Until
 * then the job is invisible to runs: no claim takes its items, queue_run_start refuses it, a
 * claim never marks it done, and queue_job_counts(0) leaves its items out; queue_job_list and
 * queue_job_get still return it with ready = false, for callers to skip or show. A not-ready
 * job whose submit run has ended (failed, interrupted, or found dead) can never become ready;
 * queue_job_discard (the submit giving up) and queue_jobs_gc (anyone, for a submit that was
 * killed) delete it and its items, which frees its name.
 *
 * The exactly-once rule. queue_commit_shard marks an item done/failed only while the item is
 * still `leased` AND its lease_owner is the committing run; the lease's expiry time is NOT
 * checked. This is safe because every transition above is a serialised transaction: an
 * expired lease is only taken away inside another run's claim (which changes lease_owner), so
 * while lease_owner still names us nobody else can have the item. If any item in the batch
 * fails the rule (re-claimed after expiry, released, or cancelled) the whole commit is rolled
 * back, nothing changes (not the items, not the shard length) and ST_ERR_CONFLICT is returned
 * with the offending items flagged in `lost`. The writer then truncates the shard file back to
 * its committed length, rewrites only the records of the items not lost, and commits again.
 * This is also how running workers notice a cancelled job; queue_lease_extend's count of leases
 * still held is the early warning.
 *
 * Times are unix milliseconds from the queue's clock (queue_set_clock, for tests). */
#ifndef QUEUE_QUEUE_H
#define QUEUE_QUEUE_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/proc.h"

#define QUEUE_SCHEMA_VERSION       8     /* PRAGMA user_version this build creates and knows */
/* The oldest schema version read read-only as it is (queue_options.read_only_ok): what status,
 * export and report read was all there by version 7 (version 8 added items.started). */
#define QUEUE_READ_ONLY_MIN_VERSION 7
#define QUEUE_DEFAULT_BUSY_MS      30000 /* default busy timeout */
#define QUEUE_DEFAULT_MAX_ATTEMPTS 3     /* items added with max_attempts 0 get this */
#define QUEUE_MAX_ERROR_CODES      16    /* error codes reported by queue_job_counts */

struct queue; /* one connection; opaque */

/* Job states. Readiness is apart from them: a job still being submitted is queued and not
 * ready (struct queue_job.ready; "Jobs being submitted" above); no claim moves it till ready. */
enum queue_job_state {
    QUEUE_JOB_QUEUED = 0, /* created, nothing claimed yet (or not ready: still being submitted) */
    QUEUE_JOB_RUNNING,    /* some item claimed; not every item finished */
    QUEUE_JOB_DONE,       /* no item queued or leased (set by commit or by an empty claim) */
    QUEUE_JOB_CANCELLED,  /* queue_job_cancel; no item will be claimed again */
    QUEUE_JOB_STATE_COUNT,
};

enum queue_item_state {
    QUEUE_ITEM_QUEUED = 0, /* waiting to be claimed */
    QUEUE_ITEM_LEASED,     /* claimed by a run until lease_expiry */
    QUEUE_ITEM_DONE,       /* result record committed in a results shard */
    QUEUE_ITEM_FAILED,     /* error record committed in an errors shard, or bad at submit */
    QUEUE_ITEM_CANCELLED,  /* its job was cancelled before it finished */
    QUEUE_ITEM_STATE_COUNT,
};

enum queue_shard_kind {
    QUEUE_SHARD_RESULTS = 0, /* records of done items */
    QUEUE_SHARD_ERRORS,      /* records of failed items */
    QUEUE_SHARD_KIND_COUNT,
};

enum queue_shard_state {
    QUEUE_SHARD_OPEN = 0, /* being appended to by its run; bytes past committed_bytes are junk */
    QUEUE_SHARD_CLOSED,   /* complete; sha256 covers exactly committed_bytes */
};

/* Names as stored in the database ("queued", "results", ...); never NULL. */
const char *queue_job_state_str(enum queue_job_state s);
const char *queue_item_state_str(enum queue_item_state s);
const char *queue_shard_kind_str(enum queue_shard_kind k);

/* ---- Connection ------------------------------------------------------------------------ */

struct queue_options {
    int busy_timeout_ms;  /* wait this long for a locked database; <= 0 means the default */
    bool sync_full;       /* synchronous=FULL instead of NORMAL (see Durability above) */
    bool must_exist;      /* a missing file (or an empty one) is ST_ERR_NOT_FOUND, nothing is
                             created; for commands that only look at or steer a queue */
    bool check_integrity; /* run PRAGMA quick_check before using the file: costs one read of
                             the whole database, so worth it where a run starts, not in a
                             status poll; any problem is ST_ERR_FORMAT */
    const volatile sig_atomic_t *interrupt; /* as queue_set_interrupt, from the open on */
    bool read_only_ok;    /* for commands that only read (status, export, report): a queue on
                             a read-only file system (an archive, a snapshot, a read-only
                             mount) is opened as it is stored, read-only (SQLite's immutable
                             mode: nothing written, not even the WAL's index), when its WAL
                             holds no commits the database lacks and its schema is at least
                             QUEUE_READ_ONLY_MIN_VERSION; queue_read_only then says so, and
                             every write fails */
    bool exclusive;       /* a part of a partitioned queue (or any file meant for one process
                             at a time): rollback journal instead of WAL, and the file's write
                             lock taken at open and held until queue_close (SQLite's
                             locking_mode EXCLUSIVE), so no other connection, in this process
                             or another, on this host or another, can use it meanwhile. Safe
                             on network file systems whose locks work (NFS with lockd or v4,
                             Lustre with flock), which are therefore not refused. A file
                             another connection holds is ST_ERR_BUSY after the busy timeout. */
};

/* While *flag (NULL: never) is nonzero, a wait for a locked database gives up at once (the call
 * fails with ST_ERR_BUSY) instead of lasting the busy timeout: for a run told to stop before it
 * holds anything, so that a signal is not ignored for 30 s behind another process's lock. */
struct queue;
void queue_set_interrupt(struct queue *q, const volatile sig_atomic_t *flag);

/* Open (creating if missing, unless must_exist) the queue at path and migrate it to
 * QUEUE_SCHEMA_VERSION. Nothing is written until the file has been inspected read-only, and a
 * refused file is left byte-for-byte as it was (journal mode included):
 *  - an SQLite database that is not a quern queue (user_version 0 with tables of its own, or a
 *    version >= 1 without quern's jobs, items, runs and shards tables): ST_ERR_FORMAT naming its
 *    tables;
 *  - a queue written by a newer quern (user_version > QUEUE_SCHEMA_VERSION): ST_ERR_UNSUPPORTED;
 *  - a file that is not SQLite, or a corrupt one (a damaged page met on the way, or anything
 *    quick_check reports with check_integrity): ST_ERR_FORMAT, with the advice to restore it
 *    or salvage it with `sqlite3 PATH .recover`;
 *  - a directory on a network or cluster file system (queue_fs_kind): ST_ERR_UNSUPPORTED, since
 *    SQLite's WAL index is shared memory that does not work across hosts. Nothing is created.
 * A new or empty file becomes a queue. SQLITE_CORRUPT met later by any call is ST_ERR_FORMAT
 * with the same advice, and so is a row that breaks the schema's rules (a NULL where the
 * schema says NOT NULL, an unknown state): the queue never hands out such a row.
 * On success *out is owned by the caller: close with queue_close. opts may be NULL.
 *
 * A part of a partitioned queue (queue_meta 'part' set) is refused without opts->exclusive:
 * opening it in WAL mode would break its rollback journal's promise (ST_ERR_INVALID_ARG).
 *
 * Test-only: QUERN_TEST_FS_MAGIC=0x6969 (any statfs f_type, C syntax) in the environment makes
 * the open treat the database's directory as that file system, so the network file system
 * refusal can be tested on a local disk. Never set it in production. */
enum status queue_open(struct queue **out, const char *path, struct err_detail *err);
enum status queue_open_opts(struct queue **out, const char *path, const struct queue_options *opts,
                            struct err_detail *err);

/* The file system with statfs f_type `magic` when it is one WAL cannot trust: NULL for any
 * other (local disks, tmpfs, overlayfs...). *refuse (may be NULL) is true for network and
 * cluster file systems (NFS, SMB/CIFS, Lustre, GPFS, CephFS, 9P, AFS, BeeGFS, OrangeFS), which
 * queue_open refuses; false for FUSE, which it only warns about: a FUSE mount may be local
 * (or one host's sshfs) and fine, or a cluster client (GlusterFS, ...) that is not. */
const char *queue_fs_kind(uint64_t magic, bool *refuse);

/* Close the connection, rolling back an open queue_tx_begin. queue_close(NULL) is a no-op. */
void queue_close(struct queue *q);

/* Whether q was opened read-only (queue_options.read_only_ok on a read-only file system). */
bool queue_read_only(const struct queue *q);

/* Schema version of the open database (QUEUE_SCHEMA_VERSION after a successful open). */
int queue_schema_version(struct queue *q);

/* The database file's absolute path (valid until queue_close). */
const char *queue_db_path(const struct queue *q);

/* The database's own id (32 hex digits, made when the file was created or migrated to
 * version 2) into out, for markers that tie output directories to it. */
enum status queue_db_uuid(struct queue *q, char out[33], struct err_detail *err);

/* The database's own facts (the meta table): the value of key into out (cap bytes, cut
 * short if longer) and *found; a missing key is ST_OK with *found false and out "". */
enum status queue_meta_get(struct queue *q, const char *key, char *out, size_t cap, bool *found,
                           struct err_detail *err);
/* Set key to value (created or replaced). Keys quern uses: 'db_uuid' (never change it), and
 * for a part of a partitioned queue 'part' (its index), 'parts' (how many) and 'part_set'
 * (the id the parts of one directory share). */
enum status queue_meta_set(struct queue *q, const char *key, const char *value,
                           struct err_detail *err);

/* Paths stored in the queue (a job's out_dir, shard paths) are absolute, or relative to the
 * directory that holds the database file. Resolve `stored` that way into out; ST_ERR_RANGE
 * when it does not fit in cap bytes. */
enum status queue_resolve_path(struct queue *q, const char *stored, char *out, size_t cap,
                               struct err_detail *err);

/* Replace the clock (unix ms) used for every timestamp and lease; NULL restores the real one.
 * For tests: lets lease expiry be exercised without sleeping. */
void queue_set_clock(struct queue *q, int64_t (*now_ms)(void *ctx), void *ctx);

/* ---- Transactions ---------------------------------------------------------------------- */

/* Group many calls into one write transaction (BEGIN IMMEDIATE: takes the write lock now, so
 * it never fails half-way on a lock). Inside it every queue_ call joins the transaction and
 * undoes its own partial work on failure (savepoints), so a failed call, e.g. a duplicate
 * custom_id, leaves the transaction usable. Not nestable: a second begin is ST_ERR_INVALID_ARG.
 * Hold it briefly; other processes wait on it. */
enum status queue_tx_begin(struct queue *q, struct err_detail *err);
enum status queue_tx_commit(struct queue *q, struct err_detail *err);
/* Roll back; a no-op without an open transaction. */
void queue_tx_rollback(struct queue *q);

/* A read transaction (deferred BEGIN): every read until queue_read_end sees one snapshot of the
 * queue, as a reader that combines several queries needs (a commit between two of them would
 * be half seen); writers go on meanwhile in WAL mode. Not nestable, nor inside queue_tx_begin;
 * only reads belong in it. */
enum status queue_read_begin(struct queue *q, struct err_detail *err);
void queue_read_end(struct queue *q);

/* ---- Jobs ------------------------------------------------------------------------------ */

/* What queue_job_create copies; every pointer is borrowed for the call. */
struct queue_job_spec {
    const char *name;         /* unique; [A-Za-z0-9._-], 1-128 chars, not all digits, no
                                 leading '.'; used as the output directory name */
    const char *model_path;   /* GGUF path */
    const char *model_sha256; /* hex digest of the model file, or NULL */
    const char *params_json;  /* sampling defaults etc. as JSON text; NULL means "{}" */
    const char *out_dir;      /* output directory for this job's shards */
    uint64_t seed;            /* job seed (per-request RNGs derive from it) */
    int64_t submit_run;       /* 0: the job is ready at once; else the run (kind 'submit') that
                                 writes it: not ready until queue_job_publish */
};

/* A job row. Strings are owned by the struct: free them with queue_job_free. */
struct queue_job {
    int64_t id;                 /* jobs.id, > 0 */
    char *name;                 /* unique job name */
    int64_t created;            /* unix ms */
    int64_t finished;           /* unix ms when done or cancelled; 0 while not */
    enum queue_job_state state; /* see enum */
    char *model_path;           /* GGUF path */
    char *model_sha256;         /* may be NULL */
    char *params_json;          /* JSON text, never NULL */
    char *out_dir;              /* output directory */
    uint64_t seed;              /* job seed */
    int64_t n_items;            /* items added to the job */
    bool ready;                 /* false while its submit is still adding items: runs skip it */
    int64_t submit_run;         /* the submit run that wrote it, 0 if none */
};

/* Create a job in state queued, ready unless spec->submit_run is set (see "Jobs being
 * submitted" above). A duplicate name is ST_ERR_EXISTS (nothing created), a bad name
 * ST_ERR_INVALID_ARG. */
enum status queue_job_create(struct queue *q, const struct queue_job_spec *spec, int64_t *job_id,
                             struct err_detail *err);

/* A job name becomes a directory name: [A-Za-z0-9._-]{1,128}, no leading '.', not all digits
 * (so that queue_job_find can tell names from ids); else ST_ERR_INVALID_ARG saying why. */
enum status queue_job_name_check(const char *name, struct err_detail *err);

/* Fill *out (caller-owned struct, strings freed with queue_job_free) from the job with this id,
 * or ST_ERR_NOT_FOUND. */
enum status queue_job_get(struct queue *q, int64_t job_id, struct queue_job *out,
                          struct err_detail *err);

/* Like queue_job_get by name, or by id when `id_or_name` is all digits (names never are). */
enum status queue_job_find(struct queue *q, const char *id_or_name, struct queue_job *out,
                           struct err_detail *err);

/* queue_job_find for commands that act on a job's items (cancel, retry, export, report): a job
 * still being submitted, or left half-written by a submit that was killed, is ST_ERR_BUSY
 * saying so (*out cleared): it holds no job's items yet. */
enum status queue_job_find_ready(struct queue *q, const char *id_or_name, struct queue_job *out,
                                 struct err_detail *err);

/* Every job, oldest first, in a malloc'd array the caller frees with queue_job_list_free. */
enum status queue_job_list(struct queue *q, struct queue_job **jobs, size_t *n,
                           struct err_detail *err);

/* Free the strings of one job (not the struct itself); NULL is a no-op. */
void queue_job_free(struct queue_job *j);
/* Free an array from queue_job_list; NULL is a no-op. */
void queue_job_list_free(struct queue_job *jobs, size_t n);

/* Set the job's output root (stored as given; make it absolute). */
enum status queue_job_set_out_dir(struct queue *q, int64_t job_id, const char *out_dir,
                                  struct err_detail *err);

/* Cancel: every queued or leased item becomes cancelled, the job becomes cancelled. Done and
 * failed items keep their records. Runs holding leases find out when their next
 * queue_commit_shard returns ST_ERR_CONFLICT (or queue_lease_extend reports fewer leases).
 * Cancelling a done or cancelled job changes nothing. Committed in transactions of at most
 * QUEUE_JOB_BATCH items (queue_set_job_batch), the job marked with the last, so that no
 * other process waits on the queue for long; an error or a kill part-way leaves the job live
 * with the items cancelled so far (a run may still work the others), and cancelling it again
 * finishes it (if runs finish the others first, the job ends cancelled all the same: a job
 * with cancelled items never ends done). *n_cancelled (may be NULL) gets the number of items
 * cancelled by this call, also on error. Fault site: queue.cancel (after each full batch). */
enum status queue_job_cancel(struct queue *q, int64_t job_id, int64_t *n_cancelled,
                             struct err_detail *err);

/* Items per transaction of queue_job_cancel and queue_job_retry_failed (QUEUE_JOB_BATCH from
 * queue_open; n <= 0 restores it). */
#define QUEUE_JOB_BATCH 20000
void queue_set_job_batch(struct queue *q, int64_t n);

/* Retry: every failed item goes back to queued with attempts reset to 0 and its error cleared;
 * a done job becomes running again. Its old error record stays in its errors shard but no
 * longer counts: the item no longer points at that shard, and the shard's `superseded` count
 * grows by one, so export keeps a record only while its item still names its shard. A
 * cancelled job is ST_ERR_INVALID_ARG. One transaction per QUEUE_JOB_BATCH item ids (each whole:
 * items, counts and the job's state), so an error or a kill part-way leaves the rest failed,
 * for another retry. *n_retried (may be NULL) gets the number of items, also on error. Fault
 * site: queue.retry (after each transaction but the last). */
enum status queue_job_retry_failed(struct queue *q, int64_t job_id, int64_t *n_retried,
                                   struct err_detail *err);

/* Error code and how many failed items carry it. */
struct queue_error_count {
    char code[64]; /* error_code as stored (truncated to 63 bytes); "" for none */
    int64_t count; /* failed items with this code */
};

/* Progress of a job (or of every job). */
struct queue_counts {
    int64_t items[QUEUE_ITEM_STATE_COUNT]; /* items per enum queue_item_state */
    int64_t total;                         /* all items */
    int64_t prompt_tokens;                 /* sum over finished items */
    int64_t completion_tokens;             /* sum over finished items */
    int64_t attempts;                      /* sum of attempts (claims not given back) */
    size_t n_error_codes;                  /* entries used in errors[] */
    struct queue_error_count errors[QUEUE_MAX_ERROR_CODES]; /* most frequent first */
};

/* Counts for job_id, or for all ready jobs when job_id is 0. Reads every item of the job (2 s
 * at 5M items): for what a run asks again and again, queue_job_unfinished. */
enum status queue_job_counts(struct queue *q, int64_t job_id, struct queue_counts *out,
                             struct err_detail *err);

/* job_id's queued and leased items (either pointer may be NULL), counted through an index: the
 * cost follows those items, not the job's size. */
enum status queue_job_unfinished(struct queue *q, int64_t job_id, int64_t *queued, int64_t *leased,
                                 struct err_detail *err);

/* Has any run (kind 'run'; submits do not count) ever started on this queue file? *any 1 or 0.
 * (A part of a partitioned queue worked on before, rather than one whose task never started.) */
enum status queue_runs_any(struct queue *q, int *any, struct err_detail *err);

/* The sha256 of the model file at path (SHA256_HEX_LEN with its NUL): the one recorded in the
 * queue when the file, as stat shows it now (device, inode, size, modification and change
 * times), was hashed before; else read and hashed now and recorded (only when the file did not
 * change while it was read and was last changed over 2 s before, so that a write within the
 * clock's granularity cannot hide behind an unchanged identity). *cached (may be NULL) says
 * whether the file was read. A failed record only costs the next caller a read. */
enum status queue_model_sha(struct queue *q, const char *path, char *sha, int *cached,
                            struct err_detail *err);

/* For a submit, which must not create a queue file before the model is hashed: the hash of
 * path recorded in the queue file db_path, if that file exists, is a queue and knows the file
 * as it is now (1; sha set), else 0. Opens db_path read-only, creates and changes nothing. */
int queue_model_sha_peek(const char *db_path, const char *path, char *sha);

/* Record sha as the hash of path, read when stat gave *before, if the file is still so and was
 * last changed over 2 s before (as queue_model_sha records). Failures are ignored. */
struct file_version;
void queue_model_sha_note(struct queue *q, const char *path, const struct file_version *before,
                          const char *sha);

/* ---- Items ----------------------------------------------------------------------------- */

/* What queue_item_add copies; every pointer is borrowed for the call. */
struct queue_item_spec {
    const char *custom_id;  /* unique within the job; may be NULL only for a rejected line */
    const char *source;     /* input file name (+ archive member), or NULL */
    int64_t line_no;        /* 1-based line in source; 0 if unknown */
    const char *payload;    /* request JSON text; may be NULL only for a rejected line */
    int32_t priority;       /* higher is claimed first; 0 normally */
    int32_t max_attempts;   /* 0 means QUEUE_DEFAULT_MAX_ATTEMPTS */
    const char *error_code; /* non-NULL: a line rejected at submit (see the life cycle) */
    const char *error_msg;  /* human-readable reason for a rejected line */
    const char *error_param; /* the request field it names (its error's param), or NULL */
};

/* Add one item to a job (queued; a rejected line when it->error_code is set). A custom_id already
 * used in the job is ST_ERR_EXISTS and inserts nothing; a missing job is ST_ERR_NOT_FOUND, a
 * cancelled one ST_ERR_INVALID_ARG. Adding a queued item to a done job makes it running.
 * *item_id (may be NULL) gets the new id. Call inside queue_tx_begin/commit for bulk loads. */
enum status queue_item_add(struct queue *q, int64_t job_id, const struct queue_item_spec *it,
                           int64_t *item_id, struct err_detail *err);

/* ---- Runs ------------------------------------------------------------------------------ */

/* What queue_run_start copies; pointers borrowed for the call. */
struct queue_run_spec {
    int64_t job_id;        /* job this run works on, 0 for any */
    const char *worker_id; /* free-form worker name (e.g. Slurm job/task id), or NULL */
    const char *host;      /* host name, or NULL */
    int64_t pid;           /* process id */
    const char *boot_id;   /* the host's boot id (common/proc.h), or NULL */
    const char *pid_ns;    /* the process's PID namespace, or NULL */
    int64_t pstart;        /* the process's start time in clock ticks after boot, 0 unknown */
    bool submit;           /* a submit writing a job (kind 'submit'), not a run */
};

/* Record a new run (started = heartbeat = now). Run ids are never reused. Give host, boot_id,
 * pid_ns, pid and pstart (proc_identity_self) so that queue_reap_dead on the same host can
 * tell at once when this process is gone. A job_id that names no job is ST_ERR_NOT_FOUND, a
 * job still being submitted (not ready) ST_ERR_INVALID_ARG. */
enum status queue_run_start(struct queue *q, const struct queue_run_spec *spec, int64_t *run_id,
                            struct err_detail *err);

/* End a run: ended = now, exit_reason and summary_json (both may be NULL) stored. Items it
 * still leases go back to queued with their attempt counted (a run that ends holding work did
 * not finish it; release first to give items back uncounted). *n_requeued may be NULL. A run
 * that already ended is ST_ERR_INVALID_ARG. */
enum status queue_run_end(struct queue *q, int64_t run_id, const char *exit_reason,
                          const char *summary_json, int64_t *n_requeued, struct err_detail *err);

/* Heartbeat without leases: the run's heartbeat is now (a submit calls this with every
 * commit). A run that has ended (e.g. ended as dead by another process) is ST_ERR_CONFLICT, a
 * missing one ST_ERR_INVALID_ARG. */
enum status queue_run_heartbeat(struct queue *q, int64_t run_id, struct err_detail *err);

/* A heartbeat that also records that the run has begun to stop (a signal, --max-runtime): if it
 * dies from here on (killed when its grace outlasts the scheduler's patience), its leases go
 * back to queued with attempts - 1, as a graceful stop's (queue_release) do, whether a run on
 * this host finds it dead or its leases expire. Once per run is enough; again is harmless. It
 * never waits for a lock: ST_ERR_BUSY while another process writes (try again later). */
enum status queue_run_stopping(struct queue *q, int64_t run_id, struct err_detail *err);

/* A heartbeat that also stores progress_json (a JSON object of the run's live numbers, or NULL
 * to clear it) in the run's row, for observers (queue_run_list_live). One autocommit UPDATE; a
 * run calls it about once a second at most. Errors as queue_run_heartbeat. */
enum status queue_run_progress(struct queue *q, int64_t run_id, const char *progress_json,
                               struct err_detail *err);

/* Store engine_json (a JSON object: what can change the run's outputs, docs/ARCHITECTURE.md
 * "Provenance") in the run's row; the run calls it when its engine for a job is ready. Errors
 * as queue_run_heartbeat. */
enum status queue_run_set_engine(struct queue *q, int64_t run_id, const char *engine_json,
                                 struct err_detail *err);

/* Which run wrote how many of a shard's records: one row per (shard, run). */
struct queue_writer {
    int64_t shard_id;  /* shards.id */
    int64_t run_id;    /* the run that committed them (0: unknown) */
    uint64_t records;  /* how many of the job's finished items have their record there */
    char *host;        /* the run's host, or NULL */
    char *engine_json; /* the run's engine_json, or NULL */
};

/* For every shard of job_id holding records of finished (done or failed) items, the runs that
 * committed them, ordered by shard then run; one read over the job's items (for manifests,
 * not for polling). *w is malloc'd (NULL when *n is 0); free with queue_writers_free. */
enum status queue_job_writers(struct queue *q, int64_t job_id, struct queue_writer **w, size_t *n,
                              struct err_detail *err);
void queue_writers_free(struct queue_writer *w, size_t n);

/* A run (kind 'run') that has not ended, as queue_run_list_live reports it. Strings owned by
 * the array. */
struct queue_run_info {
    int64_t id;            /* runs.id */
    int64_t job_id;        /* the job it was started for, 0 for any */
    char *worker_id;       /* worker name, or NULL */
    char *host;            /* host name, or NULL */
    int64_t pid;           /* process id */
    int64_t started_ms;    /* start, unix ms */
    int64_t heartbeat_ms;  /* last heartbeat, unix ms */
    int64_t age_ms;        /* now - heartbeat_ms by the queue's clock (>= 0) */
    char *progress_json;   /* last queue_run_progress document, or NULL */
    int64_t ended_ms;      /* when it ended, unix ms; 0 while not (always, for a live run) */
    char *exit_reason;     /* how it ended ("drained", "signal", "dead", ...), or NULL */
    char *engine_json;     /* queue_run_set_engine's document, or NULL (none yet, a run of an
                              older quern) */
    int worked;            /* queue_run_list_job: its samples of the job show work (a prompt
                              or generated token) or it made a shard of the job with records; 0
                              from queue_run_list_live */
    int gone;              /* not ended, yet its process is known to have exited (a run of this
                              host whose process is gone): dead, not yet noticed, as when ending
                              it failed (a full disk) */
};

/* Every run not ended (alive, or dead and not yet noticed: see age_ms), oldest first, in one
 * read. *runs is malloc'd (NULL when *n is 0); free with queue_run_info_free. */
enum status queue_run_list_live(struct queue *q, struct queue_run_info **runs, size_t *n,
                                struct err_detail *err);
/* The run (kind 'run') that ended last, as queue_run_list_live lists (*n 0 or 1), with its
 * summary_json (the run's JSON summary: exit_reason, and error for a failed run) in
 * progress_json. */
enum status queue_run_last_ended(struct queue *q, struct queue_run_info **runs, size_t *n,
                                 struct err_detail *err);
/* Every run (kind 'run') that worked on job_id, ended or not, oldest first: runs started for
 * it, and runs started for any job that recorded samples for it (queue_sample_add); free with
 * queue_run_info_free. For reports: a run not ended whose heartbeat stopped was killed (or is
 * still running). */
enum status queue_run_list_job(struct queue *q, int64_t job_id, struct queue_run_info **runs,
                               size_t *n, struct err_detail *err);
/* Free an array from queue_run_list_live or queue_run_list_job; NULL is a no-op. */
void queue_run_info_free(struct queue_run_info *runs, size_t n);

/* ---- Time series: a run's samples ------------------------------------------------------ */

/* What a sample holds besides its time, run and job; counters are cumulative from the start
 * of the run's work on the job (its engine), gauges are the moment's. */
enum queue_sample_field {
    QUEUE_SAMPLE_DONE = 0,       /* the job's items finished with a result (all runs) */
    QUEUE_SAMPLE_FAILED,         /* ... with an error record */
    QUEUE_SAMPLE_GEN_TOKENS,     /* counter: tokens generated */
    QUEUE_SAMPLE_PROMPT_TOKENS,  /* counter: prompt tokens computed */
    QUEUE_SAMPLE_CACHED_TOKENS,  /* counter: prompt tokens found in the prefix cache */
    QUEUE_SAMPLE_RUNNING,        /* gauge: sequences running */
    QUEUE_SAMPLE_WAITING,        /* gauge: requests waiting */
    QUEUE_SAMPLE_KV_USED,        /* gauge: KV blocks in use */
    QUEUE_SAMPLE_KV_TOTAL,       /* gauge: KV blocks in the pool */
    QUEUE_SAMPLE_STEPS,          /* counter: forward steps */
    QUEUE_SAMPLE_BATCH_TOKENS,   /* counter: tokens over those steps */
    QUEUE_SAMPLE_SPEC_DRAFTED,   /* counter: draft tokens verified (speculative decoding) */
    QUEUE_SAMPLE_SPEC_ACCEPTED,  /* counter: ... and accepted */
    QUEUE_SAMPLE_FIELDS,
};

/* The column name of field f ("done", "gen_tokens", ...); NULL out of range. */
const char *queue_sample_field_name(int f);

struct queue_sample {
    int64_t t_ms;                   /* when, unix ms (queue clock); 0 in queue_sample_add: now */
    int64_t run_id;                 /* the run */
    int64_t job_id;                 /* the job */
    int64_t v[QUEUE_SAMPLE_FIELDS]; /* by enum queue_sample_field */
};

/* Append one sample (one autocommit INSERT). */
enum status queue_sample_add(struct queue *q, const struct queue_sample *s, struct err_detail *err);

/* Every sample of job_id, oldest first, in a malloc'd array (NULL when *n is 0) the caller
 * frees with free(). */
enum status queue_sample_list(struct queue *q, int64_t job_id, struct queue_sample **out,
                              size_t *n, struct err_detail *err);

/* The dead-run rule. A run is dead when it has ended, or when its heartbeat is older than the
 * lease the observer uses, or (without waiting for any lease) when it ran on the observer's
 * host, boot and PID namespace and its process is gone (common/proc.h: proc_liveness). Across
 * hosts only the heartbeat can tell, except in an exclusive file (a part): its holder is the
 * only process using it, so every run of another host not ended is dead. queue_reap_dead
 * applies the last two cases: every run not ended whose process `self` can see is dead (and in
 * an exclusive file every other host's) is ended now (exit_reason "dead") and its leases
 * go back to queued with their attempts kept (less one if it had begun to stop), exactly as if
 * they had expired; its open shards
 * can then be adopted at once. *n_reaped (may be NULL) gets the number of runs ended. */
enum status queue_reap_dead(struct queue *q, const struct proc_identity *self, int64_t *n_reaped,
                            struct err_detail *err);

/* ---- Jobs being submitted (see "Jobs being submitted" at the top) ---------------------- */

/* Submit runs whose heartbeat is older than this are dead for queue_jobs_gc callers that have
 * no lease of their own to go by (submit, status); a submit heartbeats about every second. */
#define QUEUE_DEFAULT_SUBMIT_STALE_MS 300000

/* In one transaction: make the not-ready job_id ready and end its submit run (exit_reason
 * "submitted", summary_json stored; may be NULL). ST_ERR_NOT_FOUND if the job is gone (deleted
 * as dead), ST_ERR_CONFLICT if its submit run has ended (the job will be deleted),
 * ST_ERR_INVALID_ARG if it is ready already. */
enum status queue_job_publish(struct queue *q, int64_t job_id, const char *summary_json,
                              struct err_detail *err);

/* A ready job without items (a part that got no line, an empty input) is done: marked so when
 * it is still queued (queue_job_publish does it; a queue of an older quern may hold such a job
 * queued). */
enum status queue_job_finish_empty(struct queue *q, int64_t job_id, struct err_detail *err);

/* Delete a job that is not ready, with its items: first its submit run is ended with
 * exit_reason (when still open), so the job can never become ready, then the items go in
 * transactions of at most 10,000 rows and the job last; a discard cut short is finished by
 * queue_jobs_gc. Call it outside queue_tx_begin to keep the transactions short. A ready job is
 * ST_ERR_INVALID_ARG, a missing one ST_ERR_NOT_FOUND. *n_items (may be NULL) gets the number
 * of items deleted. */
enum status queue_job_discard(struct queue *q, int64_t job_id, const char *exit_reason,
                              int64_t *n_items, struct err_detail *err);

/* Collect the jobs of dead submits: queue_reap_dead(self) first (self may be NULL: skip it),
 * then queue_job_discard every not-ready job whose submit run has ended, or whose heartbeat is
 * older than stale_ms (<= 0: never) unless `self` can see that its process is alive; such a
 * run is ended as "dead". A job that a run or shard names is left alone. Call it before
 * creating a job (to reuse a dead submit's name) and when listing jobs. *n_deleted (may be
 * NULL) gets the number of jobs deleted. */
enum status queue_jobs_gc(struct queue *q, const struct proc_identity *self, int64_t stale_ms,
                          int64_t *n_deleted, struct err_detail *err);

/* ---- Claiming and leases --------------------------------------------------------------- */

/* A claimed item. Strings owned by the array: free with queue_claimed_free. */
struct queue_claimed {
    int64_t id;           /* items.id */
    int64_t job_id;       /* its job */
    char *custom_id;      /* NULL only for a line rejected at submit without a usable id */
    char *payload;        /* request JSON text; NULL for a line rejected at submit */
    char *error_code;     /* non-NULL for a line rejected at submit: write this error */
    char *error_msg;      /* its reason, or NULL */
    char *error_param;    /* the field it names, or NULL */
    char *source;         /* input file (+ member), or NULL */
    int64_t line_no;      /* 1-based input line, 0 if unknown */
    int32_t priority;     /* as added */
    int32_t attempts;     /* including this claim (1 on the first) */
    int32_t max_attempts; /* attempts > max_attempts: the worker should fail the item (e.g.
                             "attempts_exhausted") without running it */
};

/* In one BEGIN IMMEDIATE transaction: return every expired lease of other runs to queued (the
 * claiming run's own leases are never swept by itself: it still holds those items), then
 * lease up to max_items queued items of job_id (0 = any job) to run_id until now + lease_ms,
 * highest priority first, then lowest id; items of a job that is not ready are never taken.
 * *items is a malloc'd array in that order (NULL when *n is 0) that the caller frees with
 * queue_claimed_free. A claim that finds nothing marks finished (ready) jobs done. The run
 * must exist and not have ended (ST_ERR_INVALID_ARG). */
enum status queue_claim(struct queue *q, int64_t job_id, int64_t run_id, int max_items,
                        int64_t lease_ms, struct queue_claimed **items, size_t *n,
                        struct err_detail *err);
/* Free an array from queue_claim; NULL is a no-op. */
void queue_claimed_free(struct queue_claimed *items, size_t n);

/* Heartbeat: every lease still held by run_id now expires at now + lease_ms, and the run's
 * heartbeat is now. *n_held (may be NULL) gets how many leases the run still holds (fewer than
 * it thinks: some expired and were re-claimed, or were cancelled). */
enum status queue_lease_extend(struct queue *q, int64_t run_id, int64_t lease_ms, int64_t *n_held,
                               struct err_detail *err);

/* The items whose leases run_id holds now, ascending, into *ids (malloc'd, free() it; NULL when
 * *n is 0): after queue_lease_extend reports fewer than the run thinks, which ones it lost. */
enum status queue_lease_list(struct queue *q, int64_t run_id, int64_t **ids, size_t *n,
                             struct err_detail *err);

/* Graceful give-back: each listed item (ids NULL: every item) still leased by run_id goes back
 * to queued with attempts - 1, since the item was not tried to the end. Items not leased by
 * run_id are skipped. *n_released (may be NULL) gets how many moved. */
enum status queue_release(struct queue *q, int64_t run_id, const int64_t *ids, size_t n,
                          int64_t *n_released, struct err_detail *err);

/* Whether the computation of each listed item still leased by run_id may have begun, in one
 * transaction: a claim marks its items started (parsing and tokenizing them may crash the run);
 * the run clears the mark once it has admitted them (started 0) and sets it again before the
 * engine first computes them (started 1). A run that dies holding an item not marked did
 * not die of it: whoever requeues it (queue_reap_dead, expired leases) takes its attempt back. */
enum status queue_mark_started(struct queue *q, int64_t run_id, const int64_t *ids, size_t n,
                               int started, struct err_detail *err);

/* Make room after "database or disk is full": checkpoint the WAL into the database and cut it
 * to zero bytes (SQLITE_CHECKPOINT_TRUNCATE; waits up to the busy timeout for other
 * connections' readers). A small transaction after it needs no new space where it only changes
 * existing rows: a run that failed on a full disk can still give its items back, so they keep
 * their attempts. */
enum status queue_make_room(struct queue *q, struct err_detail *err);

/* Copy the WAL's commits into the database now (SQLITE_CHECKPOINT_PASSIVE: never waits for
 * other connections; what their readers still need stays in the WAL), so a failure (an fsync's
 * EIO: a failing disk) is reported rather than swallowed by SQLite's automatic checkpoints and
 * sqlite3_close. Nothing is lost when it fails: the WAL keeps the commits and the next
 * connection recovers them. Fault site "queue.checkpoint" ("fail": an I/O error). */
enum status queue_checkpoint(struct queue *q, struct err_detail *err);

/* Keep a reserve file beside the queue (QUEUE_RESERVE_NAME in its directory, one for every queue
 * there; QUEUE_RESERVE_BYTES or half the free space, whichever is less; made only where none
 * is) that queue_make_room deletes first: a
 * checkpoint may need to grow the database file, and a give-back needs room in the WAL, so on
 * a file system that filled while the run worked, the space kept lets the failing run give its
 * items back and record its end. Best effort (nothing said when it cannot be made). */
void queue_reserve_keep(struct queue *q);
#define QUEUE_RESERVE_BYTES (2u << 20)
#define QUEUE_RESERVE_NAME  ".quern-reserve"

/* Return every expired lease to queued (attempts kept, less one where the run holding it had
 * begun to stop) now; claims also do this.
 * *n_expired may be NULL. */
enum status queue_lease_expire(struct queue *q, int64_t *n_expired, struct err_detail *err);

/* ---- Shards ---------------------------------------------------------------------------- */

/* A shard row. path is owned by the struct (queue_shard_list_free). */
struct queue_shard {
    int64_t id;                   /* shards.id */
    int64_t job_id;               /* its job */
    enum queue_shard_kind kind;   /* results or errors */
    int64_t seq;                  /* 0, 1, 2 ... per (job, kind) */
    char *path;                   /* file path, unique */
    int64_t run_id;               /* run that writes (or last wrote) it */
    uint64_t committed_bytes;     /* valid prefix of the file */
    uint64_t records;             /* records in that prefix */
    uint64_t superseded;          /* records whose item was retried since (errors shards) */
    enum queue_shard_state state; /* open or closed */
    char sha256[65];              /* hex digest of the committed bytes once closed; "" if open */
};

/* Next seq for (job_id, kind): one past the largest used, 0 for the first. To make seq, path
 * and the row agree under concurrency, call it and queue_shard_create inside one
 * queue_tx_begin/commit. */
enum status queue_shard_next_seq(struct queue *q, int64_t job_id, enum queue_shard_kind kind,
                                 int64_t *seq, struct err_detail *err);

/* Record a new open shard written by run_id. A used (job, kind, seq) or path is ST_ERR_EXISTS.
 * Create the file with O_TRUNC: a file left by a rolled-back create may exist. */
enum status queue_shard_create(struct queue *q, int64_t run_id, int64_t job_id,
                               enum queue_shard_kind kind, int64_t seq, const char *path,
                               int64_t *shard_id, struct err_detail *err);

/* Take over an open shard of another run that is dead: ended, or no heartbeat for stale_ms.
 * Succeeds for exactly one caller; afterwards that caller truncates the file to
 * committed_bytes and appends to it or closes it. ST_ERR_CONFLICT if its run is still alive
 * (or the shard is closed), ST_ERR_NOT_FOUND if there is no such shard. */
enum status queue_shard_adopt(struct queue *q, int64_t shard_id, int64_t run_id, int64_t stale_ms,
                              struct err_detail *err);

/* Close an open shard owned by run_id, recording the hex sha256 of its committed bytes. */
enum status queue_shard_close(struct queue *q, int64_t run_id, int64_t shard_id,
                              const char *sha256_hex, struct err_detail *err);

/* Shards of job_id (0: all jobs) ordered by job, kind, seq, in a malloc'd array the caller
 * frees with queue_shard_list_free. */
enum status queue_shard_list(struct queue *q, int64_t job_id, struct queue_shard **shards,
                             size_t *n, struct err_detail *err);
void queue_shard_list_free(struct queue_shard *shards, size_t n);

/* The outcome of one item in a shard flush; pointers borrowed for the call. */
struct queue_done {
    int64_t item_id;           /* a leased item of the shard's job */
    const char *error_code;    /* NULL: done (results shard); else failed (errors shard) */
    const char *error_msg;     /* for failed items */
    int64_t prompt_tokens;     /* tokens in the rendered prompt */
    int64_t completion_tokens; /* tokens generated */
    double ttft_ms;            /* time to first token; <= 0: unknown (stored as NULL) */
    double tpot_ms;            /* time per output token after the first; <= 0: unknown */
};

/* The commit of a shard flush, in ONE transaction: every item in done[] becomes done (results
 * shard) or failed (errors shard) pointing at this shard, and the shard's committed length
 * and record count become committed_bytes and records. Requires: the shard is open and owned
 * by run_id; committed_bytes >= the committed length so far; records == records so far +
 * n_done; every item belongs to the shard's job and is leased by run_id (the exactly-once rule
 * at the top of this file). Otherwise nothing changes: ST_ERR_CONFLICT when items are no longer
 * ours (each such done[i] flagged in lost[i] when lost is not NULL; the others set false),
 * ST_ERR_INVALID_ARG for the rest. A finished job becomes done. done[i] is the shard's record
 * number (records so far) + i, stored as the item's shard_record. When the shard itself is no
 * longer ours (adopted by another run, which took it for dead) the result is ST_ERR_CONFLICT
 * with no lost[] flag set: the caller must stop writing that shard. */
enum status queue_commit_shard(struct queue *q, int64_t run_id, int64_t shard_id,
                               uint64_t committed_bytes, uint64_t records,
                               const struct queue_done *done, size_t n_done, bool *lost,
                               struct err_detail *err);

/* ---- item scans (export, status) ---- */

struct queue_item_info {
    int64_t id;                  /* items.id */
    const char *custom_id;       /* may be NULL for a line that failed at submit */
    const char *source;          /* input file (+ member), may be NULL */
    int64_t line_no;             /* 1-based line in source, 0 if unknown */
    enum queue_item_state state; /* current state */
    int64_t shard_id;            /* shard holding its record, 0 if none */
    int64_t shard_record;        /* index of its record among that shard's records, -1 if
                                    unknown (committed by schema version 1) */
    const char *payload;         /* request JSON, NULL for a line rejected at submit */
    const char *error_code;      /* for failed items, else NULL */
    const char *error_msg;       /* for failed items, else NULL */
    const char *error_param;     /* the request field a line rejected at submit named, or NULL */
    int64_t prompt_tokens;       /* usage of a finished item (0 when unknown) */
    int64_t completion_tokens;   /* likewise */
    double ttft_ms;              /* time to first token, < 0 when unknown */
    double tpot_ms;              /* time per output token after the first, < 0 when unknown */
    int32_t attempts;            /* claims that counted */
};

/* Called once per item; a non-OK return stops the scan and is returned by it. Pointers in
 * *it are valid only during the call. */
typedef enum status (*queue_item_fn)(void *user, const struct queue_item_info *it);

/* Every item of job_id in input order: id order, the order submit read the files (as given)
 * and their lines in. One read transaction. */
enum status queue_item_scan(struct queue *q, int64_t job_id, queue_item_fn fn, void *user,
                            struct err_detail *err);

/* queue_item_scan of the done and failed items only (what export and report read), payload
 * always NULL: its cost follows the finished items, not the job's size. */
enum status queue_item_scan_finished(struct queue *q, int64_t job_id, queue_item_fn fn, void *user,
                                     struct err_detail *err);

/* Wall-clock spans of the runs' work on job_id (kind 'run'; submits do not count): a run started
 * for the job from its start to its end or last heartbeat (a run found dead: its last
 * heartbeat); a run over several jobs from the end of its work on the job before (its samples
 * tell) to its last sample of this one, or its end (heartbeat) when it did nothing else after;
 * first start and last end, unix ms, and *worked_ms (may be NULL) the time covered by at least
 * one of the spans (the time between runs left out); all 0 when no run has worked on it.
 * job_id 0: every run's span. */
enum status queue_job_timing(struct queue *q, int64_t job_id, int64_t *first_ms, int64_t *last_ms,
                             int64_t *worked_ms, struct err_detail *err);

#endif
