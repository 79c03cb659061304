/* Read-only scans over a job's items (for export and status) and the time span of its runs. */
#include <stdio.h>
#include <stdlib.h>

#include "queue/queue_internal.h"

/* queue_item_scan, or with finished_only queue_item_scan_finished: its WHERE walks the
 * (job_id, state) index and sorts only the finished rows (the whole job's rows, payloads
 * included, took 11 s and 1.5 GB of temporary sort for an export of 15k done items of 5M). */
static enum status item_scan(struct queue *q, int64_t job_id, bool finished_only, queue_item_fn fn,
                             void *user, struct err_detail *err)
{
    static const char sql_all[] =
        "SELECT id, custom_id, source, line_no, state, shard_id, error_code, error_msg, "
        "coalesce(shard_record, -1), payload, coalesce(prompt_tokens, 0), "
        "coalesce(completion_tokens, 0), coalesce(ttft_ms, -1), coalesce(tpot_ms, -1), attempts, "
        "error_param FROM items WHERE job_id = ?1 ORDER BY id"; /* ids: the order submit read the
                                                                   lines in */
    static const char sql_finished[] =
        "SELECT id, custom_id, source, line_no, state, shard_id, error_code, error_msg, "
        "coalesce(shard_record, -1), NULL, coalesce(prompt_tokens, 0), "
        "coalesce(completion_tokens, 0), coalesce(ttft_ms, -1), coalesce(tpot_ms, -1), attempts, "
        "error_param FROM items WHERE job_id = ?1 AND state IN ('done', 'failed') ORDER BY id";
    const char *sql = finished_only ? sql_finished : sql_all;
    sqlite3_stmt *s = NULL;
    int rc = sqlite3_prepare_v2(q->db, sql, -1, &s, NULL);
    if (rc != SQLITE_OK)
        return queue_sql_err(q, rc, "preparing the item scan", err);
    sqlite3_bind_int64(s, 1, job_id);
    enum status st = ST_OK;
    while (!st && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        struct queue_item_info it;
        int state;
        it.id = sqlite3_column_int64(s, 0);
        it.custom_id = (const char *)sqlite3_column_text(s, 1);
        it.source = (const char *)sqlite3_column_text(s, 2);
        it.line_no = sqlite3_column_int64(s, 3);
        state = queue_item_state_parse((const char *)sqlite3_column_text(s, 4));
        it.shard_id = sqlite3_column_int64(s, 5);
        it.error_code = (const char *)sqlite3_column_text(s, 6);
        it.error_msg = (const char *)sqlite3_column_text(s, 7);
        it.shard_record = sqlite3_column_int64(s, 8);
        it.payload = (const char *)sqlite3_column_text(s, 9);
        it.prompt_tokens = sqlite3_column_int64(s, 10);
        it.completion_tokens = sqlite3_column_int64(s, 11);
        it.ttft_ms = sqlite3_column_double(s, 12);
        it.tpot_ms = sqlite3_column_double(s, 13);
        it.attempts = sqlite3_column_int(s, 14);
        it.error_param = (const char *)sqlite3_column_text(s, 15);
        if (state < 0) { /* custom_id and payload may be NULL (see queue_item_info) */
            char what[96];
            snprintf(what, sizeof(what), "item %lld has an unknown state", (long long)it.id);
            st = queue_bad_row(q, what, err);
            break;
        }
        it.state = (enum queue_item_state)state;
        st = fn(user, &it);
    }
    if (!st && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "scanning items", err);
    sqlite3_finalize(s);
    return st;
}

enum status queue_item_scan(struct queue *q, int64_t job_id, queue_item_fn fn, void *user,
                            struct err_detail *err)
{
    return item_scan(q, job_id, false, fn, user, err);
}

enum status queue_item_scan_finished(struct queue *q, int64_t job_id, queue_item_fn fn, void *user,
                                     struct err_detail *err)
{
    return item_scan(q, job_id, true, fn, user, err);
}

static int span_cmp(const void *a, const void *b)
{
    const int64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

enum status queue_job_timing(struct queue *q, int64_t job_id, int64_t *first_ms, int64_t *last_ms,
                             int64_t *worked_ms, struct err_detail *err)
{
    /* Each run's span of work on the job. A run started with --job worked on it from its start
     * to its end or last heartbeat. A run without one works on its jobs one after another and
     * records a sample of each every few seconds and when its work on the job ends: its work on
     * this job began when its last sample of another job before then was taken (its start, if
     * none), and ended at its last sample of this job, or, when it recorded nothing of another
     * job after that, at its own end (or last heartbeat: still going on, or killed in the middle
     * of it). Runs without a sample of the job did not work on it. A run found dead stopped at
     * its last heartbeat (older quern recorded the moment another process noticed as its end). */
    static const char sql[] =
        "WITH js AS (SELECT run_id, min(t) AS t0, max(t) AS t1 FROM samples WHERE job_id = ?1"
        " GROUP BY run_id)"
        " SELECT started, CASE WHEN exit_reason = 'dead' THEN heartbeat"
        "  ELSE coalesce(ended, heartbeat) END FROM runs WHERE kind = 'run' AND job_id = ?1"
        " UNION ALL"
        " SELECT max(r.started, coalesce((SELECT max(o.t) FROM samples o WHERE o.run_id = r.id"
        "   AND o.t <= js.t0 AND o.job_id <> ?1), 0)),"
        "  CASE WHEN NOT EXISTS (SELECT 1 FROM samples o WHERE o.run_id = r.id AND o.t > js.t1)"
        "   THEN max(js.t1, CASE WHEN r.exit_reason = 'dead' THEN r.heartbeat"
        "    ELSE coalesce(r.ended, r.heartbeat) END)"
        "   ELSE js.t1 END"
        "  FROM js JOIN runs r ON r.id = js.run_id"
        "  WHERE r.kind = 'run' AND (r.job_id IS NULL OR r.job_id = 0)";
    static const char sql_all[] = /* any job: every run */
        "SELECT started, CASE WHEN exit_reason = 'dead' THEN heartbeat"
        " ELSE coalesce(ended, heartbeat) END FROM runs WHERE kind = 'run'";
    sqlite3_stmt *s = NULL;
    int rc = sqlite3_prepare_v2(q->db, job_id ? sql : sql_all, -1, &s, NULL);
    if (rc != SQLITE_OK)
        return queue_sql_err(q, rc, "preparing the run timing query", err);
    sqlite3_bind_int64(s, 1, job_id);
    *first_ms = *last_ms = 0;
    if (worked_ms)
        *worked_ms = 0;
    enum status st = ST_OK;
    int64_t *span = NULL; /* pairs (start, end) */
    size_t n = 0, cap = 0;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            int64_t *t = realloc(span, sizeof(*span) * 2 * cap);
            if (!t) {
                st = err_set(err, ST_ERR_NOMEM, "out of memory");
                break;
            }
            span = t;
        }
        span[2 * n] = sqlite3_column_int64(s, 0);
        span[2 * n + 1] = sqlite3_column_int64(s, 1);
        if (span[2 * n + 1] < span[2 * n]) /* (a clock stepped back) */
            span[2 * n + 1] = span[2 * n];
        n++;
    }
    if (!st && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "reading run times", err);
    sqlite3_finalize(s);
    if (!st && n) {
        /* first start, last end, and the time covered by at least one run (runs at the same
         * time count once; the time between runs not at all) */
        qsort(span, n, sizeof(*span) * 2, span_cmp);
        int64_t lo = span[0], hi = span[1], covered = 0, last = span[1];
        for (size_t i = 1; i < n; i++) {
            const int64_t a = span[2 * i], b = span[2 * i + 1];
            last = b > last ? b : last;
            if (a > hi) {
                covered += hi - lo;
                lo = a;
                hi = b;
            } else if (b > hi) {
                hi = b;
            }
        }
        covered += hi - lo;
        *first_ms = span[0];
        *last_ms = last;
        if (worked_ms)
            *worked_ms = covered;
    }
    free(span);
    return st;
}

enum status queue_runs_any(struct queue *q, int *any, struct err_detail *err)
{
    sqlite3_stmt *s = NULL;
    int rc = sqlite3_prepare_v2(q->db, "SELECT EXISTS (SELECT 1 FROM runs WHERE kind = 'run')", -1,
                                &s, NULL);
    if (rc != SQLITE_OK)
        return queue_sql_err(q, rc, "preparing the run query", err);
    enum status st = ST_OK;
    if ((rc = sqlite3_step(s)) == SQLITE_ROW)
        *any = sqlite3_column_int(s, 0) != 0;
    else
        st = queue_sql_err(q, rc, "looking for runs", err);
    sqlite3_finalize(s);
    return st;
}
