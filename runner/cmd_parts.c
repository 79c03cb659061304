/* `quern status`, `cancel` and `retry` on a partitioned queue (batch/batch.h, "Partitioned
 * queues"): every part is opened in turn, briefly; a part its run holds is read from the
 * progress file the run keeps beside it, and a cancel for it is left there as a request. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "batch/batch.h"
#include "common/fileid.h"
#include "common/log.h"
#include "jobs/json.h"
#include "queue/queue.h"
#include "runner/runner.h"

#define PARTS_BUSY_MS 200 /* how long status waits for a part before reading its progress file */

/* A number of the JSON object o (0 when missing). */
static double num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Part k as its own queue shows it: runner_job_status of its job, summarised. NULL with err. */
static cJSON *part_from_queue(struct queue *q, int k, struct err_detail *err)
{
    struct queue_job *jobs = NULL;
    size_t n = 0;
    if (queue_job_list(q, &jobs, &n, err))
        return NULL;
    if (n != 1) {
        queue_job_list_free(jobs, n);
        err_set(err, ST_ERR_FORMAT, "part %d holds %zu jobs, not one", k, n);
        return NULL;
    }
    struct queue_run_info *runs = NULL;
    size_t n_runs = 0;
    cJSON *js = NULL;
    if (!queue_run_list_live(q, &runs, &n_runs, err))
        js = runner_job_status(q, &jobs[0], runs, n_runs, err);
    queue_run_info_free(runs, n_runs);
    queue_job_list_free(jobs, n);
    if (!js)
        return NULL;
    const cJSON *bs = cJSON_GetObjectItem(js, "by_state");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "part", k);
    cJSON_AddBoolToObject(o, "in_use", 0);
    cJSON_AddBoolToObject(o, "live", 0); /* (no run holds it: a running one's run died) */
    cJSON *state = cJSON_GetObjectItem(js, "state");
    cJSON_AddStringToObject(o, "state", cJSON_IsString(state) ? state->valuestring : "?");
    cJSON_AddNumberToObject(o, "items", num(js, "items"));
    cJSON_AddNumberToObject(o, "done", num(bs, "done"));
    cJSON_AddNumberToObject(o, "failed", num(bs, "failed"));
    cJSON_AddNumberToObject(o, "cancelled", num(bs, "cancelled"));
    cJSON_AddNumberToObject(o, "unfinished", num(bs, "queued") + num(bs, "leased"));
    cJSON_AddNumberToObject(o, "completion_tokens", num(js, "completion_tokens"));
    cJSON_AddNumberToObject(o, "gen_tok_s", 0);
    cJSON_AddItemToObject(o, "errors", cJSON_DetachItemFromObject(js, "errors"));
    cJSON_AddItemToObject(o, "engines", cJSON_DetachItemFromObject(js, "engines"));
    cJSON_AddItemToObject(o, "series", cJSON_DetachItemFromObject(js, "series"));
    cJSON_Delete(js);
    return o;
}

/* Part k in use by a run: from its progress file (state "running"; "unknown" without one). */
static cJSON *part_from_progress(const struct batch_parts *p, int k)
{
    char path[4200];
    batch_parts_path(p, k, ".progress.json", path, sizeof(path));
    cJSON *pj = batch_json_file(path);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "part", k);
    cJSON_AddBoolToObject(o, "in_use", 1);
    cJSON_AddBoolToObject(o, "live", 1);
    cJSON_AddStringToObject(o, "state", pj ? "running" : "unknown");
    double total = num(pj, "total"), done = num(pj, "done"), failed = num(pj, "failed"),
           cancelled = num(pj, "cancelled");
    cJSON_AddNumberToObject(o, "items", total);
    cJSON_AddNumberToObject(o, "done", done);
    cJSON_AddNumberToObject(o, "failed", failed);
    cJSON_AddNumberToObject(o, "cancelled", cancelled);
    cJSON_AddNumberToObject(o, "unfinished", total - done - failed - cancelled);
    cJSON_AddNumberToObject(o, "completion_tokens", num(pj, "gen_tokens"));
    double age = pj ? (double)(wall_ms() - (int64_t)num(pj, "updated_ms")) / 1000.0 : -1;
    /* a run silent longer than this adds nothing to live rates (as for one queue file) */
    cJSON_AddNumberToObject(o, "gen_tok_s",
                            age >= 0 && age <= BATCH_PROGRESS_STALE_S ? num(pj, "gen_tok_s") : 0);
    const cJSON *host = cJSON_GetObjectItem(pj, "host");
    if (cJSON_IsString(host))
        job_json_add_text(o, "host", host->valuestring);
    if (pj) {
        /* (a run loading the job's model: batch_progress_loading_start) */
        cJSON_AddBoolToObject(o, "loading", cJSON_IsTrue(cJSON_GetObjectItem(pj, "loading")));
        cJSON_AddNumberToObject(o, "pid", num(pj, "pid"));
        cJSON_AddNumberToObject(o, "progress_age_s", age);
    }
    /* the engine of the run that holds it (earlier runs' are in the part, unreadable now) */
    cJSON *eng = cJSON_DetachItemFromObject(pj, "engine"), *engines = cJSON_CreateArray(), *e;
    if (cJSON_IsObject(eng) && engines && (e = cJSON_CreateObject())) {
        cJSON_AddItemToArray(engines, e);
        cJSON_AddItemToObject(e, "engine", eng);
        cJSON *runs = cJSON_AddArrayToObject(e, "runs");
        cJSON_AddItemToArray(runs, cJSON_CreateNumber(num(pj, "run_id")));
        eng = NULL;
    }
    cJSON_Delete(eng);
    cJSON_AddItemToObject(o, "engines", engines);
    cJSON_Delete(pj);
    return o;
}

/* The job's state from its parts'. */
static const char *combined_state(const cJSON *parts)
{
    int n = 0, done = 0, cancelled = 0, started = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, parts)
    {
        const char *s = cJSON_GetObjectItem(e, "state")->valuestring;
        n++;
        done += !strcmp(s, "done");
        cancelled += !strcmp(s, "cancelled");
        started += strcmp(s, "queued") != 0 || num(e, "done") + num(e, "failed") > 0;
    }
    if (cancelled && done + cancelled == n) /* as a single queue's job with cancelled items */
        return "cancelled";
    if (done == n)
        return "done";
    return started ? "running" : "queued";
}

/* The engines of every part's runs (each part's "engines"), one entry per distinct engine:
 * [{"engine": {...}, "parts": [k, ...]}, ...]. */
static cJSON *parts_engines(const cJSON *parts)
{
    cJSON *a = cJSON_CreateArray();
    const cJSON *pe, *e;
    cJSON_ArrayForEach(pe, parts)
    {
        cJSON_ArrayForEach(e, cJSON_GetObjectItem(pe, "engines"))
        {
            if (a && runner_engine_group_add(a, "parts",
                                             cJSON_Duplicate(cJSON_GetObjectItem(e, "engine"), 1),
                                             num(pe, "part"))) {
                cJSON_Delete(a);
                a = NULL;
            }
        }
    }
    return a;
}

int runner_parts_status(const struct batch_parts *p, const char *job, int json)
{
    if (job && strcmp(job, p->job)) {
        LOG_ERROR("%s holds job '%s', not '%s'", p->dir, p->job, job);
        return RUNNER_EXIT_ERROR;
    }
    cJSON *parts = cJSON_CreateArray();
    double sum[6] = {0, 0, 0, 0, 0, 0}; /* items done failed cancelled unfinished gen_tok_s */
    static const char *const keys[6] = {"items",     "done",       "failed",
                                        "cancelled", "unfinished", "gen_tok_s"};
    int bad = 0;
    for (int k = 0; k < p->n; k++) {
        struct queue *q = NULL;
        struct err_detail err = {0};
        enum status st = batch_parts_open(p, k, PARTS_BUSY_MS, BATCH_PART_READ, &q, &err);
        cJSON *o = NULL;
        if (st == ST_ERR_BUSY)
            o = part_from_progress(p, k);
        else if (!st)
            o = part_from_queue(q, k, &err);
        queue_close(q);
        if (!o) {
            LOG_ERROR("part %d: %s", k, err.msg);
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "part", k);
            cJSON_AddStringToObject(o, "state", "error");
            job_json_add_text(o, "error", err.msg);
            bad = 1;
        }
        for (int i = 0; i < 6; i++)
            sum[i] += num(o, keys[i]);
        cJSON_AddItemToArray(parts, o);
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "name", p->job);
    job_json_add_text(j, "dir", p->dir);
    cJSON_AddNumberToObject(j, "parts", p->n);
    cJSON_AddStringToObject(j, "state", bad ? "error" : combined_state(parts));
    for (int i = 0; i < 6; i++)
        cJSON_AddNumberToObject(j, keys[i], sum[i]);
    cJSON_AddItemToObject(j, "part_status", parts);
    cJSON *engines = parts_engines(parts);
    cJSON_AddItemToObject(j, "engines", engines);
    if (json) {
        cJSON *arr = cJSON_CreateArray();
        cJSON_AddItemToArray(arr, j);
        char *s = cJSON_PrintUnformatted(arr);
        if (s)
            puts(s);
        free(s);
        cJSON_Delete(arr);
        return bad ? RUNNER_EXIT_ERROR : RUNNER_EXIT_OK;
    }
    printf("job %s (%d parts in %s): %s, %.0f/%.0f finished (%.0f failed, %.0f cancelled)", p->job,
           p->n, p->dir, cJSON_GetObjectItem(j, "state")->valuestring, sum[1] + sum[2], sum[0],
           sum[2], sum[3]);
    if (sum[5] > 0)
        printf(", %.1f tok/s live", sum[5]);
    putchar('\n');
    runner_print_engines(engines, "part");
    const cJSON *e;
    cJSON_ArrayForEach(e, parts)
    {
        const cJSON *host = cJSON_GetObjectItem(e, "host");
        printf("  part %4d: %-9s %6.0f/%.0f", (int)num(e, "part"),
               cJSON_GetObjectItem(e, "state")->valuestring, num(e, "done") + num(e, "failed"),
               num(e, "items"));
        if (num(e, "failed") > 0)
            printf(" (%.0f failed)", num(e, "failed"));
        char hn[512];
        if (cJSON_IsString(host))
            log_printable(host->valuestring, hn, sizeof(hn));
        if (cJSON_IsString(host) && cJSON_IsTrue(cJSON_GetObjectItem(e, "loading")))
            printf("  in use by pid %.0f on %s, loading the model, updated %.0f s ago",
                   num(e, "pid"), hn, num(e, "progress_age_s"));
        else if (cJSON_IsString(host))
            printf("  in use by pid %.0f on %s, %.1f tok/s, updated %.0f s ago", num(e, "pid"), hn,
                   num(e, "gen_tok_s"), num(e, "progress_age_s"));
        else if (cJSON_IsTrue(cJSON_GetObjectItem(e, "in_use")))
            printf("  in use (no progress yet)");
        else if (!strcmp(cJSON_GetObjectItem(e, "state")->valuestring, "running"))
            printf("  no live run (its run stopped or died: `quern run --part %d` goes on)",
                   (int)num(e, "part"));
        putchar('\n');
    }
    cJSON_Delete(j);
    return bad ? RUNNER_EXIT_ERROR : RUNNER_EXIT_OK;
}

#define PART_ALIVE_WAIT_S 5.0 /* how long a part's progress file may stay unchanged */

/* The version of the file at path as of now: open() revalidates a network file system's
 * cached attributes (close-to-open consistency), which stat() of a path may not. */
static int open_file_version(const char *path, struct file_version *v)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat sb;
    int rc = fstat(fd, &sb);
    close(fd);
    if (!rc)
        file_version_of(&sb, v);
    return rc;
}

/* Does a run report from part k? Its run replaces part-NNNN.progress.json about every second
 * (batch/progress.c): alive when the file changes within PART_ALIVE_WAIT_S. No clocks are
 * compared (the file server's may differ from this host's), and a file that is merely recent
 * is not enough: a run that just ended (exit 75, requeued) leaves one, while a reader (status,
 * export) holds the lock. Unsure means 0 (a run's task comes back, 75, rather than leave a
 * part that no run finishes; a cancel waits for the lock instead). */
int runner_part_run_alive(const struct batch_parts *p, int k, const volatile sig_atomic_t *stop)
{
    char path[4200];
    batch_parts_path(p, k, ".progress.json", path, sizeof(path));
    struct file_version a, b;
    if (open_file_version(path, &a))
        return 0;
    for (double t0 = runner_now(); runner_now() - t0 < PART_ALIVE_WAIT_S && !*stop;) {
        usleep(200000);
        if (open_file_version(path, &b))
            continue; /* (replaced by rename: the name is never missing, but be lenient) */
        if (!file_version_same(&a, &b))
            return 1;
    }
    return 0;
}

/* A part cancelled while free (its lock held here), or done before (one that got no line): its
 * manifest written now, complete (empty when it never had output), and the job's combined
 * manifest with it, rather than at the next run of that part. Not while a shard is open: a dead
 * run's shard is recovered by a run. */
static enum status seal_finished(struct queue *q, int64_t job_id, struct err_detail *err)
{
    struct queue_job j = {0};
    int64_t open = 0;
    char dir[4096];
    enum status st = queue_job_get(q, job_id, &j, err);
    if (!st && (j.state == QUEUE_JOB_CANCELLED || j.state == QUEUE_JOB_DONE) &&
        !(st = batch_count_open_shards(q, job_id, &open, err)) && !open &&
        !(st = batch_job_dir(q, &j, NULL, 1, dir, sizeof(dir), err)) &&
        !batch_manifest_current(q, &j, dir))
        st = batch_manifest_write(q, &j, dir, err);
    queue_job_free(&j);
    return st;
}

#define PART_READER_WAIT_MS 30000 /* how long a cancel waits for a reader's lock on a part */

int runner_parts_steer(const struct batch_parts *p, const char *cmd, const char *job, int retry)
{
    if (job && strcmp(job, p->job)) {
        LOG_ERROR("%s holds job '%s', not '%s'", p->dir, p->job, job);
        return RUNNER_EXIT_ERROR;
    }
    int rc = RUNNER_EXIT_OK;
    int64_t total = 0;
    int requested = 0;
    for (int k = 0; k < p->n; k++) {
        struct queue *q = NULL;
        struct err_detail err = {0};
        struct queue_job *jobs = NULL;
        size_t n = 0;
        int64_t moved = 0;
        enum status st = batch_parts_open(p, k, 500, BATCH_PART_CHECK, &q, &err);
        if (st == ST_ERR_BUSY && !retry) {
            /* its run acts on the request within about a second (batch/progress.c) */
            char path[4200];
            batch_parts_path(p, k, ".cancel", path, sizeof(path));
            int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
            if (fd < 0) {
                LOG_ERROR("part %d is in use and %s cannot be created: %s", k, path,
                          strerror(errno));
                rc = RUNNER_EXIT_ERROR;
                continue;
            }
            close(fd);
            static const volatile sig_atomic_t never;
            if (runner_part_run_alive(p, k, &never)) {
                requested++;
                fprintf(stderr, "quern cancel: part %d is in use: its run cancels it (%s)\n", k,
                        path);
                continue;
            }
            /* held, but no run reports from it: a reader (status, export, report), whose lock
             * goes soon; the request stays for a run that starts meanwhile */
            st = batch_parts_open(p, k, PART_READER_WAIT_MS, BATCH_PART_CHECK, &q, &err);
            if (st == ST_ERR_BUSY) {
                LOG_ERROR("part %d is locked by another process and no run reports from it: "
                          "cancel again later (its next run cancels it: %s)",
                          k, path);
                rc = RUNNER_EXIT_ERROR;
                continue;
            }
            if (!st)
                unlink(path); /* (cancelled here) */
        }
        if (st == ST_ERR_BUSY) {
            LOG_ERROR("part %d is in use by a run: retry it when that run has ended", k);
            rc = RUNNER_EXIT_ERROR;
            continue;
        }
        if (!st && retry) {
            /* retried items are wanted: a cancel request left earlier must not act on them,
             * and goes before they are queued (a retry killed in between leaves none) */
            char path[4200];
            batch_parts_path(p, k, ".cancel", path, sizeof(path));
            unlink(path);
        }
        if (!st && !(st = queue_job_list(q, &jobs, &n, &err)))
            for (size_t i = 0; !st && i < n; i++) {
                int64_t m = 0; /* each job's count, summed (also on an error) */
                st = retry ? queue_job_retry_failed(q, jobs[i].id, &m, &err)
                           : queue_job_cancel(q, jobs[i].id, &m, &err);
                moved += m;
                if (!st && !retry)
                    st = seal_finished(q, jobs[i].id, &err);
            }
        queue_job_list_free(jobs, n);
        queue_close(q);
        total += moved; /* (also on an error: the transactions before it stand) */
        if (st) {
            LOG_ERROR("part %d: %s%s", k, err.msg,
                      moved ? "; the items done before the error stand: run it again" : "");
            rc = RUNNER_EXIT_ERROR;
            continue;
        }
    }
    fprintf(stderr, "quern %s: job '%s' (%d parts): %lld items %s", cmd, p->job, p->n,
            (long long)total, retry ? "queued again" : "cancelled");
    if (requested)
        fprintf(stderr, "; %d part(s) in use cancel when their run sees the request", requested);
    fputc('\n', stderr);
    return rc;
}
