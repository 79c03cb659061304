/* `quern run`: the command line of the job runner core (batch/batch.h), which drains queued
 * items through the engine into zstd JSONL shards, exactly once. This file parses the options,
 * takes --lock, turns stop signals (TERM, INT, HUP, PIPE, USR1, XCPU) into a count the core
 * watches, shows progress (a live line on a terminal, else log lines), prints the run's JSON
 * summary and maps how the run ended to the exit code (0 drained, 75 rerun to resume, 1 error). */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "batch/batch.h"
#include "common/log.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "jobs/json.h"
#include "kernels/kernels.h"
#include "runner/engine_opts.h"
#include "runner/progress.h"
#include "runner/runner.h"
#include "runner/term.h"

#define RUN_EXIT_TEMPFAIL 75

static const char run_usage[] =
    "usage: quern run --db Q.db [--out DIR] [options]\n"
    "       quern run --db PARTS_DIR [--part K] [options]\n"
    "\n"
    "Process queued items (of --job, else of every job in turn, including jobs submitted\n"
    "while it works) and write OpenAI Batch output\n"
    "lines to DIR/<job>/results-NNNNN.jsonl.zst and errors-NNNNN.jsonl.zst, plus\n"
    "DIR/<job>/manifest.json (written at each stop, \"complete\" once the job is drained).\n"
    "Safe to kill at any moment: rerun to\n"
    "resume; every item ends up in the output exactly once.\n"
    "Exit codes: 0 every item of the selected jobs is finished; 75 work remains (stopped by a\n"
    "signal or --max-runtime, or --no-wait while other runs hold items; rerun to resume);\n"
    "1 error; 2 usage. With --lock, a second overlapping run exits 0 at once.\n"
    "Dead runs: a run on this host whose process is gone is taken over at once (its items\n"
    "and open shards); a run elsewhere is dead once its heartbeat is older than --lease.\n"
    "\n"
    "  --db PATH              queue database (must exist unless --create; checked with\n"
    "                         PRAGMA quick_check before any work), or the directory of a\n"
    "                         partitioned queue (`quern submit --partitions`)\n"
    "  --part K               with a partitioned queue: work on part K (default\n"
    "                         $SLURM_ARRAY_TASK_ID; without either, every part not in use\n"
    "                         that has work, in turn). Output goes to OUT/<job>/part-NNNN/,\n"
    "                         and OUT/<job>/manifest.json combines the parts. A part that a\n"
    "                         run holds (its progress file changing) is left to it (exit 0);\n"
    "                         one locked with no run reporting gives exit 75. After its part\n"
    "                         the run takes over parts whose run died (or stopped) with work\n"
    "                         left, one at a time; never a part in use\n"
    "  --no-take-over         with --part: only that part\n"
    "  --create               create an empty queue at --db if there is none\n"
    "  --out DIR              output root (default: the job's, from submit --out); a job's\n"
    "                         output never splits: DIR must be where its shards already are\n"
    "  --no-wait              exit 75 at once when only items leased by other live runs are\n"
    "                         left (default: wait for them, taking over any that die)\n"
    "  --job ID|NAME          only this job\n"
    "  --max-runtime SECS     stop admitting after this long, then finish as on a signal\n"
    "                         (default under Slurm: until $SLURM_JOB_END_TIME less --grace\n"
    "                         and 60 s)\n"
    "  --grace SECS           how long running requests may finish after a stop (default 30;\n"
    "                         those not started yet go back to the queue at once)\n"
    "  --lock FILE            exclusive flock; if another run holds it, exit 0 immediately\n"
    "  --lease SECS           item lease, renewed while running (default 300); also how long\n"
    "                         a run on another host may be silent before it counts as dead\n"
    "                         (on this host a run whose process is gone is taken over at once)\n"
    "  --claim N              items claimed per transaction (default 64)\n"
    "  --flush-secs S         commit finished records at least this often (default 5)\n"
    "  --flush-records N      ... or when this many are waiting (default 256)\n"
    "  --shard-records N      start a new shard after N records (default 100000), checked\n"
    "                         at each commit: a commit's records stay in one shard\n"
    "  --shard-bytes SIZE     ... or after SIZE compressed bytes (default 256M; a plain\n"
    "                         number is bytes)\n"
    "  --progress SECS        progress log interval when stderr is not a terminal (default\n"
    "                         10): one \"quern info: progress: key=value ...\" line each time;\n"
    "                         on a terminal a live line redrawn about once a second (bar,\n"
    "                         finished/failed/total, generated and prompt tok/s counted as\n"
    "                         tokens are produced, running sequences, KV use, elapsed, ETA;\n"
    "                         NO_COLOR and TERM=dumb honoured), then one summary line per job.\n"
    "                         `quern status --watch` shows the same from another process.\n"
    "  --worker-id ID         name recorded for this run (default $SLURM_JOB_ID, else none)\n"
    "  --metrics-file PATH    write Prometheus text-format metrics to PATH every 5 s,\n"
    "                         replaced atomically (for node_exporter's textfile collector:\n"
    "                         PATH ending in .prom in its directory): the job's items by\n"
    "                         state, this run's token/step/draft counters, tok/s, sequences,\n"
    "                         KV blocks, ETA; labels job, part, run, host\n"
    "  --chat-template NAME   render chat requests in this format (" ENGINE_CHAT_NAMES ")\n"
    "                         instead of each model's recognised template: for a model whose\n"
    "                         template is refused; recorded in the run's engine (provenance)\n";
static const char run_usage_tail[] =
    "  -h, --help             this help\n"
    "Signals: TERM, INT, HUP, PIPE, USR1 and XCPU (a soft CPU-time limit below the hard one)\n"
    "stop admission; a second one skips the grace (XCPU, repeated each CPU-second, counts once).\n";

static void usage(FILE *f)
{
    fputs(run_usage, f);
    runner_engine_help(f, RUNNER_EO_ALL | RUNNER_EO_SPEC);
    fputs(run_usage_tail, f);
}

struct run_opts {
    struct batch_opts b;          /* the run itself */
    struct runner_engine_opts eo; /* engine and backend flags */
    const char *lock;             /* --lock */
    float progress;               /* --progress */
    long part;                    /* --part, -1 when not given */
    int no_take_over;             /* --no-take-over */
};

static volatile sig_atomic_t g_signals; /* stop signals received */

static void on_signal(int sig)
{
    /* SIGXCPU comes again each CPU-second past the soft limit: only its first counts, so that
     * it is not a "second signal" that skips the grace */
    static volatile sig_atomic_t xcpu_seen;
    if (sig == SIGXCPU && xcpu_seen)
        return;
    if (sig == SIGXCPU)
        xcpu_seen = 1;
    g_signals++;
}

enum {
    R_DB = 256,
    R_OUT,
    R_JOB,
    R_MAXRT,
    R_GRACE,
    R_LOCK,
    R_LEASE,
    R_CLAIM,
    R_FLUSHS,
    R_FLUSHR,
    R_SHARDR,
    R_SHARDB,
    R_PROGRESS,
    R_WORKER,
    R_NOWAIT,
    R_CREATE,
    R_PART,
    R_NOTAKE,
    R_METRICS,
    R_CHAT_TEMPLATE
};

static int parse_run(int argc, char **argv, struct run_opts *o)
{
    static const struct option own[] = {
        {"db", required_argument, 0, R_DB},
        {"out", required_argument, 0, R_OUT},
        {"job", required_argument, 0, R_JOB},
        {"max-runtime", required_argument, 0, R_MAXRT},
        {"grace", required_argument, 0, R_GRACE},
        {"lock", required_argument, 0, R_LOCK},
        {"lease", required_argument, 0, R_LEASE},
        {"claim", required_argument, 0, R_CLAIM},
        {"flush-secs", required_argument, 0, R_FLUSHS},
        {"flush-records", required_argument, 0, R_FLUSHR},
        {"shard-records", required_argument, 0, R_SHARDR},
        {"shard-bytes", required_argument, 0, R_SHARDB},
        {"progress", required_argument, 0, R_PROGRESS},
        {"worker-id", required_argument, 0, R_WORKER},
        {"no-wait", no_argument, 0, R_NOWAIT},
        {"create", no_argument, 0, R_CREATE},
        {"part", required_argument, 0, R_PART},
        {"no-take-over", no_argument, 0, R_NOTAKE},
        {"metrics-file", required_argument, 0, R_METRICS},
        {"chat-template", required_argument, 0, R_CHAT_TEMPLATE},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    struct option longopts[sizeof(own) / sizeof(own[0]) + RUNNER_EO_MAX_LONGOPTS];
    runner_engine_longopts(longopts, sizeof(longopts) / sizeof(longopts[0]), own, RUNNER_EO_ALL | RUNNER_EO_SPEC);
    memset(o, 0, sizeof(*o));
    runner_engine_opts_default(&o->eo);
    o->b.claim = 64;
    o->b.flush_records = 256;
    o->b.shard_records = 100000;
    o->b.shard_bytes = (size_t)256 << 20;
    o->b.grace = 30;
    o->b.lease = 300;
    o->b.flush_secs = 5;
    o->progress = 10;
    o->part = -1;
    const char *cmd = "run";
    int c, e;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if ((e = runner_engine_opt(cmd, c, optarg, &o->eo)) != 0) {
            if (e < 0)
                return 0;
            continue;
        }
        switch (c) {
        case R_DB: o->b.db = optarg; break;
        case R_OUT:
            if (!*optarg) { /* (it meant the working directory) */
                fprintf(stderr, "quern run: --out is empty\n");
                return 0;
            }
            o->b.out = optarg;
            break;
        case R_JOB: o->b.job = optarg; break;
        case R_LOCK: o->lock = optarg; break;
        case R_WORKER:
            if (!*optarg || strlen(optarg) > 63) {
                fprintf(stderr, "quern run: --worker-id: 1 to 63 bytes\n");
                return 0;
            }
            o->b.worker = optarg;
            break;
        case R_NOWAIT: o->b.no_wait = 1; break;
        case R_CREATE: o->b.create = 1; break;
        case R_NOTAKE: o->no_take_over = 1; break;
        case R_METRICS: o->b.metrics_file = optarg; break;
        case R_CHAT_TEMPLATE:
            if (!runner_chat_template_ok("run", optarg))
                return 0;
            o->b.chat_template = optarg;
            break;
        case R_PART:
            if (!runner_parse_long(cmd, "part", optarg, 0, BATCH_PARTS_MAX - 1, &o->part))
                return 0;
            break;
        case R_MAXRT:
            if (!runner_parse_float(cmd, "max-runtime", optarg, 0.001, 1e9, &o->b.max_runtime))
                return 0;
            break;
        case R_GRACE:
            if (!runner_parse_float(cmd, "grace", optarg, 0, 1e9, &o->b.grace))
                return 0;
            break;
        case R_LEASE:
            if (!runner_parse_float(cmd, "lease", optarg, 1, 1e7, &o->b.lease))
                return 0;
            break;
        case R_FLUSHS:
            if (!runner_parse_float(cmd, "flush-secs", optarg, 0, 1e6, &o->b.flush_secs))
                return 0;
            break;
        case R_PROGRESS:
            if (!runner_parse_float(cmd, "progress", optarg, 0.1, 1e6, &o->progress))
                return 0;
            break;
        case R_CLAIM:
            if (!runner_parse_long(cmd, "claim", optarg, 1, 100000, &o->b.claim))
                return 0;
            break;
        case R_FLUSHR:
            if (!runner_parse_long(cmd, "flush-records", optarg, 1, 1 << 24, &o->b.flush_records))
                return 0;
            break;
        case R_SHARDR:
            if (!runner_parse_long(cmd, "shard-records", optarg, 1, 1L << 40, &o->b.shard_records))
                return 0;
            break;
        case R_SHARDB:
            if (!runner_parse_size(cmd, "shard-bytes", optarg, &o->b.shard_bytes))
                return 0;
            break;
        case 'h':
            usage(stdout);
            runner_help_exit();
        default: usage(stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern run: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (!o->b.db) {
        fprintf(stderr, "quern run: --db is required\n");
        usage(stderr);
        return 0;
    }
    if (o->b.metrics_file &&
        !runner_out_file_ok("run", "metrics-file", o->b.metrics_file, o->b.db, 1))
        return 0;
    return runner_engine_opts_check("run", &o->eo);
}

/* The core's progress, shown on stderr: a live line on a terminal, else a log line every
 * --progress seconds; then one summary line per job. */
static void show(void *user, const struct batch_progress *p, enum batch_show what)
{
    struct runner_term *term = user;
    char line[1024];
    if (what == BATCH_SHOW_FINAL) {
        runner_progress_summary(p, line, sizeof(line));
        if (term->tty) {
            char full[1100];
            snprintf(full, sizeof(full), "quern run: %s", line);
            runner_term_finish(term, full);
        } else {
            LOG_INFO("%s", line);
        }
    } else if (term->tty) {
        runner_progress_line(p, runner_term_width(term), term->color, line, sizeof(line));
        runner_term_redraw(term, line);
    } else {
        runner_progress_log(p, line, sizeof(line));
        LOG_INFO("%s", line);
    }
}

/* The run's JSON summary (caller frees); sorts the latency arrays. */
static char *summary_json(const struct batch_stats *s, const char *reason, const char *error,
                          int spec_on)
{
    double el = runner_now() - s->t_start;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "run_id", (double)s->run_id);
    cJSON_AddStringToObject(o, "exit_reason", reason);
    if (error) /* (kept in the queue: status says why the last run failed) */
        job_json_add_text(o, "error", error);
    cJSON_AddNumberToObject(o, "elapsed_s", el);
    /* > 0: the run waited for items leased by other live runs before it could finish */
    cJSON_AddNumberToObject(o, "waited_for_other_runs_s", s->waited_s);
    cJSON_AddNumberToObject(o, "items_done", (double)s->items_done);
    cJSON_AddNumberToObject(o, "items_failed", (double)s->items_failed);
    /* unfinished requests whose lease the run lost (cancelled, taken over): not computed on */
    cJSON_AddNumberToObject(o, "items_dropped", (double)s->items_dropped);
    cJSON_AddNumberToObject(o, "items_returned", (double)s->items_returned);
    cJSON_AddNumberToObject(o, "records_discarded", (double)s->records_discarded);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)s->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)s->completion_tokens);
    cJSON_AddNumberToObject(o, "output_tok_s", el > 0 ? (double)s->completion_tokens / el : 0);
    runner_add_percentiles(o, "ttft_ms", s->ttft_ms, s->n_lat);
    runner_add_percentiles(o, "tpot_ms", s->tpot_ms, s->n_lat);
    /* sequences preempted to free KV blocks (recomputed later): the pool is small for the load */
    cJSON_AddNumberToObject(o, "preemptions", (double)s->engine.preemptions);
    runner_add_spec_json(o, &s->engine, spec_on);
    cJSON_AddNumberToObject(o, "peak_rss_mb", (double)ru.ru_maxrss / 1024.0);
    char *str = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return str;
}

/* One run over o->b (a queue file, or one part): open, work, end, print its summary. The exit
 * code; *busy (may be NULL) is set when the part is in use by another process. */
static int run_once(struct run_opts *o, int *busy)
{
    struct batch_run *r = NULL;
    struct err_detail err = {0};
    int rc = RUNNER_EXIT_ERROR;
    const char *reason = "error";
    enum status st = batch_run_open(&r, &o->b, &err);
    if (st) {
        if (busy && st == ST_ERR_BUSY)
            *busy = 1;
        else if (g_signals && st == ST_ERR_BUSY) /* (the wait was cut short: queue_set_interrupt) */
            LOG_INFO("stopping: signal received while another process held the queue: %s", err.msg);
        else
            LOG_ERROR("%s", err.msg);
        batch_run_free(r);
        return g_signals && st == ST_ERR_BUSY ? RUN_EXIT_TEMPFAIL : rc;
    }
    int cut = 0; /* a wait for the queue cut short by a signal, before the run held anything */
    switch (batch_run_jobs(r, &err)) {
    case BATCH_END_FAILED:
        if (g_signals && err.status == ST_ERR_BUSY && batch_run_interruptible(r)) {
            LOG_INFO("stopping: signal received while another process held the queue: %s", err.msg);
            reason = "signal";
            rc = RUN_EXIT_TEMPFAIL;
            cut = 1;
            break;
        }
        LOG_ERROR("%s", err.msg);
        reason = "error";
        break;
    case BATCH_END_STOPPED:
        reason = g_signals ? "signal" : "max_runtime";
        rc = RUN_EXIT_TEMPFAIL;
        break;
    case BATCH_END_REMAINS:
        reason = "work_remains";
        rc = RUN_EXIT_TEMPFAIL;
        break;
    case BATCH_END_DRAINED:
        reason = "drained";
        rc = RUNNER_EXIT_OK;
        break;
    }
    char *sum = summary_json(batch_run_stats(r), reason, strcmp(reason, "error") ? NULL : err.msg,
                             o->eo.ep.spec != 0);
    if (sum)
        puts(sum);
    fflush(stdout);
    if (batch_run_end(r, reason, sum, &err)) {
        /* the work is committed, but the queue could not be written: say so (the run row is
         * ended by the next run on this host, or when its heartbeat is older than a lease) */
        if (cut) { /* (the queue is still locked, and the run holds nothing: not an error) */
            LOG_WARN("recording the end of the run: %s; the next run or status on this host "
                     "ends it",
                     err.msg);
        } else {
            LOG_ERROR("recording the end of the run: %s", err.msg);
            rc = RUNNER_EXIT_ERROR;
        }
    }
    free(sum);
    batch_run_free(r);
    return rc;
}

/* Under Slurm without --max-runtime: stop in time to commit before the allocation ends. */
static void slurm_runtime(struct run_opts *o)
{
    const char *end = getenv("SLURM_JOB_END_TIME");
    if (o->b.max_runtime > 0 || !end || !*end)
        return;
    char *rest;
    double t_end = strtod(end, &rest);
    if (*rest || t_end <= (double)time(NULL)) {
        LOG_WARN("SLURM_JOB_END_TIME=%s is not a time to come: ignored", end);
        return;
    }
    double left = t_end - (double)time(NULL) - o->b.grace - 60;
    if (left < 1)
        left = 1;
    o->b.max_runtime = (float)left;
    LOG_INFO("SLURM_JOB_END_TIME: --max-runtime %.0f s (the allocation's end less --grace and "
             "60 s)",
             left);
}

/* May part k be taken over? Not in use (we can open it at once), with work left (items, or a
 * finished job whose manifest is not written yet: a part that got no lines is done at submit),
 * and, when `owned` is set, worked on before by a run that is gone (never-started parts are
 * left to their own task). -1 (logged) when the part cannot be opened for another reason than
 * being in use: missing, or not a queue. */
static int part_free_with_work(const struct batch_parts *p, int k, int owned)
{
    struct queue *q = NULL;
    struct err_detail err = {0};
    enum status st = batch_parts_open(p, k, 1, 0, &q, &err);
    if (st == ST_ERR_BUSY)
        return 0;
    if (st) {
        LOG_ERROR("part %d: %s", k, err.msg);
        return -1;
    }
    struct queue_job *jobs = NULL;
    size_t n = 0;
    int64_t queued = 0, leased = 0;
    int ran = 0, work = 0;
    if (!queue_job_list(q, &jobs, &n, &err) && n == 1 &&
        !queue_job_unfinished(q, jobs[0].id, &queued, &leased, &err)) {
        char dir[4096];
        work = queued + leased > 0 || (jobs[0].state == QUEUE_JOB_QUEUED && !jobs[0].n_items);
        if (!work && (jobs[0].state == QUEUE_JOB_DONE || jobs[0].state == QUEUE_JOB_CANCELLED))
            work = batch_job_dir(q, &jobs[0], NULL, 0, dir, sizeof(dir), &err) ||
                   !batch_manifest_current(q, &jobs[0], dir);
    }
    int ok = work && !queue_runs_any(q, &ran, &err) && (!owned || ran);
    queue_job_list_free(jobs, n);
    queue_close(q);
    return ok;
}

/* A partitioned queue: the run's own part (--part, $SLURM_ARRAY_TASK_ID), then the parts it
 * may take over; without a part, every part not in use that has work. */
static int run_parts(struct run_opts *o, const struct batch_parts *p)
{
    long own = o->part;
    const char *env = getenv("SLURM_ARRAY_TASK_ID");
    if (own < 0 && env && *env) {
        char *end;
        own = strtol(env, &end, 10);
        if (*end || own < 0) {
            LOG_ERROR("SLURM_ARRAY_TASK_ID=%s is not a part number", env);
            return RUNNER_EXIT_USAGE;
        }
    }
    if (own < 0 && o->no_take_over) {
        LOG_ERROR("--no-take-over works on one part: give --part (or $SLURM_ARRAY_TASK_ID)");
        return RUNNER_EXIT_USAGE;
    }
    if (own >= p->n) {
        LOG_ERROR("part %ld does not exist: %s has parts 0..%d (array tasks 0-%d)", own, p->dir,
                  p->n - 1, p->n - 1);
        return RUNNER_EXIT_USAGE;
    }
    { /* an array that does not cover the parts 0..N-1 leaves some never started (a task only
       * takes over parts whose task started and died): say so in every task's log */
        const char *cnt = getenv("SLURM_ARRAY_TASK_COUNT"), *lo = getenv("SLURM_ARRAY_TASK_MIN");
        const long n_tasks = cnt && *cnt ? strtol(cnt, NULL, 10) : -1;
        const long first = lo && *lo ? strtol(lo, NULL, 10) : 0;
        if ((n_tasks >= 0 && n_tasks != p->n) || first != 0)
            LOG_WARN("this Slurm array has %s task(s) from index %ld, but %s has %d parts: "
                     "give --array=0-%d, or parts no task runs stay queued",
                     cnt && *cnt ? cnt : "?", first, p->dir, p->n, p->n - 1);
    }
    o->b.parts = p;
    int rc = RUNNER_EXIT_OK, busy = 0, broken = 0;
    double t0 = runner_now(), max_rt = o->b.max_runtime;
    if (own >= 0) {
        o->b.part = (int)own;
        o->b.busy_ms = 2000; /* ride over a status or export reading it */
        LOG_INFO("job '%s': part %ld of %d (%s)", p->job, own, p->n, p->dir);
        rc = run_once(o, &busy);
        if (busy && runner_part_run_alive(p, (int)own, &g_signals)) {
            rc = RUNNER_EXIT_OK;
            LOG_INFO("part %ld is in use by a run: it is that run's to finish", own);
        } else if (busy) {
            /* held, but no run reports from it: a reader, or a crashed host's lock that its
             * file system has not released yet; come back (75: the array script requeues) */
            LOG_WARN("part %ld is locked but no run reports progress from it: try again later "
                     "(exit 75)",
                     own);
            return RUN_EXIT_TEMPFAIL;
        }
        if (o->no_take_over)
            return rc;
    }
    for (int k = 0; k < p->n && (rc == RUNNER_EXIT_OK || rc == RUN_EXIT_TEMPFAIL); k++) {
        if (g_signals || (max_rt > 0 && runner_now() - t0 >= max_rt)) {
            /* stopped with parts this run would have worked on still to do: 75, not the last
             * part's 0 (exit 0 means every item is finished) */
            for (int j = k; j < p->n; j++)
                if (j != own && part_free_with_work(p, j, own >= 0) > 0) {
                    rc = RUN_EXIT_TEMPFAIL;
                    break;
                }
            break;
        }
        int w = k == own ? 0 : part_free_with_work(p, k, own >= 0);
        broken |= w < 0;
        if (w <= 0)
            continue;
        if (max_rt > 0)
            o->b.max_runtime = (float)(max_rt - (runner_now() - t0));
        o->b.part = k;
        o->b.busy_ms = 1;
        busy = 0;
        LOG_INFO("job '%s': %s part %d of %d", p->job, own >= 0 ? "taking over" : "working on",
                 k, p->n);
        int r = run_once(o, &busy);
        if (!busy && r != RUNNER_EXIT_OK)
            rc = r;
    }
    if (broken && rc == RUNNER_EXIT_OK) { /* exit 0 says every item is finished */
        LOG_ERROR("%s: a part cannot be opened (above): its items are not finished", p->dir);
        rc = RUNNER_EXIT_ERROR;
    }
    return rc;
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
    /* HUP (terminal closed), PIPE (stdout/stderr reader gone) and XCPU (a soft CPU-time limit:
     * the kernel's warning before its kill) stop like TERM: the leases go back and the work done
     * so far is committed, instead of dying mid-run with the items' attempts spent */
    static const int stop_sigs[] = {SIGTERM, SIGINT, SIGUSR1, SIGHUP, SIGPIPE, SIGXCPU};
    for (size_t i = 0; i < sizeof(stop_sigs) / sizeof(stop_sigs[0]); i++) {
        /* ... except a HUP ignored on purpose (`nohup quern run`): it stays ignored */
        struct sigaction old;
        if (stop_sigs[i] == SIGHUP && !sigaction(SIGHUP, NULL, &old) && old.sa_handler == SIG_IGN)
            continue;
        sigaction(stop_sigs[i], &sa, NULL);
    }

    struct runner_term term;
    runner_term_init(&term, stderr);
    o.b.backend = runner_engine_backend(&o.eo);
    o.b.engine = o.eo.ep;
    o.b.draft_model = o.eo.draft_model;
    o.b.signals = &g_signals;
    o.b.show_period = term.tty ? RUNNER_PROGRESS_TTY_S : o.progress;
    o.b.show = show;
    o.b.show_user = &term;
    slurm_runtime(&o);
    struct batch_parts parts;
    struct err_detail err = {0};
    int rc = RUNNER_EXIT_ERROR, isdir = batch_parts_find(o.b.db, &parts, &err);
    if (isdir < 0)
        LOG_ERROR("%s", err.msg);
    else if (isdir)
        rc = run_parts(&o, &parts);
    else if (o.part >= 0 || o.no_take_over) {
        LOG_ERROR("--%s: %s is not the directory of a partitioned queue",
                  o.part >= 0 ? "part" : "no-take-over", o.b.db);
        rc = RUNNER_EXIT_USAGE;
    } else
        rc = run_once(&o, NULL);
    runner_term_close(&term);
    if (lock_fd >= 0)
        close(lock_fd);
    return rc;
}
