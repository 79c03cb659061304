/* `quern run`: drain a job's queued items through the engine into zstd JSONL shards with
 * the exactly-once protocol: records are appended to a shard buffer; a flush writes one zstd
 * frame and fsyncs it, then ONE SQLite transaction marks those items done/failed and stores
 * the shard's committed length. At start every open shard left by a dead run is truncated
 * to its committed length. So a record is in the output iff its item is done or failed.
 * Signals (TERM, INT, USR1) and --max-runtime stop admission, let in-flight requests finish
 * for --grace seconds, release the rest, flush, and exit 75 (rerun to resume). */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/sha256.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "io/manifest.h"
#include "io/shard.h"
#include "jobs/params.h"
#include "jobs/record.h"
#include "jobs/request.h"
#include "kernels/kernels.h"
#include "queue/queue.h"
#include "runner/output.h"
#include "runner/progress.h"
#include "runner/runner.h"
#include "runner/term.h"

#define RUN_EXIT_TEMPFAIL 75

static const char run_usage[] =
    "usage: quern run --db Q.db --out DIR [options]\n"
    "\n"
    "Process queued items (of --job, else of every job in turn) and write OpenAI Batch output\n"
    "lines to DIR/<job>/results-NNNNN.jsonl.zst and errors-NNNNN.jsonl.zst, plus\n"
    "DIR/<job>/manifest.json when the job is drained. Safe to kill at any moment: rerun to\n"
    "resume; every item ends up in the output exactly once.\n"
    "Exit codes: 0 every item of the selected jobs is finished; 75 work remains (stopped by a\n"
    "signal or --max-runtime, or --no-wait while other runs hold items; rerun to resume);\n"
    "1 error; 2 usage. With --lock, a second overlapping run exits 0 at once.\n"
    "Dead runs: a run on this host whose process is gone is taken over at once (its items\n"
    "and open shards); a run elsewhere is dead once its heartbeat is older than --lease.\n"
    "\n"
    "  --db PATH              queue database (must exist unless --create; checked with\n"
    "                         PRAGMA quick_check before any work)\n"
    "  --create               create an empty queue at --db if there is none\n"
    "  --out DIR              output root (default: the job's, from submit --out); a job's\n"
    "                         output never splits: DIR must be where its shards already are\n"
    "  --no-wait              exit 75 at once when only items leased by other live runs are\n"
    "                         left (default: wait for them, taking over any that die)\n"
    "  --job ID|NAME          only this job\n"
    "  --threads N            CPU threads (default: all online CPUs)\n"
    "  --isa NAME, --matmul exact|q16|bf16|q8   kernels (see quern generate --help)\n"
    "  --max-seqs S, --max-batch-tokens T, --kv-mem SIZE, --kv-block B, --no-prefix-cache\n"
    "                         engine settings (defaults 256, 512, 1G, 16)\n"
    "  --kv-dtype f16|q8      KV cache storage (default f16; q8: 8 bits per value with a\n"
    "                         scale per token and head, half the bytes, less accurate)\n"
    "  --max-runtime SECS     stop admitting after this long, then finish as on a signal\n"
    "  --grace SECS           how long in-flight requests may finish after a stop (default 30)\n"
    "  --lock FILE            exclusive flock; if another run holds it, exit 0 immediately\n"
    "  --lease SECS           item lease, renewed while running (default 300); also how long\n"
    "                         a run on another host may be silent before it counts as dead\n"
    "                         (on this host a run whose process is gone is taken over at once)\n"
    "  --claim N              items claimed per transaction (default 64)\n"
    "  --flush-secs S         commit finished records at least this often (default 5)\n"
    "  --flush-records N      ... or when this many are waiting (default 256)\n"
    "  --shard-records N      start a new shard after N records (default 100000)\n"
    "  --shard-bytes SIZE     ... or after SIZE compressed bytes (default 256M)\n"
    "  --progress SECS        progress log interval when stderr is not a terminal (default\n"
    "                         10): one \"quern info: progress: key=value ...\" line each time;\n"
    "                         on a terminal a live line redrawn about once a second (bar,\n"
    "                         finished/failed/total, generated and prompt tok/s counted as\n"
    "                         tokens are produced, running sequences, KV use, elapsed, ETA;\n"
    "                         NO_COLOR and TERM=dumb honoured), then one summary line per job.\n"
    "                         `quern status --watch` shows the same from another process.\n"
    "  --worker-id ID         name recorded for this run (default $SLURM_JOB_ID or pid)\n"
    "  -h, --help             this help\n"
    "Signals: TERM, INT, HUP, PIPE and USR1 stop admission; a second one skips the grace.\n";

struct run_opts {
    const char *db, *out, *job, *isa, *lock, *worker; /* flags */
    long threads, claim, flush_records, shard_records;
    int no_wait;           /* --no-wait */
    int create;            /* --create */
    float max_runtime, grace, lease, flush_secs, progress;
    size_t shard_bytes;
    int act; /* --matmul: enum kern_act */
    struct engine_params ep;
};

static volatile sig_atomic_t g_signals; /* stop signals received */

static void on_signal(int sig)
{
    (void)sig;
    g_signals++;
}

enum { R_DB = 256, R_OUT, R_JOB, R_THREADS, R_ISA, R_MATMUL, R_SEQS, R_BATCH, R_KVMEM, R_KVBLOCK,
       R_NOPREFIX, R_MAXRT, R_GRACE, R_LOCK, R_LEASE, R_CLAIM, R_FLUSHS, R_FLUSHR, R_SHARDR,
       R_SHARDB, R_PROGRESS, R_WORKER, R_KVDTYPE, R_NOWAIT, R_CREATE };

static int parse_run(int argc, char **argv, struct run_opts *o)
{
    static const struct option longopts[] = {
        {"db", required_argument, 0, R_DB}, {"out", required_argument, 0, R_OUT},
        {"job", required_argument, 0, R_JOB}, {"threads", required_argument, 0, R_THREADS},
        {"isa", required_argument, 0, R_ISA}, {"matmul", required_argument, 0, R_MATMUL},
        {"max-seqs", required_argument, 0, R_SEQS},
        {"max-batch-tokens", required_argument, 0, R_BATCH},
        {"kv-mem", required_argument, 0, R_KVMEM}, {"kv-block", required_argument, 0, R_KVBLOCK},
        {"no-prefix-cache", no_argument, 0, R_NOPREFIX},
        {"kv-dtype", required_argument, 0, R_KVDTYPE},
        {"max-runtime", required_argument, 0, R_MAXRT}, {"grace", required_argument, 0, R_GRACE},
        {"lock", required_argument, 0, R_LOCK}, {"lease", required_argument, 0, R_LEASE},
        {"claim", required_argument, 0, R_CLAIM}, {"flush-secs", required_argument, 0, R_FLUSHS},
        {"flush-records", required_argument, 0, R_FLUSHR},
        {"shard-records", required_argument, 0, R_SHARDR},
        {"shard-bytes", required_argument, 0, R_SHARDB},
        {"progress", required_argument, 0, R_PROGRESS},
        {"worker-id", required_argument, 0, R_WORKER}, {"no-wait", no_argument, 0, R_NOWAIT},
        {"create", no_argument, 0, R_CREATE},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    memset(o, 0, sizeof(*o));
    o->threads = runner_default_threads();
    o->claim = 64;
    o->flush_records = 256;
    o->shard_records = 100000;
    o->shard_bytes = (size_t)256 << 20;
    o->grace = 30;
    o->lease = 300;
    o->flush_secs = 5;
    o->progress = 10;
    engine_params_default(&o->ep);
    const char *cmd = "run";
    long l;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case R_DB: o->db = optarg; break;
        case R_OUT: o->out = optarg; break;
        case R_JOB: o->job = optarg; break;
        case R_ISA: o->isa = optarg; break;
        case R_LOCK: o->lock = optarg; break;
        case R_WORKER: o->worker = optarg; break;
        case R_NOPREFIX: o->ep.prefix_cache = 0; break;
        case R_NOWAIT: o->no_wait = 1; break;
        case R_CREATE: o->create = 1; break;
        case R_MATMUL:
            if (!runner_parse_matmul(cmd, optarg, &o->act))
                return 0;
            break;
        case R_THREADS:
            if (!runner_parse_long(cmd, "threads", optarg, 1, 256, &o->threads))
                return 0;
            break;
        case R_SEQS:
            if (!runner_parse_long(cmd, "max-seqs", optarg, 1, 1 << 16, &l))
                return 0;
            o->ep.max_seqs = (int)l;
            break;
        case R_BATCH:
            if (!runner_parse_long(cmd, "max-batch-tokens", optarg, 1, 1 << 20, &l))
                return 0;
            o->ep.max_batch_tokens = (int)l;
            break;
        case R_KVBLOCK:
            if (!runner_parse_long(cmd, "kv-block", optarg, 1, 4096, &l))
                return 0;
            o->ep.kv_block = (int)l;
            break;
        case R_KVMEM:
            if (!runner_parse_size(cmd, "kv-mem", optarg, &o->ep.kv_mem))
                return 0;
            break;
        case R_KVDTYPE:
            if (!runner_parse_kv_dtype(cmd, optarg, &o->ep.kv_dtype))
                return 0;
            break;
        case R_MAXRT:
            if (!runner_parse_float(cmd, "max-runtime", optarg, 0.001, 1e9, &o->max_runtime))
                return 0;
            break;
        case R_GRACE:
            if (!runner_parse_float(cmd, "grace", optarg, 0, 1e9, &o->grace))
                return 0;
            break;
        case R_LEASE:
            if (!runner_parse_float(cmd, "lease", optarg, 1, 1e7, &o->lease))
                return 0;
            break;
        case R_FLUSHS:
            if (!runner_parse_float(cmd, "flush-secs", optarg, 0, 1e6, &o->flush_secs))
                return 0;
            break;
        case R_PROGRESS:
            if (!runner_parse_float(cmd, "progress", optarg, 0.1, 1e6, &o->progress))
                return 0;
            break;
        case R_CLAIM:
            if (!runner_parse_long(cmd, "claim", optarg, 1, 100000, &o->claim))
                return 0;
            break;
        case R_FLUSHR:
            if (!runner_parse_long(cmd, "flush-records", optarg, 1, 1 << 24, &o->flush_records))
                return 0;
            break;
        case R_SHARDR:
            if (!runner_parse_long(cmd, "shard-records", optarg, 1, 1L << 40, &o->shard_records))
                return 0;
            break;
        case R_SHARDB:
            if (!runner_parse_size(cmd, "shard-bytes", optarg, &o->shard_bytes))
                return 0;
            break;
        case 'h': fputs(run_usage, stdout); exit(RUNNER_EXIT_OK);
        default: fputs(run_usage, stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern run: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (!o->db) {
        fprintf(stderr, "quern run: --db is required\n%s", run_usage);
        return 0;
    }
    return 1;
}

/* ---- output shards ---- */

struct pend {
    int64_t item_id;      /* queue item */
    char *line;           /* the record (owned) */
    char *err_code;       /* NULL for results; error code for errors (owned) */
    char *err_msg;        /* error message (owned) */
    int64_t ptok, ctok;   /* usage */
};

struct oshard {
    enum queue_shard_kind kind; /* results or errors */
    struct io_shard *sh;        /* open writer, or NULL until the first record */
    int64_t id;                 /* queue shard id */
    char path[4096];            /* file */
    struct pend *pend;          /* records appended since the last commit (owned) */
    size_t n_pend, cap;         /* count, capacity */
};

/* Per-request state travelling through the engine as its user pointer. */
struct inflight {
    int64_t item_id;     /* queue item */
    char *custom_id;     /* owned */
    enum job_kind kind;  /* chat or completion */
    char *model;         /* request's model field or NULL (owned) */
    struct inflight *prev, *next; /* in run.inflight, while the engine holds the request */
};

static void inflight_free(struct inflight *inf)
{
    free(inf->custom_id);
    free(inf->model);
    free(inf);
}

struct run {
    const struct run_opts *o;      /* options */
    struct queue *q;               /* queue connection */
    int64_t run_id;                /* runs.id */
    struct queue_job job;          /* current job */
    char job_dir[4096];            /* OUT/<job name> */
    char model_name[256];          /* for records: model file name without .gguf */
    struct kern_backend *be;       /* CPU backend */
    struct engine_model *m;        /* model */
    struct engine_tok *tok;        /* tokenizer */
    struct engine_chat *chat;      /* chat template (NULL if the model has none usable) */
    struct engine *e;              /* engine */
    struct job_defaults defaults;  /* job parameters */
    struct oshard res, errs;       /* output shards */
    int64_t *live;                 /* item ids claimed and not yet written (for release) */
    size_t n_live, cap_live;       /* count, capacity */
    double t_start, t_stop;        /* run start; when stopping began (0 = not stopping) */
    double t_flush, t_beat;        /* last flush, heartbeat */
    /* summary */
    int64_t n_done, n_failed;      /* items committed this run */
    int64_t tok_in, tok_out;       /* tokens of requests finished this run */
    int64_t n_out;                 /* requests the engine finished this run */
    double *ttft, *tpot;           /* per request (ms) */
    size_t n_lat, cap_lat;         /* count, capacity */
    /* live progress of the current job (progress()) */
    struct runner_term term;       /* stderr: a live line on a terminal, else log lines */
    struct runner_rate gen_rate;   /* engine tokens generated, sampled */
    struct runner_rate prompt_rate; /* engine prompt tokens computed, sampled */
    double t_job;                  /* when the job's engine was ready */
    double t_draw, t_pub;          /* next redraw or log line; last queue_run_progress */
    struct queue_counts counts;    /* the job's counts when last read */
    double t_counts, counts_cost;  /* when they were read (0: read next time), and how long
                                    * that took */
    int64_t done_at_counts, failed_at_counts; /* n_done, n_failed then */
    int64_t job_out0, job_tok0;    /* n_out and tok_out when the job started */
    struct proc_identity self;     /* this process, recorded with the run */
    struct inflight *inflight;     /* requests in the engine (their user data), owned: freed
                                      when they come out, or by job_close when a stop leaves
                                      them behind */
    double waited_s;               /* seconds spent waiting for items other runs held */
};

static void pend_free(struct pend *p)
{
    free(p->line);
    free(p->err_code);
    free(p->err_msg);
}

static void live_remove(struct run *r, int64_t id)
{
    for (size_t i = 0; i < r->n_live; i++)
        if (r->live[i] == id) {
            r->live[i] = r->live[--r->n_live];
            return;
        }
}

static enum status live_add(struct run *r, int64_t id)
{
    if (r->n_live == r->cap_live) {
        size_t cap = r->cap_live ? r->cap_live * 2 : 256;
        int64_t *n = realloc(r->live, sizeof(*n) * cap);
        if (!n)
            return ST_ERR_NOMEM;
        r->live = n;
        r->cap_live = cap;
    }
    r->live[r->n_live++] = id;
    return ST_OK;
}

static enum status shard_start(struct run *r, struct oshard *s, struct err_detail *err)
{
    int64_t seq;
    enum status st;
    if ((st = queue_tx_begin(r->q, err)))
        return st;
    if ((st = queue_shard_next_seq(r->q, r->job.id, s->kind, &seq, err)))
        goto fail;
    if ((size_t)snprintf(s->path, sizeof(s->path), "%s/%s-%05lld.jsonl.zst", r->job_dir,
                         s->kind == QUEUE_SHARD_RESULTS ? "results" : "errors",
                         (long long)seq) >= sizeof(s->path)) {
        st = err_set(err, ST_ERR_INVALID_ARG, "output path too long under %s", r->job_dir);
        goto fail;
    }
    if ((st = queue_shard_create(r->q, r->run_id, r->job.id, s->kind, seq, s->path, &s->id, err)) ||
        (st = queue_tx_commit(r->q, err)))
        goto fail;
    /* the row first, then the file, exclusively: a file already there is never overwritten;
     * the row is then closed empty at once, so an open row's file is always its run's own */
    if ((st = io_shard_create(&s->sh, s->path, 3, err)) == ST_ERR_EXISTS) {
        char sha[SHA256_HEX_LEN];
        struct err_detail e2 = {0};
        sha256_buf_hex("", 0, sha);
        if (queue_shard_close(r->q, r->run_id, s->id, sha, &e2))
            LOG_WARN("closing shard row %lld: %s", (long long)s->id, e2.msg);
    }
    return st;
fail:
    queue_tx_rollback(r->q);
    return st;
}

/* Mark a shard closed with the sha256 of its committed bytes. A shard that never committed
 * anything (its run died or stopped before the first flush) is closed empty and its file
 * removed, so the output directory holds only shards with records (an open row's file was
 * created by its run, see shard_start; anything but a regular file is left alone). */
static enum status shard_seal(struct run *r, int64_t id, const char *path, uint64_t bytes,
                              struct err_detail *err)
{
    char sha[SHA256_HEX_LEN];
    enum status st;
    if (bytes == 0) {
        struct stat sb;
        if (!lstat(path, &sb) && S_ISREG(sb.st_mode) && unlink(path) &&
            errno != ENOENT)
            return err_set(err, ST_ERR_IO, "cannot remove empty shard %s: %s", path,
                           strerror(errno));
        sha256_buf_hex("", 0, sha);
        st = ST_OK;
    } else {
        st = sha256_file(path, bytes, sha, err);
    }
    if (!st)
        st = queue_shard_close(r->q, r->run_id, id, sha, err);
    return st;
}

/* Close the shard: hash its committed bytes and mark it closed in the queue. */
static enum status shard_finish(struct run *r, struct oshard *s, struct err_detail *err)
{
    if (!s->sh)
        return ST_OK;
    uint64_t bytes = io_shard_committed_bytes(s->sh);
    io_shard_close(s->sh);
    s->sh = NULL;
    return shard_seal(r, s->id, s->path, bytes, err);
}

static enum status shard_append(struct run *r, struct oshard *s, int64_t item, char *line,
                                const char *code, const char *msg, int64_t ptok, int64_t ctok,
                                struct err_detail *err)
{
    enum status st;
    if (!line)
        return err_set(err, ST_ERR_NOMEM, "out of memory building a record");
    if (!s->sh && (st = shard_start(r, s, err))) {
        free(line);
        return st;
    }
    if (s->n_pend == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        struct pend *n = realloc(s->pend, sizeof(*n) * cap);
        if (!n) {
            free(line);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        s->pend = n;
        s->cap = cap;
    }
    if ((st = io_shard_append(s->sh, line, strlen(line), err))) {
        free(line);
        return st;
    }
    struct pend *p = &s->pend[s->n_pend++];
    p->item_id = item;
    p->line = line;
    p->err_code = code ? strdup(code) : NULL;
    p->err_msg = msg ? strdup(msg) : NULL;
    p->ptok = ptok;
    p->ctok = ctok;
    return ST_OK;
}

/* Flush + commit the shard's pending records. If the queue refuses some items (re-claimed
 * by another run after our lease expired, or cancelled), the file is cut back to its
 * committed length and only the others are written again. If the shard itself is no longer
 * ours (another run took this one for dead and adopted it), the shard ends here: its file is
 * cut back to what we committed, and the records go to a new shard. A commit that still
 * fails after that is an error: nothing is ever reported committed that is not. */
static enum status shard_commit(struct run *r, struct oshard *s, struct err_detail *err)
{
    enum status st = ST_OK;
    for (int attempt = 0; s->n_pend; attempt++) {
        if (attempt == 4)
            return err_set(err, ST_ERR_CONFLICT, "%s: could not commit %zu records (%s)",
                           s->path, s->n_pend, err->msg);
        uint64_t old = io_shard_committed_bytes(s->sh), bytes, records;
        struct queue_done *done = calloc(s->n_pend, sizeof(*done));
        bool *lost = calloc(s->n_pend, sizeof(*lost));
        if (!done || !lost) {
            free(done);
            free(lost);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        for (size_t i = 0; i < s->n_pend; i++) {
            done[i].item_id = s->pend[i].item_id;
            done[i].error_code = s->pend[i].err_code;
            done[i].error_msg = s->pend[i].err_msg;
            done[i].prompt_tokens = s->pend[i].ptok;
            done[i].completion_tokens = s->pend[i].ctok;
        }
        st = io_shard_flush(s->sh, &bytes, &records, err);
        if (!st)
            st = queue_commit_shard(r->q, r->run_id, s->id, bytes, records, done, s->n_pend, lost,
                                    err);
        free(done);
        if (st == ST_OK) {
            for (size_t i = 0; i < s->n_pend; i++) {
                live_remove(r, s->pend[i].item_id);
                if (s->kind == QUEUE_SHARD_RESULTS)
                    r->n_done++;
                else
                    r->n_failed++;
                pend_free(&s->pend[i]);
            }
            s->n_pend = 0;
            free(lost);
            break;
        }
        if (st != ST_ERR_CONFLICT) {
            free(lost);
            return st;
        }
        size_t n_lost = 0;
        for (size_t i = 0; i < s->n_pend; i++)
            n_lost += lost[i];
        struct err_detail e2 = {0};
        if (n_lost == 0) { /* the shard is not ours any more */
            LOG_WARN("%s: %s; ending this shard and writing its %zu pending records to a new one",
                     s->path, err->msg, s->n_pend);
            st = io_shard_abandon(s->sh, old, &e2);
            s->sh = NULL;
            if (st) {
                free(lost);
                return err_set(err, st, "%s", e2.msg);
            }
            if ((st = shard_start(r, s, err))) {
                free(lost);
                return st;
            }
        } else { /* drop the lost records: reopen at the committed length, rewrite the rest */
            LOG_WARN("%s: %zu items were taken over by another run or cancelled; rewriting",
                     s->path, n_lost);
            io_shard_close(s->sh);
            s->sh = NULL;
            if ((st = io_shard_open(&s->sh, s->path, old, 3, err))) {
                free(lost);
                return st;
            }
        }
        size_t k = 0;
        for (size_t i = 0; i < s->n_pend; i++) {
            if (lost[i]) {
                live_remove(r, s->pend[i].item_id);
                pend_free(&s->pend[i]);
                continue;
            }
            s->pend[k++] = s->pend[i];
        }
        s->n_pend = k;
        free(lost);
        for (size_t i = 0; i < s->n_pend && !st; i++)
            st = io_shard_append(s->sh, s->pend[i].line, strlen(s->pend[i].line), err);
        if (st)
            return st;
    }
    /* rotate */
    if (s->sh && (io_shard_committed_bytes(s->sh) >= r->o->shard_bytes ||
                  io_shard_records_total(s->sh) >= (uint64_t)r->o->shard_records))
        st = shard_finish(r, s, err);
    return st;
}

static enum status flush_all(struct run *r, struct err_detail *err)
{
    enum status st = shard_commit(r, &r->res, err);
    if (!st)
        st = shard_commit(r, &r->errs, err);
    r->t_flush = runner_now();
    return st;
}

/* Write an error record for an item that could not run. */
static enum status item_error(struct run *r, int64_t item, const char *custom_id, const char *code,
                              const char *msg, struct err_detail *err)
{
    char *line = job_record_invalid(r->job.id, custom_id, 400, code, msg, NULL);
    return shard_append(r, &r->errs, item, line, code, msg, 0, 0, err);
}

/* ---- admission ---- */

static enum status admit(struct run *r, const struct queue_claimed *c, struct err_detail *err)
{
    enum status st = live_add(r, c->id);
    if (st)
        return err_set(err, st, "out of memory");
    if (c->max_attempts > 0 && c->attempts > c->max_attempts) {
        char msg[128];
        snprintf(msg, sizeof(msg), "gave up after %d attempts", c->attempts - 1);
        return item_error(r, c->id, c->custom_id, "attempts_exhausted", msg, err);
    }
    if (!c->payload) { /* a line rejected at submit: its error record, as submit found it */
        const char *code = c->error_code ? c->error_code : "invalid_request";
        const char *msg = c->error_msg ? c->error_msg : "the line was rejected at submit";
        char *line = job_record_rejected(r->job.id, c->custom_id, c->source, c->line_no, code, msg);
        return shard_append(r, &r->errs, c->id, line, code, msg, 0, 0, err);
    }
    struct job_request *req = NULL;
    struct job_error je = {0};
    st = job_request_parse(c->payload, strlen(c->payload), &r->defaults, &req, &je);
    if (st == ST_ERR_NOMEM)
        return err_set(err, st, "out of memory");
    if (st)
        return item_error(r, c->id, c->custom_id, job_err_code_str(je.code), je.message, err);
    int32_t *ids = NULL;
    size_t n = 0;
    struct err_detail e2 = {0};
    if (req->kind == JOB_KIND_CHAT)
        st = r->chat ? engine_chat_tokenize(r->chat, r->tok, req->messages, req->n_messages, 1, 0,
                                            &ids, &n, &e2)
                     : err_set(&e2, ST_ERR_UNSUPPORTED, "the model has no usable chat template");
    else
        st = engine_tok_encode(r->tok, req->prompt, strlen(req->prompt), ENGINE_TOK_ADD_BOS, &ids,
                               &n, &e2);
    struct inflight *inf = NULL;
    if (!st) {
        inf = calloc(1, sizeof(*inf));
        if (!inf || !(inf->custom_id = strdup(req->custom_id))) {
            free(inf);
            free(ids);
            job_request_free(req);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        inf->item_id = c->id;
        inf->kind = req->kind;
        inf->model = req->model ? strdup(req->model) : NULL;
        struct engine_request er = {0};
        er.prompt = ids;
        er.n_prompt = n;
        er.sampling = req->sampling;
        er.max_tokens = req->max_tokens;
        er.stop = (const char *const *)req->stop;
        er.n_stop = req->n_stop;
        er.request_id = req->custom_id;
        er.user = inf;
        st = engine_add_request(r->e, &er, NULL, &e2);
    }
    free(ids);
    if (!st && inf) { /* the engine holds it now */
        inf->next = r->inflight;
        if (r->inflight)
            r->inflight->prev = inf;
        r->inflight = inf;
    }
    if (st) {
        if (inf)
            inflight_free(inf);
        const char *code = st == ST_ERR_RANGE ? "context_length_exceeded" : "invalid_request";
        st = item_error(r, c->id, req->custom_id, code, e2.msg, err);
    }
    job_request_free(req);
    return st;
}

/* Claim more items while the engine has room. Returns 1 when the job has nothing queued. */
static int fill(struct run *r, struct err_detail *err, enum status *st)
{
    size_t target = (size_t)r->o->ep.max_seqs * 2;
    while (engine_pending(r->e) < target) {
        struct queue_claimed *items = NULL;
        size_t n = 0;
        size_t want = target - engine_pending(r->e);
        if (want > (size_t)r->o->claim)
            want = (size_t)r->o->claim;
        *st = queue_claim(r->q, r->job.id, r->run_id, (int)want, (int64_t)(r->o->lease * 1000),
                          &items, &n, err);
        if (*st)
            return 0;
        for (size_t i = 0; i < n && !*st; i++)
            *st = admit(r, &items[i], err);
        queue_claimed_free(items, n);
        if (*st)
            return 0;
        if (n < want)
            return 1;
    }
    return 0;
}

static enum status take_outputs(struct run *r, struct err_detail *err)
{
    struct engine_output o[64];
    size_t k;
    enum status st = ST_OK;
    while (!st && (k = engine_poll(r->e, o, 64)) > 0)
        for (size_t i = 0; i < k; i++) {
            struct inflight *inf = o[i].user;
            struct job_result jr = {0};
            jr.custom_id = inf->custom_id;
            jr.kind = inf->kind;
            jr.model = inf->model ? inf->model : r->model_name;
            jr.text = o[i].text;
            jr.text_len = o[i].text_len;
            jr.finish_reason = o[i].finish == ENGINE_FINISH_LENGTH ? "length" : "stop";
            jr.prompt_tokens = (int32_t)o[i].n_prompt;
            jr.completion_tokens = (int32_t)o[i].n_tokens;
            jr.created = (int64_t)time(NULL);
            jr.job_id = r->job.id;
            if (!st)
                st = shard_append(r, &r->res, inf->item_id, job_record_success(&jr), NULL, NULL,
                                  (int64_t)o[i].n_prompt, (int64_t)o[i].n_tokens, err);
            r->tok_in += (int64_t)o[i].n_prompt;
            r->tok_out += (int64_t)o[i].n_tokens;
            r->n_out++;
            if (r->n_lat == r->cap_lat) {
                size_t cap = r->cap_lat ? r->cap_lat * 2 : 1024;
                double *a = realloc(r->ttft, sizeof(double) * cap);
                if (a)
                    r->ttft = a;
                double *b = realloc(r->tpot, sizeof(double) * cap);
                if (b)
                    r->tpot = b;
                if (a && b)
                    r->cap_lat = cap;
            }
            if (r->n_lat < r->cap_lat) {
                r->ttft[r->n_lat] = 1e3 * (o[i].t_first - o[i].t_arrival);
                r->tpot[r->n_lat] = o[i].n_tokens > 1 ? 1e3 * (o[i].t_finish - o[i].t_first) /
                                                            (double)(o[i].n_tokens - 1)
                                                      : 0;
                r->n_lat++;
            }
            if (inf->prev)
                inf->prev->next = inf->next;
            else
                r->inflight = inf->next;
            if (inf->next)
                inf->next->prev = inf->prev;
            inflight_free(inf);
        }
    return st;
}

/* ---- job lifecycle ---- */

static void job_close(struct run *r)
{
    engine_free(r->e);
    r->e = NULL;
    while (r->inflight) { /* requests a stop left in the engine */
        struct inflight *next = r->inflight->next;
        inflight_free(r->inflight);
        r->inflight = next;
    }
    engine_chat_free(r->chat);
    engine_tok_free(r->tok);
    engine_model_free(r->m);
    kern_backend_free(r->be);
    r->chat = NULL;
    r->tok = NULL;
    r->m = NULL;
    r->be = NULL;
    for (int k = 0; k < 2; k++) {
        struct oshard *s = k ? &r->errs : &r->res;
        io_shard_close(s->sh);
        s->sh = NULL;
        for (size_t i = 0; i < s->n_pend; i++)
            pend_free(&s->pend[i]);
        free(s->pend);
        s->pend = NULL;
        s->n_pend = s->cap = 0;
    }
    queue_job_free(&r->job);
    memset(&r->job, 0, sizeof(r->job));
}

/* Truncate and close the open shards of dead runs. A shard whose file is still locked has a
 * live writer (the lock dies with its process), whatever its heartbeat says: left alone. */
static enum status recover_shards(struct run *r, struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    enum status st = queue_shard_list(r->q, r->job.id, &sh, &n, err);
    for (size_t i = 0; !st && i < n; i++) {
        if (sh[i].state != QUEUE_SHARD_OPEN || sh[i].run_id == r->run_id)
            continue;
        char path[4096];
        if ((st = queue_resolve_path(r->q, sh[i].path, path, sizeof(path), err)))
            break;
        if (io_shard_locked(path) == 1) {
            LOG_INFO("%s: still written by run %lld (its file is locked); left open", path,
                     (long long)sh[i].run_id);
            continue;
        }
        struct err_detail e2 = {0};
        if (queue_shard_adopt(r->q, sh[i].id, r->run_id, (int64_t)(r->o->lease * 1000), &e2))
            continue; /* a live run still writes it */
        if (sh[i].committed_bytes) { /* cut the uncommitted tail */
            struct io_shard *w;
            if ((st = io_shard_open(&w, path, sh[i].committed_bytes, 3, err)))
                break;
            io_shard_close(w);
        }
        st = shard_seal(r, sh[i].id, path, sh[i].committed_bytes, err);
        LOG_INFO("recovered shard %s at %llu committed bytes", path,
                 (unsigned long long)sh[i].committed_bytes);
    }
    queue_shard_list_free(sh, n);
    return st;
}

/* Shards of job job_id still open (by other runs: ours are closed when this is asked). */
static enum status count_open_shards(struct queue *q, int64_t job_id, int64_t *open,
                                     struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    enum status st = queue_shard_list(q, job_id, &sh, &n, err);
    *open = 0;
    for (size_t i = 0; !st && i < n; i++)
        *open += sh[i].state == QUEUE_SHARD_OPEN;
    queue_shard_list_free(sh, n);
    return st;
}

/* The job's live numbers: its counts in the queue (read at most once a second, less often
 * when reading them is slow) plus what this run finished since, committed or not, and the
 * engine's token counts (unfinished requests included) and load. */
static void progress_snapshot(struct run *r, double now, struct runner_progress *p)
{
    if (!r->t_counts || now - r->t_counts >= fmax(1.0, 20 * r->counts_cost)) {
        struct queue_counts c;
        struct err_detail err = {0};
        if (!queue_job_counts(r->q, r->job.id, &c, &err)) {
            r->counts = c;
            r->done_at_counts = r->n_done;
            r->failed_at_counts = r->n_failed;
        }
        r->counts_cost = runner_now() - now;
        r->t_counts = now;
    }
    const struct queue_counts *c = &r->counts;
    memset(p, 0, sizeof(*p));
    p->job_id = r->job.id;
    snprintf(p->job, sizeof(p->job), "%s", r->job.name ? r->job.name : "");
    p->total = c->total;
    p->cancelled = c->items[QUEUE_ITEM_CANCELLED];
    p->done = c->items[QUEUE_ITEM_DONE] + (r->n_done - r->done_at_counts) + (int64_t)r->res.n_pend;
    p->failed = c->items[QUEUE_ITEM_FAILED] + (r->n_failed - r->failed_at_counts) +
                (int64_t)r->errs.n_pend;
    if (p->done + p->failed + p->cancelled > p->total) /* a commit by another run since */
        p->done = p->total - p->failed - p->cancelled;
    const struct engine_stats *es = engine_get_stats(r->e);
    struct engine_load ld;
    engine_get_load(r->e, &ld);
    p->gen_tokens = (int64_t)es->gen_tokens;
    p->prompt_tokens = (int64_t)es->prompt_tokens;
    runner_rate_add(&r->gen_rate, now, (double)es->gen_tokens);
    runner_rate_add(&r->prompt_rate, now, (double)es->prompt_tokens);
    p->gen_tok_s = runner_rate_get(&r->gen_rate);
    p->prompt_tok_s = runner_rate_get(&r->prompt_rate);
    p->running = ld.running;
    p->waiting = (int64_t)ld.waiting;
    p->kv_used = ld.kv_used;
    p->kv_total = ld.kv_total;
    p->runs = 1;
    int64_t outs = r->n_out - r->job_out0, toks = r->tok_out - r->job_tok0;
    if (outs > 0)
        p->mean_out = (double)toks / (double)outs;
    else if (c->items[QUEUE_ITEM_DONE] > 0) /* finished by earlier runs */
        p->mean_out = (double)c->completion_tokens / (double)c->items[QUEUE_ITEM_DONE];
    p->inflight_tokens = fmax(0, (double)(p->gen_tokens - toks));
    p->elapsed_s = now - r->t_job;
    runner_progress_eta(p);
}

/* Store the numbers in the queue for `quern status` (a heartbeat too). */
static void progress_publish(struct run *r, const struct runner_progress *p, double now)
{
    char *js = runner_progress_to_json(p);
    struct err_detail err = {0};
    if (js && queue_run_progress(r->q, r->run_id, js, &err))
        LOG_DEBUG("publishing progress: %s", err.msg);
    free(js);
    r->t_pub = now;
}

/* Start the job's progress display once its engine is ready. */
static void progress_start(struct run *r)
{
    r->t_job = runner_now();
    runner_rate_reset(&r->gen_rate);
    runner_rate_reset(&r->prompt_rate);
    runner_rate_add(&r->gen_rate, r->t_job, 0);
    runner_rate_add(&r->prompt_rate, r->t_job, 0);
    r->t_draw = r->t_job; /* at once */
    r->t_pub = 0;
    r->t_counts = 0;
    r->job_out0 = r->n_out;
    r->job_tok0 = r->tok_out;
}

/* Called after every step: publishes about once a second, redraws the live line about once a
 * second on a terminal, else logs a line every --progress seconds (on a fixed cadence). */
static void progress(struct run *r)
{
    double now = runner_now();
    int draw = now >= r->t_draw, publish = now - r->t_pub >= RUNNER_PROGRESS_PUBLISH_S;
    if (!draw && !publish)
        return;
    struct runner_progress p;
    progress_snapshot(r, now, &p);
    if (publish)
        progress_publish(r, &p, now);
    if (!draw)
        return;
    double period = r->term.tty ? RUNNER_PROGRESS_TTY_S : r->o->progress;
    r->t_draw += period;
    if (r->t_draw <= now)
        r->t_draw = now + period;
    char line[1024];
    if (r->term.tty) {
        runner_progress_line(&p, runner_term_width(&r->term), r->term.color, line, sizeof(line));
        runner_term_redraw(&r->term, line);
    } else {
        runner_progress_log(&p, line, sizeof(line));
        LOG_INFO("%s", line);
    }
}

/* The job's last word: the final numbers published, and one summary line (on a terminal it
 * replaces the live line). */
static void progress_end(struct run *r)
{
    double now = runner_now();
    struct runner_progress p;
    r->t_counts = 0; /* exact counts */
    progress_snapshot(r, now, &p);
    progress_publish(r, &p, now);
    char line[1024];
    runner_progress_summary(&p, line, sizeof(line));
    if (r->term.tty) {
        char full[1100];
        snprintf(full, sizeof(full), "quern run: %s", line);
        runner_term_finish(&r->term, full);
    } else {
        LOG_INFO("%s", line);
    }
}

static int stop_requested(struct run *r)
{
    if (g_signals || (r->o->max_runtime > 0 && runner_now() - r->t_start >= r->o->max_runtime)) {
        if (!r->t_stop) {
            r->t_stop = runner_now();
            LOG_INFO("stopping: %s; in-flight requests get %.0f s to finish",
                     g_signals ? "signal received" : "--max-runtime reached", (double)r->o->grace);
        }
        return 1;
    }
    return 0;
}

/* Renew our leases and heartbeat when a third of the lease has passed (before any claim, so a
 * run that stalled is seen alive again before it takes more work). */
static enum status beat(struct run *r, int force, struct err_detail *err)
{
    double now = runner_now();
    if (!force && now - r->t_beat < r->o->lease / 3)
        return ST_OK;
    int64_t held = 0;
    enum status st = queue_lease_extend(r->q, r->run_id, (int64_t)(r->o->lease * 1000), &held, err);
    if (!st && (size_t)held < r->n_live)
        LOG_WARN("run %lld holds %lld leases, %zu expected: some were taken over (this run was "
                 "silent past its --lease) or cancelled; their records will not be committed",
                 (long long)r->run_id, (long long)held, r->n_live);
    r->t_beat = now;
    return st;
}

/* Sleep up to secs, waking early on a stop signal. */
static void nap(double secs)
{
    double until = runner_now() + secs;
    while (!g_signals && runner_now() < until) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* A job whose items are all finished but whose output is not sealed: close the shards dead runs
 * left open and write the manifest, complete when nothing is open any more (a shard of a run
 * that still looks alive keeps it incomplete until a later run closes it). */
static int close_done_job(struct run *r, struct err_detail *err)
{
    int64_t open = 0;
    if (runner_job_dir(r->q, &r->job, r->o->out, 1, r->job_dir, sizeof(r->job_dir), err) ||
        recover_shards(r, err) || count_open_shards(r->q, r->job.id, &open, err) ||
        runner_manifest_write(r->q, &r->job, r->job_dir, open == 0, err))
        return -1;
    LOG_INFO("job %s: done earlier; manifest %s", r->job.name,
             open ? "still incomplete (a run that looks alive holds a shard open)"
                  : "written, complete");
    return 1;
}

/* Process one job: 1 every item finished, 0 stopped (signal, --max-runtime), 2 items are
 * still leased by other live runs and --no-wait was given, -1 failed. */
static int run_job(struct run *r, struct err_detail *err)
{
    enum status st;
    if ((st = runner_job_dir(r->q, &r->job, r->o->out, 1, r->job_dir, sizeof(r->job_dir), err)))
        return -1;
    const char *base = strrchr(r->job.model_path, '/');
    snprintf(r->model_name, sizeof(r->model_name), "%s", base ? base + 1 : r->job.model_path);
    char *dot = strstr(r->model_name, ".gguf");
    if (dot)
        *dot = 0;
    engine_sampling_default(&r->defaults.sampling);
    r->defaults.max_tokens = 256;
    r->defaults.default_id = NULL;
    if ((st = job_params_from_json(r->job.params_json, &r->defaults, err)))
        return -1;
    if (r->job.model_sha256 && *r->job.model_sha256) {
        char sha[SHA256_HEX_LEN];
        if ((st = sha256_file(r->job.model_path, SHA256_WHOLE_FILE, sha, err)))
            return -1;
        if (strcmp(sha, r->job.model_sha256)) {
            err_set(err, ST_ERR_INVALID_ARG,
                    "model %s changed since the job was submitted (sha256 %s, job has %s)",
                    r->job.model_path, sha, r->job.model_sha256);
            return -1;
        }
    }
    struct kern_backend_opts ko = {NULL, (int)r->o->threads, r->o->isa,
                                   (enum kern_act)r->o->act, 0};
    if ((st = kern_backend_open(&r->be, &ko, err)) ||
        (st = engine_model_load(&r->m, r->job.model_path, r->be, err)) ||
        (st = engine_tok_load(&r->tok, r->m->gguf, err)) ||
        (st = engine_init(&r->e, r->m, r->tok, &r->o->ep, err)))
        return -1;
    struct err_detail e2 = {0};
    if (engine_chat_init(&r->chat, r->m->gguf, &e2))
        LOG_WARN("%s: %s; chat requests will fail", r->job.model_path, e2.msg);
    if ((st = recover_shards(r, err)) || (st = engine_warmup(r->e, err)))
        return -1;
    r->res.kind = QUEUE_SHARD_RESULTS;
    r->errs.kind = QUEUE_SHARD_ERRORS;
    int drained = 0, remains = 0, waiting = 0;
    r->t_flush = r->t_beat = runner_now();
    progress_start(r);
    for (;;) {
        int stopping = stop_requested(r);
        if (stopping && (g_signals > 1 || runner_now() - r->t_stop >= r->o->grace))
            break;
        if ((st = beat(r, 0, err)))
            return -1;
        if (!stopping && !drained) {
            drained = fill(r, err, &st);
            if (st)
                return -1;
        }
        if (!engine_pending(r->e) && stopping)
            break;
        if (!engine_pending(r->e) && drained) {
            /* nothing queued for us: finished, or other runs hold the rest */
            if ((st = take_outputs(r, err)) || (st = flush_all(r, err)))
                return -1;
            struct queue_counts c;
            if ((st = queue_job_counts(r->q, r->job.id, &c, err)))
                return -1;
            if (c.items[QUEUE_ITEM_QUEUED] + c.items[QUEUE_ITEM_LEASED] == 0)
                break;
            if (r->o->no_wait) {
                LOG_INFO("job %s: %lld items are leased by other runs; --no-wait: leaving them",
                         r->job.name, (long long)c.items[QUEUE_ITEM_LEASED]);
                remains = 1;
                break;
            }
            if (!waiting++)
                LOG_INFO("job %s: waiting for %lld items leased by other runs (taken over if "
                         "their run dies; --no-wait exits 75 instead)",
                         r->job.name, (long long)c.items[QUEUE_ITEM_LEASED]);
            double t_nap = runner_now();
            nap(1.0);
            r->waited_s += runner_now() - t_nap;
            int64_t reaped = 0;
            if ((st = queue_reap_dead(r->q, &r->self, &reaped, err)) || (st = beat(r, 1, err)))
                return -1;
            if (reaped)
                LOG_INFO("%lld dead run(s) on this host: their items are queued again",
                         (long long)reaped);
            drained = 0;
            progress(r);
            continue;
        }
        if ((st = engine_step(r->e, err)) || (st = take_outputs(r, err)))
            return -1;
        double now = runner_now();
        size_t pending = r->res.n_pend + r->errs.n_pend;
        if (pending >= (size_t)r->o->flush_records ||
            (pending && now - r->t_flush >= r->o->flush_secs))
            if ((st = flush_all(r, err)))
                return -1;
        progress(r);
    }
    if ((st = take_outputs(r, err)) || (st = flush_all(r, err)))
        return -1;
    if (r->n_live) { /* stopped: give back what did not finish */
        int64_t released = 0;
        if ((st = queue_release(r->q, r->run_id, r->live, r->n_live, &released, err)))
            return -1;
        LOG_INFO("released %lld unfinished items back to the queue", (long long)released);
        r->n_live = 0;
    }
    if ((st = shard_finish(r, &r->res, err)) || (st = shard_finish(r, &r->errs, err)))
        return -1;
    /* shards of runs that died while we ran are closed now; one whose run still looks alive
     * may hold records, so the manifest is not complete until a later run has closed it */
    struct queue_counts c;
    int64_t open = 0;
    if ((st = recover_shards(r, err)) || (st = count_open_shards(r->q, r->job.id, &open, err)) ||
        (st = queue_job_counts(r->q, r->job.id, &c, err)))
        return -1;
    int complete = c.items[QUEUE_ITEM_QUEUED] == 0 && c.items[QUEUE_ITEM_LEASED] == 0;
    if (complete && open) {
        LOG_WARN("job %s: %lld shard(s) still open by a run that looks alive (its heartbeat is "
                 "within --lease %g s); the manifest says complete once a later run has closed "
                 "them",
                 r->job.name, (long long)open, (double)r->o->lease);
        complete = 0;
    }
    if ((st = runner_manifest_write(r->q, &r->job, r->job_dir, complete, err)))
        return -1;
    LOG_INFO("job %s: shards and manifest.json in %s/", r->job.name, r->job_dir);
    progress_end(r);
    if (complete)
        return 1;
    return r->t_stop ? 0 : remains ? 2 : 1;
}

/* The run's JSON summary (caller frees). */
static char *summary_json(struct run *r, const char *reason)
{
    double el = runner_now() - r->t_start;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "run_id", (double)r->run_id);
    cJSON_AddStringToObject(o, "exit_reason", reason);
    cJSON_AddNumberToObject(o, "elapsed_s", el);
    /* > 0: the run waited for items leased by other live runs before it could finish */
    cJSON_AddNumberToObject(o, "waited_for_other_runs_s", r->waited_s);
    cJSON_AddNumberToObject(o, "items_done", (double)r->n_done);
    cJSON_AddNumberToObject(o, "items_failed", (double)r->n_failed);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)r->tok_in);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)r->tok_out);
    cJSON_AddNumberToObject(o, "output_tok_s", el > 0 ? (double)r->tok_out / el : 0);
    runner_add_percentiles(o, "ttft_ms", r->ttft, r->n_lat);
    runner_add_percentiles(o, "tpot_ms", r->tpot, r->n_lat);
    cJSON_AddNumberToObject(o, "peak_rss_mb", (double)ru.ru_maxrss / 1024.0);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

int runner_cmd_run(int argc, char **argv)
{
    struct run_opts o;
    if (!parse_run(argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    int lock_fd = -1;
    if (o.lock) {
        lock_fd = open(o.lock, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (lock_fd < 0) {
            LOG_ERROR("cannot open lock file %s: %s", o.lock, strerror(errno));
            return RUNNER_EXIT_ERROR;
        }
        if (flock(lock_fd, LOCK_EX | LOCK_NB)) {
            LOG_INFO("another quern run holds %s; exiting", o.lock);
            close(lock_fd);
            return RUNNER_EXIT_OK;
        }
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    /* HUP (terminal closed) and PIPE (stdout/stderr reader gone) stop like TERM: the leases go
     * back and the work done so far is committed, instead of dying mid-run */
    static const int stop_sigs[] = {SIGTERM, SIGINT, SIGUSR1, SIGHUP, SIGPIPE};
    for (size_t i = 0; i < sizeof(stop_sigs) / sizeof(stop_sigs[0]); i++)
        sigaction(stop_sigs[i], &sa, NULL);

    struct run r;
    memset(&r, 0, sizeof(r));
    r.o = &o;
    r.t_start = runner_now();
    runner_term_init(&r.term, stderr);
    struct err_detail err = {0};
    int rc = RUNNER_EXIT_ERROR;
    const char *reason = "error";
    char worker[64];
    proc_identity_self(&r.self);
    const char *slurm = getenv("SLURM_JOB_ID");
    snprintf(worker, sizeof(worker), "%s", o.worker ? o.worker : slurm ? slurm : "");
    int64_t *job_ids = NULL;
    size_t n_jobs = 0;
    /* the whole file is checked once (a corrupt queue is an error before any work), and a
     * missing one is an error unless --create: a mistyped --db must not look like "drained" */
    struct queue_options qo = {.must_exist = !o.create, .check_integrity = true};
    if (queue_open_opts(&r.q, o.db, &qo, &err)) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    /* runs and submits on this host whose process is gone: items back, half-submitted jobs
     * deleted, before anything is chosen */
    int64_t reaped = 0;
    if (queue_reap_dead(r.q, &r.self, &reaped, &err) ||
        queue_jobs_gc(r.q, &r.self, QUEUE_DEFAULT_SUBMIT_STALE_MS, NULL, &err)) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    if (o.job) {
        struct queue_job j;
        if (queue_job_find(r.q, o.job, &j, &err)) {
            LOG_ERROR("%s", err.msg);
            goto out;
        }
        if (!j.ready) {
            LOG_ERROR("job '%s' is still being submitted; run it once its submit has finished",
                      j.name);
            queue_job_free(&j);
            goto out;
        }
        job_ids = malloc(sizeof(int64_t));
        if (job_ids)
            job_ids[n_jobs++] = j.id;
        queue_job_free(&j);
    } else {
        struct queue_job *jobs;
        size_t n;
        if (queue_job_list(r.q, &jobs, &n, &err)) {
            LOG_ERROR("%s", err.msg);
            goto out;
        }
        job_ids = malloc(sizeof(int64_t) * (n + 1));
        for (size_t i = 0; job_ids && i < n; i++) /* done jobs: the loop below checks shards */
            if (jobs[i].state != QUEUE_JOB_CANCELLED && jobs[i].ready)
                job_ids[n_jobs++] = jobs[i].id;
        queue_job_list_free(jobs, n);
    }
    if (!job_ids) {
        LOG_ERROR("out of memory");
        goto out;
    }
    struct queue_run_spec rs = {0};
    rs.job_id = o.job ? job_ids[0] : 0;
    rs.worker_id = worker[0] ? worker : NULL;
    rs.host = r.self.host;
    rs.pid = r.self.pid;
    rs.boot_id = r.self.boot_id;
    rs.pid_ns = r.self.pid_ns;
    rs.pstart = r.self.start_ticks;
    if (queue_run_start(r.q, &rs, &r.run_id, &err)) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    if (reaped)
        LOG_INFO("%lld dead run(s) on this host: their items and open shards are taken over",
                 (long long)reaped);
    int result = 1, remains = 0;
    for (size_t i = 0; i < n_jobs && (result == 1 || result == 2); i++) {
        if (queue_job_get(r.q, job_ids[i], &r.job, &err)) {
            result = -1;
            break;
        }
        if (r.job.state == QUEUE_JOB_CANCELLED) {
            queue_job_free(&r.job);
            memset(&r.job, 0, sizeof(r.job));
            continue;
        }
        if (r.job.state == QUEUE_JOB_DONE) {
            /* finished earlier: make sure its output is sealed and its manifest current */
            int64_t open = 0;
            result = 1;
            if (count_open_shards(r.q, r.job.id, &open, &err) ||
                runner_job_dir(r.q, &r.job, o.out, 0, r.job_dir, sizeof(r.job_dir), &err))
                result = -1;
            else if (open || !runner_manifest_current(r.q, &r.job, r.job_dir))
                result = close_done_job(&r, &err);
            job_close(&r);
            continue;
        }
        LOG_INFO("run %lld: job %lld '%s' (%s)", (long long)r.run_id, (long long)r.job.id,
                 r.job.name, r.job.model_path);
        result = run_job(&r, &err);
        remains |= result == 2;
        job_close(&r);
    }
    if (result < 0) {
        LOG_ERROR("%s", err.msg);
        reason = "error";
    } else if (result == 0) {
        reason = g_signals ? "signal" : "max_runtime";
        rc = RUN_EXIT_TEMPFAIL;
    } else if (remains) {
        reason = "work_remains";
        rc = RUN_EXIT_TEMPFAIL;
    } else {
        reason = "drained";
        rc = RUNNER_EXIT_OK;
    }
    char *sum = summary_json(&r, reason);
    if (sum)
        puts(sum);
    int64_t requeued = 0;
    if (queue_run_end(r.q, r.run_id, reason, sum, &requeued, &err)) {
        /* the work is committed, but the queue could not be written: say so (the run row is
         * ended by the next run on this host, or when its heartbeat is older than a lease) */
        LOG_ERROR("recording the end of the run: %s", err.msg);
        rc = RUNNER_EXIT_ERROR;
    }
    free(sum);
out:
    runner_term_close(&r.term);
    job_close(&r);
    free(job_ids);
    free(r.live);
    free(r.ttft);
    free(r.tpot);
    queue_close(r.q);
    if (lock_fd >= 0)
        close(lock_fd);
    return rc;
}
