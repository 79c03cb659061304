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
        "coalesce(completion_tokens, 0), coalesce(ttft_ms, -1), coalesce(tpot_ms, -1), attempts "
        "FROM items WHERE job_id = ?1 ORDER BY id"; /* ids: the order submit read the lines in */
    static const char sql_finished[] =
        "SELECT id, custom_id, source, line_no, state, shard_id, error_code, error_msg, "
        "coalesce(shard_record, -1), NULL, coalesce(prompt_tokens, 0), "
        "coalesce(completion_tokens, 0), coalesce(ttft_ms, -1), coalesce(tpot_ms, -1), attempts "
        "FROM items WHERE job_id = ?1 AND state IN ('done', 'failed') ORDER BY id";
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

enum status queue_job_timing(struct queue *q, int64_t job_id, int64_t *first_ms, int64_t *last_ms,
                             struct err_detail *err)
{
    /* A run started with --job worked on the job from its start to its end (or last heartbeat).
     * A run without one works on its jobs one after another and records a sample of each every
     * few seconds and when its work on the job ends: its work on this job began when its last
     * sample of another job before then was taken (its start, if none), and ended at its last
     * sample of this job, or is still going on (its heartbeat) if it is live and has recorded
     * nothing since. Runs without a sample of the job did not work on it. */
    static const char sql[] =
        "WITH js AS (SELECT run_id, min(t) AS t0, max(t) AS t1 FROM samples WHERE job_id = ?1"
        " GROUP BY run_id)"
        " SELECT coalesce(min(s), 0), coalesce(max(e), 0) FROM ("
        "  SELECT started AS s, coalesce(ended, heartbeat) AS e FROM runs"
        "   WHERE kind = 'run' AND job_id = ?1"
        "  UNION ALL"
        "  SELECT max(r.started, coalesce((SELECT max(o.t) FROM samples o WHERE o.run_id = r.id"
        "    AND o.t <= js.t0 AND o.job_id <> ?1), 0)) AS s,"
        "   CASE WHEN r.ended IS NULL AND NOT EXISTS (SELECT 1 FROM samples o"
        "    WHERE o.run_id = r.id AND o.t > js.t1) THEN max(js.t1, r.heartbeat)"
        "    ELSE js.t1 END AS e"
        "   FROM js JOIN runs r ON r.id = js.run_id"
        "   WHERE r.kind = 'run' AND (r.job_id IS NULL OR r.job_id = 0))";
    static const char sql_all[] = /* any job: every run */
        "SELECT coalesce(min(started), 0), coalesce(max(coalesce(ended, heartbeat)), 0) FROM runs"
        " WHERE kind = 'run'";
    sqlite3_stmt *s = NULL;
    int rc = sqlite3_prepare_v2(q->db, job_id ? sql : sql_all, -1, &s, NULL);
    if (rc != SQLITE_OK)
        return queue_sql_err(q, rc, "preparing the run timing query", err);
    sqlite3_bind_int64(s, 1, job_id);
    *first_ms = *last_ms = 0;
    enum status st = ST_OK;
    if ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        *first_ms = sqlite3_column_int64(s, 0);
        *last_ms = sqlite3_column_int64(s, 1);
    } else {
        st = queue_sql_err(q, rc, "reading run times", err);
    }
    sqlite3_finalize(s);
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
