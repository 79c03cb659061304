/* `quern status`, `quern cancel` and `quern retry`: look at and steer jobs in the queue;
 * `status --watch` follows a job that runs in other processes, live. */
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "batch/batch.h"
#include "common/log.h"
#include "jobs/json.h"
#include "queue/queue.h"
#include "runner/progress.h"
#include "runner/runner.h"
#include "runner/term.h"

static const char status_usage[] =
    "usage: quern status --db Q.db [--job ID|NAME] [--json | --watch [--progress SECS]]\n"
    "       quern status --db PARTS_DIR [--json]\n"
    "\n"
    "Per job: state, items by state, tokens in/out, throughput over the time runs have worked\n"
    "on it, ETA, failed items by error code, and the runs working on it now (run id, host, pid,\n"
    "heartbeat age, live generated/prompt tok/s, running sequences, KV use, as each run stores\n"
    "them about once a second; --json adds started_ms). The ETA is token-based while runs\n"
    "report live rates (items left x mean completion tokens, less tokens already generated,\n"
    "over the summed generation rate; unknown until as many items have finished as are\n"
    "running), else, with no run on the job, from the items its runs finished per second; null\n"
    "when unknown. Time of runs leaves out the time between runs. Counts are committed items. A "
    "job still being submitted shows as\n"
    "\"submitting\" with its items so far, and nothing else counts it yet. First, runs on this\n"
    "host whose process is gone give their items back, and the jobs left by killed submits are\n"
    "deleted; a finished job whose manifest.json is missing or stale gets a new one.\n"
    "A partitioned queue (a directory from `submit --partitions`) shows its job in total and\n"
    "part by part; a part that its run holds is shown from the run's progress file\n"
    "(part-NNNN.progress.json). --json: one array with the job's object (name, dir, parts,\n"
    "state, items, done, failed, cancelled, unfinished, gen_tok_s, part_status: per part the\n"
    "same counts, in_use, completion_tokens, errors, series, and for a part in use\n"
    "host/pid/progress_age_s/loading: true while its run loads the model).\n"
    "\n"
    "  --json           one JSON array, an object per job (fields as in the README), with\n"
    "                   the job's time series: \"series\": {\"fields\": [...], \"rows\":\n"
    "                   [[...], ...]}, a row per sample a run recorded (every 5 s and at the\n"
    "                   end of its work on the job): t_ms, run_id, finished items, engine\n"
    "                   counters (tokens, prefix-cache hits, steps, batch tokens, drafts) and\n"
    "                   load (sequences, KV blocks)\n"
    "  --watch          follow the job (or all jobs) until nothing is queued or leased, or\n"
    "                   Ctrl-C (exit 0): on a terminal a live line on stdout redrawn about once\n"
    "                   a second, as `quern run` shows it; otherwise a \"progress: key=value\n"
    "                   ...\" line every --progress seconds; then one summary line\n"
    "  --progress SECS  log interval of --watch when stdout is not a terminal (default 10)\n";

static const char cancel_usage[] =
    "usage: quern cancel --db Q.db --job ID|NAME\n"
    "       quern cancel --db PARTS_DIR\n"
    "\n"
    "Cancel a job: its queued and leased items become cancelled. A run working on them sees\n"
    "its leases gone at its next lease check (every 2 s) and drops them from the engine then;\n"
    "their records are never committed. Finished records stay in the output, and lines\n"
    "rejected at submit become failed (their error is their answer: `export` writes it). In\n"
    "a partitioned queue every part is cancelled; a part in use gets a request file\n"
    "(part-NNNN.cancel) that its run carries out within about a second. Items are cancelled\n"
    "20,000 per transaction, so that runs sharing the queue are never held up for long; a\n"
    "cancel stopped part-way (a signal, an error) leaves the job live with the items cancelled\n"
    "so far: cancel it again.\n";

static const char retry_usage[] =
    "usage: quern retry --db Q.db --job ID|NAME --failed\n"
    "       quern retry --db PARTS_DIR --failed\n"
    "\n"
    "Put the job's failed items back in the queue (attempts reset). Their old error records\n"
    "stay in the errors shards but are left out by `quern export`. Lines rejected at submit\n"
    "(invalid requests) stay failed: fix them and submit them again. In a partitioned queue\n"
    "every part; a part in use by a run is an error (retry it when the run has ended). Items\n"
    "are retried 20,000 ids per transaction; a retry stopped part-way leaves the rest failed:\n"
    "retry again.\n";

/* Common flags: --db, --job, --json, --failed; status's --watch and --progress. */
struct jobs_opts {
    const char *db;  /* --db */
    const char *job; /* --job */
    int json;        /* --json */
    int failed;      /* --failed */
    int watch;       /* --watch */
    int dir;         /* --db is a partitioned queue (probe_parts) */
    struct batch_parts parts; /* ... and its catalogue */
    float progress;  /* --progress: --watch log interval (s) */
};

static int parse_jobs(const char *cmd, const char *usage, int argc, char **argv, struct jobs_opts *o)
{
    static const struct option longopts[] = {
        {"db", required_argument, 0, 'd'}, {"job", required_argument, 0, 'j'},
        {"json", no_argument, 0, 'J'},     {"failed", no_argument, 0, 'f'},
        {"watch", no_argument, 0, 'w'},    {"progress", required_argument, 0, 'p'},
        {"help", no_argument, 0, 'h'},     {0, 0, 0, 0},
    };
    memset(o, 0, sizeof(*o));
    o->progress = 10;
    int status = !strcmp(cmd, "status");
    int c, progress_set = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd': o->db = optarg; break;
        case 'j': o->job = optarg; break;
        case 'J': o->json = 1; break;
        case 'f': o->failed = 1; break;
        case 'w': o->watch = 1; break;
        case 'p':
            if (!runner_parse_float(cmd, "progress", optarg, 0.1, 1e6, &o->progress))
                return 0;
            progress_set = 1;
            break;
        case 'h':
            fputs(usage, stdout);
            runner_help_exit();
        default: fputs(usage, stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern %s: unexpected argument '%s'\n", cmd, argv[optind]);
        return 0;
    }
    if (!o->db) {
        fprintf(stderr, "quern %s: --db is required\n%s", cmd, usage);
        return 0;
    }
    if ((o->watch && (!status || o->json)) || (!status && o->json)) {
        fprintf(stderr, "quern %s: %s\n%s", cmd,
                status ? "--watch and --json do not go together" : "unexpected option", usage);
        return 0;
    }
    /* options another command takes are refused, not ignored */
    const char *stray = o->failed && strcmp(cmd, "retry") ? "--failed is retry's option"
                        : progress_set && !o->watch       ? "--progress goes with --watch"
                                                          : NULL;
    if (stray) {
        fprintf(stderr, "quern %s: %s\n%s", cmd, stray, usage);
        return 0;
    }
    return 1;
}

/* Is --db a partitioned queue (o->dir, o->parts)? 0, or an exit code after saying what is wrong
 * with the directory. */
static int probe_parts(struct jobs_opts *o)
{
    struct err_detail err = {0};
    o->dir = batch_parts_find(o->db, &o->parts, &err);
    if (o->dir >= 0)
        return 0;
    LOG_ERROR("%s", err.msg);
    return RUNNER_EXIT_ERROR;
}

/* A job still being submitted: its items so far, and zero in every other count. */
static void submitting_counts(struct queue_counts *c)
{
    int64_t total = c->total;
    memset(c, 0, sizeof(*c));
    c->total = total;
}

/* Wall clock, unix ms (the queue's clock). */
static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Does run r work on job_id (0: on any job)? Its own job, or the one its progress names. */
static int run_on_job(const struct queue_run_info *r, const struct batch_progress *rp,
                      int64_t job_id)
{
    return !job_id || r->job_id == job_id || (rp && rp->job_id == job_id);
}

/* The job's numbers (job_id 0: all ready jobs) as another process sees them: committed counts
 * from the queue, and the live rates, sequences and KV use summed over its runs whose last
 * progress is fresher than BATCH_PROGRESS_STALE_S; the ETA token-based from those. Elapsed
 * time is the time runs have worked on the job (worked_ms, queue_job_timing: the time between
 * runs left out), and while a run works on it, the time since the later of the last run time
 * counted (last_ms) and *run_start, the earliest start of a run seen on the job (in/out, 0
 * none yet). */
static void job_progress(int64_t job_id, const char *name, const struct queue_counts *c,
                         int64_t last_ms, int64_t worked_ms, const struct queue_run_info *runs,
                         size_t n_runs, int64_t *run_start, struct batch_progress *p)
{
    memset(p, 0, sizeof(*p));
    p->job_id = job_id;
    snprintf(p->job, sizeof(p->job), "%s", name ? name : "");
    p->total = c->total;
    p->done = c->items[QUEUE_ITEM_DONE];
    p->failed = c->items[QUEUE_ITEM_FAILED];
    p->cancelled = c->items[QUEUE_ITEM_CANCELLED];
    p->prompt_tokens = c->prompt_tokens;
    p->prompt_all = 1;
    double mean_sum = 0, mean_n = 0;
    int on_job = 0; /* runs not ended working on it */
    for (size_t i = 0; i < n_runs; i++) {
        struct batch_progress rp;
        int have = batch_progress_from_json(runs[i].progress_json, &rp);
        if (runs[i].gone || !run_on_job(&runs[i], have ? &rp : NULL, job_id))
            continue;
        if (!*run_start || runs[i].started_ms < *run_start)
            *run_start = runs[i].started_ms;
        on_job++;
        if (!have || (double)runs[i].age_ms / 1000.0 > BATCH_PROGRESS_STALE_S)
            continue;
        p->runs++;
        p->gen_tok_s += rp.gen_tok_s;
        p->prompt_tok_s += rp.prompt_tok_s;
        p->inflight_tokens += rp.inflight_tokens;
        p->running += rp.running;
        p->in_flight += rp.in_flight > 0 ? rp.in_flight : rp.running;
        p->waiting += rp.waiting;
        p->kv_used += rp.kv_used;
        p->kv_total += rp.kv_total;
        p->spec_drafted += rp.spec_drafted;
        p->spec_accepted += rp.spec_accepted;
        if (rp.mean_out > 0) {
            mean_sum += rp.mean_out;
            mean_n++;
        }
    }
    p->gen_tokens = c->completion_tokens + (int64_t)p->inflight_tokens;
    if (p->done > 0)
        p->mean_out = (double)c->completion_tokens / (double)p->done;
    else if (mean_n > 0)
        p->mean_out = mean_sum / mean_n;
    const int64_t now = now_ms(), since = last_ms > *run_start ? last_ms : *run_start;
    p->elapsed_s = (double)worked_ms / 1000.0;
    if (on_job && since && now > since) /* a run works on it now */
        p->elapsed_s += (double)(now - since) / 1000.0;
    batch_progress_eta(p);
}

/* The runs of job_id not ended, as JSON: who and where, how fresh, and their own numbers. */
static cJSON *runs_json(const struct queue_run_info *runs, size_t n_runs, int64_t job_id)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; i < n_runs; i++) {
        struct batch_progress rp;
        int have = batch_progress_from_json(runs[i].progress_json, &rp);
        if (!run_on_job(&runs[i], have ? &rp : NULL, job_id))
            continue;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "run_id", (double)runs[i].id);
        if (runs[i].worker_id)
            job_json_add_text(o, "worker_id", runs[i].worker_id);
        else
            cJSON_AddNullToObject(o, "worker_id");
        if (runs[i].host)
            job_json_add_text(o, "host", runs[i].host);
        else
            cJSON_AddNullToObject(o, "host");
        cJSON_AddNumberToObject(o, "pid", (double)runs[i].pid);
        cJSON_AddNumberToObject(o, "started_ms", (double)runs[i].started_ms);
        cJSON_AddNumberToObject(o, "heartbeat_age_s", (double)runs[i].age_ms / 1000.0);
        cJSON_AddBoolToObject(o, "stale",
                              (double)runs[i].age_ms / 1000.0 > BATCH_PROGRESS_STALE_S);
        cJSON_AddBoolToObject(o, "dead", runs[i].gone);
        if (have) {
            cJSON *lp = cJSON_AddObjectToObject(o, "progress");
            batch_progress_add_json(lp, &rp);
        } else {
            cJSON_AddNullToObject(o, "progress");
        }
        cJSON_AddItemToArray(a, o);
    }
    return a;
}

/* The engines of the runs that worked on job_id (queue_run_list_job) as [{"engine": {...},
 * "runs": [ids]}, ...], one entry per distinct engine, in the order of their first run. A run
 * that ended (or died) having computed nothing for the job is left out (a `run --no-wait`
 * that found every item leased by another run made status warn that engines differed); a live
 * one is in, whose outputs are to come. A run that worked with no engine recorded (a quern
 * before queue version 5) is under "engine": null. NULL with err set on failure. */
static cJSON *engines_json(struct queue *q, int64_t job_id, struct err_detail *err)
{
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    if (queue_run_list_job(q, job_id, &runs, &n, err))
        return NULL;
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) {
        if (!runs[i].worked && (runs[i].ended_ms || runs[i].gone))
            continue;
        cJSON *eng = runs[i].engine_json ? cJSON_Parse(runs[i].engine_json) : NULL;
        if (!cJSON_IsObject(eng)) {
            cJSON_Delete(eng);
            if (!runs[i].worked || !(eng = cJSON_CreateNull()))
                continue;
        }
        if (runner_engine_group_add(a, "runs", eng, (double)runs[i].id)) {
            cJSON_Delete(a);
            a = NULL;
        }
    }
    queue_run_info_free(runs, n);
    if (!a)
        err_set(err, ST_ERR_NOMEM, "out of memory");
    return a;
}

/* Rows of a job's series in `status --json` at most: a run samples every 5 s, so days of runs
 * made megabytes of JSON and seconds of work on every status (an audit: 4 s and 247 MB at ten
 * days); longer series are thinned evenly, each run's first and last samples kept (the rows
 * are counters: a thinned series reads the same, coarser). */
#define STATUS_SERIES_MAX 2000

struct run_ix {
    int64_t run_id;
    size_t i;
};

static int by_run_then_index(const void *a, const void *b)
{
    const struct run_ix *x = a, *y = b;
    if (x->run_id != y->run_id)
        return x->run_id < y->run_id ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Marks (1) each run's first and last sample of smp[0..n), the series' first and last, and
 * nothing else; NULL when out of memory. By run, not by neighbours: runs working on one job at
 * once interleave their samples, and every row of such a series was an "edge" (no thinning). */
static unsigned char *run_edges(const struct queue_sample *smp, size_t n)
{
    unsigned char *edge = calloc(n ? n : 1, 1);
    struct run_ix *ix = malloc((n ? n : 1) * sizeof(*ix));
    if (!edge || !ix) {
        free(edge);
        free(ix);
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        ix[i] = (struct run_ix){smp[i].run_id, i};
    qsort(ix, n, sizeof(*ix), by_run_then_index);
    for (size_t k = 0; k < n; k++)
        if (k == 0 || k + 1 == n || ix[k - 1].run_id != ix[k].run_id ||
            ix[k + 1].run_id != ix[k].run_id)
            edge[ix[k].i] = 1;
    if (n) {
        edge[0] = 1;
        edge[n - 1] = 1;
    }
    free(ix);
    return edge;
}

/* The job's time series (queue_sample_list) as {"fields": [...], "rows": [[...], ...]}: one
 * row per sample, oldest first, with t_ms and run_id before the sample's fields. NULL with
 * err set on failure. */
static cJSON *series_json(struct queue *q, int64_t job_id, struct err_detail *err)
{
    struct queue_sample *smp = NULL;
    size_t n = 0;
    if (queue_sample_list(q, job_id, &smp, &n, err))
        return NULL;
    const size_t every = (n + STATUS_SERIES_MAX - 1) / STATUS_SERIES_MAX;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "every", (double)(every ? every : 1));
    cJSON *fields = cJSON_AddArrayToObject(o, "fields");
    cJSON_AddItemToArray(fields, cJSON_CreateString("t_ms"));
    cJSON_AddItemToArray(fields, cJSON_CreateString("run_id"));
    for (int f = 0; f < QUEUE_SAMPLE_FIELDS; f++)
        cJSON_AddItemToArray(fields, cJSON_CreateString(queue_sample_field_name(f)));
    cJSON *rows = cJSON_AddArrayToObject(o, "rows");
    unsigned char *edge = every > 1 ? run_edges(smp, n) : NULL;
    if (every > 1 && !edge) {
        free(smp);
        cJSON_Delete(o);
        err_set(err, ST_ERR_NOMEM, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (every > 1 && !edge[i] && i % every)
            continue;
        cJSON *row = cJSON_CreateArray();
        cJSON_AddItemToArray(row, cJSON_CreateNumber((double)smp[i].t_ms));
        cJSON_AddItemToArray(row, cJSON_CreateNumber((double)smp[i].run_id));
        for (int f = 0; f < QUEUE_SAMPLE_FIELDS; f++)
            cJSON_AddItemToArray(row, cJSON_CreateNumber((double)smp[i].v[f]));
        cJSON_AddItemToArray(rows, row);
    }
    free(edge);
    free(smp);
    return o;
}

cJSON *runner_job_status(struct queue *q, const struct queue_job *j,
                         const struct queue_run_info *runs, size_t n_runs, struct err_detail *err)
{
    struct queue_counts c;
    int64_t first, last, worked;
    if (queue_job_counts(q, j->id, &c, err) ||
        queue_job_timing(q, j->id, &first, &last, &worked, err))
        return NULL;
    if (!j->ready) {
        submitting_counts(&c);
        first = last = worked = 0;
    }
    struct batch_progress p;
    int64_t run_start = 0;
    job_progress(j->id, j->name, &c, last, worked, runs, j->ready ? n_runs : 0, &run_start, &p);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", (double)j->id);
    cJSON_AddStringToObject(o, "name", j->name);
    cJSON_AddStringToObject(o, "state", j->ready ? queue_job_state_str(j->state) : "submitting");
    cJSON_AddBoolToObject(o, "ready", j->ready);
    job_json_add_text(o, "model", j->model_path);
    char dir[4096]; /* where its shards and manifest are (or go: the job's --out at submit) */
    struct err_detail e2 = {0};
    if (!batch_job_dir(q, j, NULL, 0, dir, sizeof(dir), &e2))
        job_json_add_text(o, "output_dir", dir);
    cJSON_AddNumberToObject(o, "items", (double)c.total);
    cJSON *st = cJSON_AddObjectToObject(o, "by_state");
    for (int s = 0; s < QUEUE_ITEM_STATE_COUNT; s++)
        cJSON_AddNumberToObject(st, queue_item_state_str((enum queue_item_state)s),
                                (double)c.items[s]);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)c.prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)c.completion_tokens);
    double secs = (double)worked / 1000.0; /* the time runs worked on it */
    int64_t fin = c.items[QUEUE_ITEM_DONE] + c.items[QUEUE_ITEM_FAILED];
    int64_t left = c.items[QUEUE_ITEM_QUEUED] + c.items[QUEUE_ITEM_LEASED];
    cJSON_AddNumberToObject(o, "run_seconds", secs);
    cJSON_AddNumberToObject(o, "completion_tok_s", secs > 0 ? (double)c.completion_tokens / secs : 0);
    cJSON_AddNumberToObject(o, "items_s", secs > 0 ? (double)fin / secs : 0);
    if (!j->ready) { /* still being submitted: nothing to estimate yet */
        cJSON_AddNullToObject(o, "eta_s");
        cJSON_AddNullToObject(o, "eta_basis");
    } else if (left == 0) {
        cJSON_AddNumberToObject(o, "eta_s", 0);
        cJSON_AddNullToObject(o, "eta_basis");
    } else if (p.eta_s >= 0) {
        cJSON_AddNumberToObject(o, "eta_s", p.eta_s);
        cJSON_AddStringToObject(o, "eta_basis", "tokens");
    } else if (!p.runs && secs > 0 && fin > 0) { /* no run on it now: at its runs' pace */
        cJSON_AddNumberToObject(o, "eta_s", (double)left / ((double)fin / secs));
        cJSON_AddStringToObject(o, "eta_basis", "items");
    } else {
        cJSON_AddNullToObject(o, "eta_s");
        cJSON_AddNullToObject(o, "eta_basis");
    }
    cJSON *live = cJSON_AddObjectToObject(o, "live");
    cJSON_AddNumberToObject(live, "runs", (double)p.runs);
    cJSON_AddNumberToObject(live, "gen_tok_s", p.gen_tok_s);
    cJSON_AddNumberToObject(live, "prompt_tok_s", p.prompt_tok_s);
    cJSON_AddNumberToObject(live, "inflight_tokens", p.inflight_tokens);
    cJSON_AddNumberToObject(live, "mean_out", p.mean_out);
    cJSON_AddNumberToObject(live, "running", (double)p.running);
    cJSON_AddNumberToObject(live, "in_flight", (double)p.in_flight);
    cJSON_AddNumberToObject(live, "waiting", (double)p.waiting);
    cJSON_AddNumberToObject(live, "kv_used", (double)p.kv_used);
    cJSON_AddNumberToObject(live, "kv_total", (double)p.kv_total);
    cJSON_AddItemToObject(o, "runs", runs_json(runs, j->ready ? n_runs : 0, j->id));
    cJSON *engines = engines_json(q, j->id, err);
    if (!engines) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddItemToObject(o, "engines", engines);
    cJSON *errs = cJSON_AddObjectToObject(o, "errors");
    for (size_t i = 0; i < c.n_error_codes; i++)
        cJSON_AddNumberToObject(errs, c.errors[i].code[0] ? c.errors[i].code : "unknown",
                                (double)c.errors[i].count);
    cJSON *series = series_json(q, j->id, err);
    if (!series) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddItemToObject(o, "series", series);
    return o;
}

/* Field key of o as a string or a number; "?" and 0 when it is missing or of another type, so
 * that the printer never assumes what runner_job_status put in. */
static const char *jstr(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsString(v) && v->valuestring ? v->valuestring : "?";
}

static double jnum(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

int runner_engine_group_add(cJSON *groups, const char *key, cJSON *eng, double id)
{
    cJSON *e = NULL, *x;
    cJSON_ArrayForEach(x, groups)
    {
        if (!e && cJSON_Compare(cJSON_GetObjectItem(x, "engine"), eng, 1))
            e = x;
    }
    if (e) {
        cJSON_Delete(eng);
    } else if (!(e = cJSON_CreateObject()) || !cJSON_AddItemToArray(groups, e)) {
        cJSON_Delete(e);
        cJSON_Delete(eng);
        return -1;
    } else if (!cJSON_AddItemToObject(e, "engine", eng)) {
        cJSON_Delete(eng);
        return -1;
    }
    cJSON *ids = cJSON_GetObjectItem(e, key);
    if (!ids && !(ids = cJSON_AddArrayToObject(e, key)))
        return -1;
    const cJSON *last = cJSON_GetArrayItem(ids, cJSON_GetArraySize(ids) - 1);
    if (cJSON_IsNumber(last) && last->valuedouble == id)
        return 0;
    cJSON *v = cJSON_CreateNumber(id);
    if (!v || !cJSON_AddItemToArray(ids, v)) {
        cJSON_Delete(v);
        return -1;
    }
    return 0;
}

void runner_print_engines(const cJSON *engines, const char *unit)
{
    char key[16];
    snprintf(key, sizeof(key), "%ss", unit);
    int n = cJSON_GetArraySize(engines);
    if (n > 1)
        printf("  %d engines ran this job (their outputs can differ):\n", n);
    const cJSON *e, *id;
    cJSON_ArrayForEach(e, engines)
    {
        const cJSON *en = cJSON_GetObjectItem(e, "engine"), *ids = cJSON_GetObjectItem(e, key);
        const cJSON *blk = cJSON_GetObjectItem(en, "kv_block"); /* (older runs lack it) */
        char kv[64];
        snprintf(kv, sizeof(kv), cJSON_IsNumber(blk) ? "%s in blocks of %d" : "%s",
                 jstr(en, "kv_dtype"), cJSON_IsNumber(blk) ? blk->valueint : 0);
        if (cJSON_IsObject(en))
            printf("  %s%s, matmul %s, KV %s, quern %s (%s%s",
                   n > 1 ? "  " : "engine: ", jstr(en, "device"), jstr(en, "matmul"), kv,
                   jstr(en, "quern"), unit, cJSON_GetArraySize(ids) > 1 ? "s" : "");
        else
            printf("  %snot recorded (%s%s", n > 1 ? "  " : "engine: ", unit,
                   cJSON_GetArraySize(ids) > 1 ? "s" : "");
        const char *sep = " ";
        cJSON_ArrayForEach(id, ids)
        {
            printf("%s%.0f", sep, cJSON_IsNumber(id) ? id->valuedouble : 0);
            sep = ", ";
        }
        printf(")\n");
    }
}

static void print_status_text(const cJSON *o)
{
    char model[8192]; /* (a path from the user's submit: printed without control characters) */
    /* the queue's state says a run began the job; whether one works on it now, the runs do */
    const char *state = jstr(o, "state");
    int idle = !strcmp(state, "running"); /* and no run on it that is not dead */
    const cJSON *run;
    cJSON_ArrayForEach(run, cJSON_GetObjectItem(o, "runs"))
    {
        if (!cJSON_IsTrue(cJSON_GetObjectItem(run, "dead")))
            idle = 0;
    }
    printf("job %.0f '%s' [%s%s] model %s\n", jnum(o, "id"), jstr(o, "name"), state,
           idle ? ", no live run" : "", log_printable(jstr(o, "model"), model, sizeof(model)));
    if (cJSON_IsString(cJSON_GetObjectItem(o, "output_dir")))
        printf("  output %s\n", log_printable(jstr(o, "output_dir"), model, sizeof(model)));
    if (!cJSON_IsTrue(cJSON_GetObjectItem(o, "ready"))) {
        printf("  items so far %.0f (still being submitted; no run takes them yet)\n",
               jnum(o, "items"));
        return;
    }
    printf("  items %.0f:", jnum(o, "items"));
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(o, "by_state"))
    {
        printf(" %s %.0f", e->string ? e->string : "?", cJSON_IsNumber(e) ? e->valuedouble : 0);
    }
    printf("\n  tokens: %.0f prompt, %.0f completion; %.1f completion tok/s, %.2f items/s over "
           "%.1f s of runs",
           jnum(o, "prompt_tokens"), jnum(o, "completion_tokens"), jnum(o, "completion_tok_s"),
           jnum(o, "items_s"), jnum(o, "run_seconds"));
    const cJSON *eta = cJSON_GetObjectItem(o, "eta_s");
    const cJSON *basis = cJSON_GetObjectItem(o, "eta_basis");
    if (cJSON_IsNumber(eta) && cJSON_IsString(basis)) /* no ETA line for a finished job */
        printf("; ETA %.0f s (from %s)", eta->valuedouble, basis->valuestring);
    putchar('\n');
    const cJSON *r;
    cJSON_ArrayForEach(r, cJSON_GetObjectItem(o, "runs"))
    {
        const cJSON *lp = cJSON_GetObjectItem(r, "progress");
        char host[1024];
        printf("  run %.0f on %s pid %.0f: heartbeat %.0f s ago%s", jnum(r, "run_id"),
               log_printable(jstr(r, "host"), host, sizeof(host)), jnum(r, "pid"),
               jnum(r, "heartbeat_age_s"),
               cJSON_IsTrue(cJSON_GetObjectItem(r, "dead"))
                   ? " (dead: its process is gone; the next run or status that can write "
                     "the queue gives its items back)"
               : cJSON_IsTrue(cJSON_GetObjectItem(r, "stale")) ? " (stale)"
                                                               : "");
        if (cJSON_IsObject(lp))
            printf(", gen %.1f tok/s, prompt %.1f tok/s, %.0f running, KV %.0f/%.0f blocks",
                   jnum(lp, "gen_tok_s"), jnum(lp, "prompt_tok_s"), jnum(lp, "running"),
                   jnum(lp, "kv_used"), jnum(lp, "kv_total"));
        putchar('\n');
    }
    runner_print_engines(cJSON_GetObjectItem(o, "engines"), "run");
    const cJSON *errs = cJSON_GetObjectItem(o, "errors");
    if (cJSON_GetArraySize(errs)) {
        printf("  errors:");
        cJSON_ArrayForEach(e, errs)
        {
            printf(" %s %.0f", e->string ? e->string : "?", cJSON_IsNumber(e) ? e->valuedouble : 0);
        }
        putchar('\n');
    }
}

/* When the run that ended last failed: which, where, when and why (its summary's error; older
 * runs kept none), so that a cron or Slurm user sees it without its log. */
static void print_last_run_failure(struct queue *q)
{
    struct queue_run_info *last = NULL;
    size_t n = 0;
    struct err_detail err = {0};
    if (queue_run_last_ended(q, &last, &n, &err) || !n || !last[0].exit_reason ||
        strcmp(last[0].exit_reason, "error")) {
        queue_run_info_free(last, n);
        return;
    }
    cJSON *sum = last[0].progress_json ? cJSON_Parse(last[0].progress_json) : NULL;
    const cJSON *e = cJSON_GetObjectItem(sum, "error");
    char host[1024], msg[2048];
    const int64_t ago = (int64_t)time(NULL) * 1000 - last[0].ended_ms;
    printf("last run %lld on %s pid %lld failed %.0f s ago: %s\n", (long long)last[0].id,
           log_printable(last[0].host ? last[0].host : "?", host, sizeof(host)),
           (long long)last[0].pid, ago > 0 ? (double)ago / 1000.0 : 0.0,
           cJSON_IsString(e) ? log_printable(e->valuestring, msg, sizeof(msg))
                             : "(no message kept: see its log)");
    cJSON_Delete(sum);
    queue_run_info_free(last, n);
}

/* A done or cancelled job whose output directory has no current manifest (its last write failed,
 * the run was killed right after the last commit) gets one here, when no shard is open. */
static void seal_manifest(struct queue *q, const struct queue_job *j)
{
    char dir[4096];
    struct err_detail err = {0};
    struct queue_shard *sh = NULL;
    size_t n = 0;
    struct stat sb;
    if (queue_read_only(q) || !j->ready ||
        (j->state != QUEUE_JOB_DONE && j->state != QUEUE_JOB_CANCELLED) ||
        queue_shard_list(q, j->id, &sh, &n, &err))
        return;
    int open = 0;
    for (size_t i = 0; i < n; i++)
        open += sh[i].state == QUEUE_SHARD_OPEN;
    queue_shard_list_free(sh, n);
    if (open || batch_job_dir(q, j, NULL, 0, dir, sizeof(dir), &err) || stat(dir, &sb) ||
        batch_manifest_current(q, j, dir))
        return;
    if (batch_outdir_claim(q, j, dir, &err) || batch_manifest_write(q, j, dir, &err))
        LOG_WARN("job %s: writing its missing manifest: %s", j->name, err.msg);
    else
        LOG_INFO("job %s: manifest.json was missing or stale; written", j->name);
}

static volatile sig_atomic_t g_watch_stop; /* SIGINT, SIGTERM or SIGHUP during --watch */

static void on_watch_signal(int sig)
{
    (void)sig;
    g_watch_stop = 1;
}

/* One look at the job (j NULL: all ready jobs): *p and whether anything is left to do (items
 * queued or leased). */
static enum status watch_look(struct queue *q, const struct queue_job *j, int64_t *run_start,
                              struct batch_progress *p, int *left, struct err_detail *err)
{
    struct queue_counts c;
    int64_t first, last, worked;
    struct queue_run_info *runs = NULL;
    size_t n_runs = 0;
    enum status st;
    if ((st = queue_job_counts(q, j ? j->id : 0, &c, err)) ||
        (st = queue_job_timing(q, j ? j->id : 0, &first, &last, &worked, err)) ||
        (st = queue_run_list_live(q, &runs, &n_runs, err)))
        return st;
    if (j && !j->ready) { /* still being submitted: it may become ready; show it empty */
        submitting_counts(&c);
        last = worked = 0;
    }
    job_progress(j ? j->id : 0, j ? j->name : NULL, &c, last, worked, runs, n_runs, run_start, p);
    queue_run_info_free(runs, n_runs);
    *left = (j && !j->ready) || c.items[QUEUE_ITEM_QUEUED] + c.items[QUEUE_ITEM_LEASED] > 0;
    return ST_OK;
}

/* status --watch: redraw (or log) until nothing is left or a signal; then the summary line. */
static enum status status_watch(struct queue *q, const struct jobs_opts *o, struct queue_job *j,
                                struct err_detail *err)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_watch_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    struct runner_term t;
    runner_term_init(&t, stdout);
    double period = t.tty ? RUNNER_PROGRESS_TTY_S : o->progress, next = runner_now();
    struct batch_progress p;
    int64_t run_start = 0; /* earliest start of a run seen on the job while watching */
    enum status st = ST_OK;
    for (;;) {
        int left = 0;
        if (j && !j->ready) { /* see whether its submit has finished */
            struct queue_job nj;
            if ((st = queue_job_get(q, j->id, &nj, err)))
                break;
            queue_job_free(j);
            *j = nj;
        }
        if ((st = watch_look(q, j, &run_start, &p, &left, err)) || !left || g_watch_stop)
            break;
        double now = runner_now();
        if (now >= next) {
            char line[1024];
            if (t.tty) {
                runner_progress_line(&p, runner_term_width(&t), t.color, line, sizeof(line));
                runner_term_redraw(&t, line);
            } else {
                runner_progress_log(&p, line, sizeof(line));
                printf("%s\n", line);
                fflush(stdout);
            }
            next += period;
            if (next <= now)
                next = now + period;
        }
        /* wake in time for the next line, and within 0.25 s for the end of the job */
        double nap = fmin(0.25, fmax(0.01, next - runner_now()));
        struct timespec ts = {0, (long)(nap * 1e9)};
        nanosleep(&ts, NULL);
    }
    if (!st) {
        char line[1024], full[1100];
        runner_progress_summary(&p, line, sizeof(line));
        snprintf(full, sizeof(full), "quern status: %s%s", line,
                 g_watch_stop ? " (interrupted)" : "");
        runner_term_finish(&t, full);
    }
    runner_term_close(&t);
    return st;
}

int runner_cmd_status(int argc, char **argv)
{
    struct jobs_opts o;
    if (!parse_jobs("status", status_usage, argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    int prc = probe_parts(&o);
    if (prc)
        return prc;
    struct err_detail err = {0};
    if (o.dir && o.watch) {
        LOG_ERROR("--watch does not follow a partitioned queue yet: use status without it");
        return RUNNER_EXIT_USAGE;
    }
    if (o.dir)
        return runner_parts_status(&o.parts, o.job, o.json);
    struct queue *q;
    /* no quick_check: status is polled, and a damaged page it reads is still an error */
    struct queue_options qo = {.must_exist = true, .read_only_ok = true};
    if (queue_open_opts(&q, o.db, &qo, &err)) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    /* killed submits leave jobs that are not ready: delete them before showing any */
    struct proc_identity self;
    proc_identity_self(&self);
    if (queue_read_only(q)) {
        LOG_INFO("queue %s is on a read-only file system: shown as stored (a run that has not "
                 "ended there is not running: nothing can write the queue)%s",
                 o.db, o.watch ? "; shown once, not watched" : "");
        o.watch = 0;
    } else if (queue_jobs_gc(q, &self, QUEUE_DEFAULT_SUBMIT_STALE_MS, NULL, &err))
        LOG_WARN("ending dead runs and the jobs of dead submits: %s", err.msg);
    struct queue_job *jobs = NULL;
    size_t n = 0;
    int rc = RUNNER_EXIT_ERROR;
    if (o.job) {
        jobs = calloc(1, sizeof(*jobs));
        if (jobs && !queue_job_find(q, o.job, jobs, &err))
            n = 1;
        else
            goto out;
    } else if (queue_job_list(q, &jobs, &n, &err)) {
        goto out;
    }
    if (o.watch) {
        for (size_t i = 0; i < n; i++)
            seal_manifest(q, &jobs[i]);
        if (status_watch(q, &o, o.job ? &jobs[0] : NULL, &err))
            goto out;
        rc = RUNNER_EXIT_OK;
        goto out;
    }
    struct queue_run_info *runs = NULL;
    size_t n_runs = 0;
    if (queue_run_list_live(q, &runs, &n_runs, &err))
        goto out;
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; i < n; i++) {
        seal_manifest(q, &jobs[i]);
        cJSON *js = runner_job_status(q, &jobs[i], runs, n_runs, &err);
        if (!js) {
            cJSON_Delete(arr);
            queue_run_info_free(runs, n_runs);
            goto out;
        }
        if (!o.json)
            print_status_text(js);
        cJSON_AddItemToArray(arr, js);
    }
    if (o.json) {
        char *s = cJSON_PrintUnformatted(arr);
        if (s)
            puts(s);
        free(s);
    } else if (!n) {
        puts("no jobs");
    }
    if (!o.json && n && !o.job)
        print_last_run_failure(q);
    cJSON_Delete(arr);
    queue_run_info_free(runs, n_runs);
    rc = RUNNER_EXIT_OK;
out:
    if (rc)
        LOG_ERROR("%s", err.msg);
    queue_job_list_free(jobs, n); /* frees the array too, also when n is 0 */
    queue_close(q);
    return rc;
}

static int steer(const char *cmd, const char *usage, int argc, char **argv, int retry)
{
    struct jobs_opts o;
    if (!parse_jobs(cmd, usage, argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    int prc = probe_parts(&o);
    if (prc)
        return prc;
    if ((!o.job && !o.dir) || (retry && !o.failed)) {
        fprintf(stderr, "quern %s: %s\n%s", cmd,
                retry && !o.failed
                    ? "--failed is required (the failed items are what a retry queues)"
                    : "--job is required",
                usage);
        return RUNNER_EXIT_USAGE;
    }
    if (o.dir)
        return runner_parts_steer(&o.parts, cmd, o.job, retry);
    struct err_detail err = {0};
    struct queue *q = NULL;
    struct queue_job j = {0};
    int64_t n = 0;
    int rc = RUNNER_EXIT_ERROR;
    /* these write: check the whole file first rather than change a damaged one */
    struct queue_options qo = {.must_exist = true, .check_integrity = true};
    if (queue_open_opts(&q, o.db, &qo, &err) || queue_job_find_ready(q, o.job, &j, &err) ||
        (retry ? queue_job_retry_failed(q, j.id, &n, &err) : queue_job_cancel(q, j.id, &n, &err))) {
        LOG_ERROR("%s", err.msg);
        if (!retry && n > 0)
            LOG_ERROR("job %lld: %lld items were cancelled before the error; the job is not "
                      "cancelled yet: run the cancel again",
                      (long long)j.id, (long long)n);
    } else {
        fprintf(stderr, "quern %s: job %lld '%s': %lld items %s\n", cmd, (long long)j.id, j.name,
                (long long)n, retry ? "queued again" : "cancelled");
        struct queue_counts c;
        if (retry && !queue_job_counts(q, j.id, &c, &err) && c.items[QUEUE_ITEM_FAILED] > 0)
            fprintf(stderr,
                    "quern retry: %lld failed items stay failed: lines rejected at submit are "
                    "not retried (fix them and submit them again)\n",
                    (long long)c.items[QUEUE_ITEM_FAILED]);
        rc = RUNNER_EXIT_OK;
    }
    queue_job_free(&j);
    queue_close(q);
    return rc;
}

int runner_cmd_cancel(int argc, char **argv) { return steer("cancel", cancel_usage, argc, argv, 0); }

int runner_cmd_retry(int argc, char **argv) { return steer("retry", retry_usage, argc, argv, 1); }
