/* `quern status`, `quern cancel` and `quern retry`: look at and steer jobs in the queue. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "queue/queue.h"
#include "runner/output.h"
#include "runner/runner.h"

static const char status_usage[] =
    "usage: quern status --db Q.db [--job ID|NAME] [--json]\n"
    "\n"
    "Per job: state, items by state, tokens in/out, throughput and ETA over the time runs\n"
    "have worked on it, and failed items by error code. A job still being submitted shows as\n"
    "\"submitting\" with its items so far, and nothing else counts it yet. The jobs left by\n"
    "killed submits are deleted first.\n";

static const char cancel_usage[] =
    "usage: quern cancel --db Q.db --job ID|NAME\n"
    "\n"
    "Cancel a job: its queued and leased items become cancelled; running workers drop them\n"
    "at their next commit. Finished records stay in the output.\n";

static const char retry_usage[] =
    "usage: quern retry --db Q.db --job ID|NAME --failed\n"
    "\n"
    "Put the job's failed items back in the queue (attempts reset). Their old error records\n"
    "stay in the errors shards but are left out by `quern export`.\n";

/* Common flags: --db, --job, --json, --failed. */
struct jobs_opts {
    const char *db;  /* --db */
    const char *job; /* --job */
    int json;        /* --json */
    int failed;      /* --failed */
};

static int parse_jobs(const char *cmd, const char *usage, int argc, char **argv, struct jobs_opts *o)
{
    static const struct option longopts[] = {
        {"db", required_argument, 0, 'd'}, {"job", required_argument, 0, 'j'},
        {"json", no_argument, 0, 'J'},     {"failed", no_argument, 0, 'f'},
        {"help", no_argument, 0, 'h'},     {0, 0, 0, 0},
    };
    memset(o, 0, sizeof(*o));
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd': o->db = optarg; break;
        case 'j': o->job = optarg; break;
        case 'J': o->json = 1; break;
        case 'f': o->failed = 1; break;
        case 'h': fputs(usage, stdout); exit(RUNNER_EXIT_OK);
        default: fputs(usage, stderr); return 0;
        }
    }
    if (optind < argc || !o->db) {
        fprintf(stderr, "quern %s: %s\n%s", cmd,
                optind < argc ? "unexpected argument" : "--db is required", usage);
        return 0;
    }
    return 1;
}

/* A job still being submitted: its items so far, and zero in every other count. */
static void submitting_counts(struct queue_counts *c)
{
    int64_t total = c->total;
    memset(c, 0, sizeof(*c));
    c->total = total;
}

static cJSON *job_status(struct queue *q, const struct queue_job *j, struct err_detail *err)
{
    struct queue_counts c;
    int64_t first, last;
    if (queue_job_counts(q, j->id, &c, err) || queue_job_timing(q, j->id, &first, &last, err))
        return NULL;
    if (!j->ready) {
        submitting_counts(&c);
        first = last = 0;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", (double)j->id);
    cJSON_AddStringToObject(o, "name", j->name);
    cJSON_AddStringToObject(o, "state", j->ready ? queue_job_state_str(j->state) : "submitting");
    cJSON_AddBoolToObject(o, "ready", j->ready);
    cJSON_AddStringToObject(o, "model", j->model_path);
    cJSON_AddNumberToObject(o, "items", (double)c.total);
    cJSON *st = cJSON_AddObjectToObject(o, "by_state");
    for (int s = 0; s < QUEUE_ITEM_STATE_COUNT; s++)
        cJSON_AddNumberToObject(st, queue_item_state_str((enum queue_item_state)s),
                                (double)c.items[s]);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)c.prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)c.completion_tokens);
    double secs = first && last > first ? (double)(last - first) / 1000.0 : 0;
    int64_t fin = c.items[QUEUE_ITEM_DONE] + c.items[QUEUE_ITEM_FAILED];
    int64_t left = c.items[QUEUE_ITEM_QUEUED] + c.items[QUEUE_ITEM_LEASED];
    cJSON_AddNumberToObject(o, "run_seconds", secs);
    cJSON_AddNumberToObject(o, "completion_tok_s", secs > 0 ? (double)c.completion_tokens / secs : 0);
    cJSON_AddNumberToObject(o, "items_s", secs > 0 ? (double)fin / secs : 0);
    if (secs > 0 && fin > 0 && left > 0)
        cJSON_AddNumberToObject(o, "eta_s", (double)left / ((double)fin / secs));
    else
        cJSON_AddNullToObject(o, "eta_s");
    cJSON *errs = cJSON_AddObjectToObject(o, "errors");
    for (size_t i = 0; i < c.n_error_codes; i++)
        cJSON_AddNumberToObject(errs, c.errors[i].code[0] ? c.errors[i].code : "unknown",
                                (double)c.errors[i].count);
    return o;
}

/* Field key of o as a string or a number; "?" and 0 when it is missing or of another type, so
 * that the printer never assumes what job_status put in. */
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

static void print_status_text(const cJSON *o)
{
    printf("job %.0f '%s' [%s] model %s\n", jnum(o, "id"), jstr(o, "name"), jstr(o, "state"),
           jstr(o, "model"));
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
           "%.0f s of runs",
           jnum(o, "prompt_tokens"), jnum(o, "completion_tokens"), jnum(o, "completion_tok_s"),
           jnum(o, "items_s"), jnum(o, "run_seconds"));
    const cJSON *eta = cJSON_GetObjectItem(o, "eta_s");
    if (cJSON_IsNumber(eta))
        printf("; ETA %.0f s", eta->valuedouble);
    putchar('\n');
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

/* A done job whose output directory has no current manifest (its last write failed, or the
 * run was killed right after the last commit) gets one here, when no shard is open. */
static void seal_manifest(struct queue *q, const struct queue_job *j)
{
    char dir[4096];
    struct err_detail err = {0};
    struct queue_shard *sh = NULL;
    size_t n = 0;
    struct stat sb;
    if (!j->ready || j->state != QUEUE_JOB_DONE || queue_shard_list(q, j->id, &sh, &n, &err))
        return;
    int open = 0;
    for (size_t i = 0; i < n; i++)
        open += sh[i].state == QUEUE_SHARD_OPEN;
    queue_shard_list_free(sh, n);
    if (open || runner_job_dir(q, j, NULL, 0, dir, sizeof(dir), &err) || stat(dir, &sb) ||
        runner_manifest_current(q, j, dir))
        return;
    if (runner_outdir_claim(q, j, dir, &err) || runner_manifest_write(q, j, dir, 1, &err))
        LOG_WARN("job %s: writing its missing manifest: %s", j->name, err.msg);
    else
        LOG_INFO("job %s: manifest.json was missing or stale; written", j->name);
}

int runner_cmd_status(int argc, char **argv)
{
    struct jobs_opts o;
    if (!parse_jobs("status", status_usage, argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    struct err_detail err = {0};
    struct queue *q;
    /* no quick_check: status is polled, and a damaged page it reads is still an error */
    struct queue_options qo = {.must_exist = true};
    if (queue_open_opts(&q, o.db, &qo, &err)) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    /* killed submits leave jobs that are not ready: delete them before showing any */
    struct proc_identity self;
    proc_identity_self(&self);
    if (queue_jobs_gc(q, &self, QUEUE_DEFAULT_SUBMIT_STALE_MS, NULL, &err))
        LOG_WARN("deleting the jobs of dead submits: %s", err.msg);
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
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; i < n; i++) {
        seal_manifest(q, &jobs[i]);
        cJSON *js = job_status(q, &jobs[i], &err);
        if (!js) {
            cJSON_Delete(arr);
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
    cJSON_Delete(arr);
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
    if (!o.job || (retry && !o.failed)) {
        fprintf(stderr, "quern %s: --job%s required\n%s", cmd, retry ? " and --failed are" : " is",
                usage);
        return RUNNER_EXIT_USAGE;
    }
    struct err_detail err = {0};
    struct queue *q = NULL;
    struct queue_job j = {0};
    int64_t n = 0;
    int rc = RUNNER_EXIT_ERROR;
    /* these write: check the whole file first rather than change a damaged one */
    struct queue_options qo = {.must_exist = true, .check_integrity = true};
    if (queue_open_opts(&q, o.db, &qo, &err) || queue_job_find(q, o.job, &j, &err) ||
        (retry ? queue_job_retry_failed(q, j.id, &n, &err) : queue_job_cancel(q, j.id, &n, &err)))
        LOG_ERROR("%s", err.msg);
    else {
        fprintf(stderr, "quern %s: job %lld '%s': %lld items %s\n", cmd, (long long)j.id, j.name,
                (long long)n, retry ? "queued again" : "cancelled");
        rc = RUNNER_EXIT_OK;
    }
    queue_job_free(&j);
    queue_close(q);
    return rc;
}

int runner_cmd_cancel(int argc, char **argv) { return steer("cancel", cancel_usage, argc, argv, 0); }

int runner_cmd_retry(int argc, char **argv) { return steer("retry", retry_usage, argc, argv, 1); }
