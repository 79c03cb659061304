/* What the files of batch/ share and callers never see: the state of a run (struct batch_run),
 * owned by batch/run.c, and the progress bookkeeping batch/progress.c keeps in it. */
#ifndef BATCH_BATCH_INTERNAL_H
#define BATCH_BATCH_INTERNAL_H

#include <sys/stat.h>

#include "batch/batch.h"
#include "common/fileid.h"
#include "common/proc.h"
#include "common/sha256.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "io/manifest.h"
#include "jobs/params.h"
#include "jobs/request.h"
#include "queue/queue.h"

/* Per-request state travelling through the engine as its user pointer. */
struct batch_inflight {
    int64_t item_id;                    /* queue item */
    char *custom_id;                    /* owned */
    enum job_kind kind;                 /* chat or completion */
    struct batch_inflight *prev, *next; /* in batch_run.inflight, while the engine holds it */
    int n_choices;                      /* choices the request asked for (n) */
    int n_got;                          /* of those, finished so far */
    int grammar_stuck;                  /* a choice ended because its grammar allowed no token */
    int started;                        /* the queue marks it started (queue_mark_started):
                                           the engine may compute it (start_gate; 2 while
                                           start_gate marks it) */
    int32_t n_prompt;                   /* prompt tokens */
    int32_t n_cached;                   /* of those, choice 0 found in the prefix cache */
    double ttft_ms;                     /* time to first token of its first choice, 0 = none */
    double decode_ms;                   /* summed over choices: first token to last ... */
    int64_t decode_tokens;              /* ... and the tokens after the first */
    struct job_choice *choices;         /* n_choices, filled as they finish: every pointer in
                                           them owned (copies of the engine's output) */
};

/* A compiled response_format, kept for the requests of a job that share it. */
struct batch_grammar {
    enum job_format format;      /* json_object or json_schema */
    char *schema;                /* the schema's JSON (owned), NULL for json_object */
    struct engine_grammar *g;    /* one reference */
    struct batch_grammar *next;  /* most recently used first */
};

/* Latencies kept for the run summary's percentiles: all of the first this many requests, then
 * a uniform sample of this size (16 MiB; before, 16 bytes per request for the whole run). */
#define BATCH_LATENCY_KEEP ((size_t)1 << 20)

struct batch_run {
    const struct batch_opts *o;      /* options (borrowed) */
    struct queue *q;                 /* queue connection */
    struct proc_identity self;       /* this process, recorded with the run */
    int64_t *job_ids;                /* the jobs chosen, in order (owned) */
    size_t n_jobs;                   /* count */
    struct queue_job job;            /* current job */
    char job_dir[4096];              /* OUT/<job name> */
    char model_name[256];            /* for records: model file name without .gguf */
    char *engine_json;               /* the run's engine (record_engine), or NULL before one */
    char fingerprint[IO_FINGERPRINT_LEN]; /* io_manifest_fingerprint(engine_json): the records'
                                             system_fingerprint ("" before one) */
    /* The model stays loaded from one job to the next that names the same file, unchanged
     * (model_loaded: its path; model_id: its identity when it was hashed, model_sha: the sha256
     * it had then, "" when not hashed): neither hashed nor loaded again (model_release frees it).
     */
    char *model_loaded;
    struct file_version model_id;
    char model_sha[SHA256_HEX_LEN];
    struct kern_group *group;        /* backends (one per tensor-parallel rank) */
    struct engine_model *m;          /* model */
    struct engine_model *draft;      /* draft model (--spec model) or NULL */
    struct engine_tok *tok;          /* tokenizer */
    struct batch_grammar *grammars;  /* compiled response formats of the job (at most
                                        BATCH_GRAMMARS; the engine holds its own references) */
    struct engine_chat *chat;        /* chat template (NULL if the model has none usable) */
    struct engine *e;                /* engine */
    struct job_defaults defaults;    /* job parameters */
    struct batch_out *out;           /* the current job's shard writer */
    struct batch_inflight *inflight; /* requests in the engine (their user data), owned: freed
                                        when they come out, or by the job's close when a stop
                                        leaves them behind */
    int64_t n_inflight;              /* of them */
    double t_mark;                   /* start_gate's last marks (0: none yet) */
    int mark_ahead;                  /* how many waiting requests it marks ahead */
    double t_stop;                   /* when stopping began (0 = not stopping) */
    int interruptible;               /* a stop signal ends waits for the queue (no leases
                                        held yet, no stop noticed: queue_set_interrupt) */
    int stop_recorded;               /* queue_run_stopping done */
    int unstarted_back;              /* the stop gave the unstarted requests back (tried once) */
    int stop_warned;                 /* ... and its failure logged */
    double t_flush, t_beat;          /* last flush, heartbeat */
    double t_lease_check;            /* last check for lost leases (0: check at the next turn) */
    struct batch_stats stats;        /* totals; stats.ttft_ms/tpot_ms owned */
    size_t cap_lat;                  /* capacity of stats.ttft_ms and tpot_ms */
    uint64_t n_lat_seen;             /* requests whose latencies note_latency was given */
    uint64_t lat_rng;                /* its sampling state once BATCH_LATENCY_KEEP are kept */
    int64_t done_base, failed_base;  /* items committed by the writers of earlier jobs */
    int64_t discarded_base;          /* records discarded by the writers of earlier jobs */
    int64_t n_out;                   /* requests the engine finished this run */
    /* live progress of the current job (batch/progress.c) */
    struct batch_rate gen_rate;    /* engine tokens generated, sampled */
    struct batch_rate prompt_rate; /* engine prompt tokens computed, sampled */
    double t_job;                  /* when the job's engine was ready */
    double t_draw, t_pub;          /* next show call; last queue_run_progress */
    double t_sample;               /* last queue_sample_add */
    struct queue_counts counts;    /* the job's counts when last read */
    double t_counts, counts_cost;  /* when they were read (0: read next time), and how long
                                    * that took */
    int64_t done_at_counts, failed_at_counts; /* stats.items_done, items_failed then */
    int64_t job_out0, job_tok0;               /* n_out and completion tokens when the job started */
    struct batch_loading *loading; /* a part's progress kept fresh while the job's model loads */
};

/* Monotonic seconds. */
double batch_now(void);
/* Wall-clock unix milliseconds. */
int64_t batch_unix_ms(void);
/* Stop signals received so far (batch_opts.signals). */
int batch_run_signals(const struct batch_run *r);

/* The job's progress: reset when its engine is ready, ticked after every step (publishes
 * about once a second, shows every show_period), and its last word when it ends. */
void batch_progress_start(struct batch_run *r);
void batch_progress_tick(struct batch_run *r);
void batch_progress_end(struct batch_run *r);
/* In a part, from before the job's model is hashed and loaded until its engine has warmed up
 * (no tick meanwhile): a thread replaces the part's progress file every second, so that
 * `quern cancel` and other runs see the part's run alive (runner_part_run_alive). Nothing
 * outside a part; a failure to start is logged, not an error. */
void batch_progress_loading_start(struct batch_run *r);
void batch_progress_loading_stop(struct batch_run *r);

#endif
