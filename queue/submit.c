/* Jobs written by a submit in bounded transactions: publishing a finished one, and deleting the
 * job of a submit that gave up (queue_job_discard) or died (queue_jobs_gc). The rules are in
 * queue/queue.h, "Jobs being submitted". */
#include "queue/queue_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define DISCARD_BATCH 10000 /* items deleted per transaction by queue_job_discard */
#define GC_BATCH      64    /* candidate jobs looked at per transaction (QS_GC_CANDIDATES) */

/* What QS_JOB_SUBMIT_INFO says about a job. */
struct submit_info {
    bool ready;     /* jobs.ready */
    int64_t run;    /* jobs.submit_run, 0 if none */
    bool run_ended; /* the submit run has ended, or there is none */
};

static enum status submit_info_get(struct queue *q, int64_t job_id, struct submit_info *si,
                                   struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_SUBMIT_INFO, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    int rc = sqlite3_step(s);
    enum status st = ST_OK;
    if (rc == SQLITE_ROW) {
        si->ready = sqlite3_column_int(s, 0) != 0;
        si->run = sqlite3_column_int64(s, 1);
        si->run_ended = sqlite3_column_int(s, 2) != 0;
    } else if (rc == SQLITE_DONE) {
        st = err_set(err, ST_ERR_NOT_FOUND, "no job with id %lld", (long long)job_id);
    } else {
        st = queue_sql_err(q, rc, "reading a job's submit", err);
    }
    queue_stmt_done(s);
    return st;
}

enum status queue_job_publish(struct queue *q, int64_t job_id, const char *summary_json,
                              struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    struct submit_info si;
    st = submit_info_get(q, job_id, &si, err);
    if (st == ST_OK && si.ready)
        st = err_set(err, ST_ERR_INVALID_ARG, "job %lld is ready already", (long long)job_id);
    else if (st == ST_OK && si.run_ended)
        st = err_set(err, ST_ERR_CONFLICT,
                     "job %lld: its submit run %lld has ended (taken for dead); the job will "
                     "be deleted",
                     (long long)job_id, (long long)si.run);
    if (st == ST_OK)
        st = queue_run_changes(q, QS_JOB_PUBLISH, job_id, 0, NULL, "publishing a job", err);
    if (st == ST_OK)
        st = queue_job_finish_empty(q, job_id, err);
    if (st == ST_OK)
        st = queue_run_mark_ended(q, si.run, "submitted", summary_json, err);
    return queue_scope_leave(q, &sc, st, err);
}

enum status queue_job_finish_empty(struct queue *q, int64_t job_id, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    return queue_run_changes(q, QS_JOB_PUBLISH_EMPTY, job_id, queue_now(q), NULL,
                             "finishing a job without items", err);
}

enum status queue_job_discard(struct queue *q, int64_t job_id, const char *exit_reason,
                              int64_t *n_items, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_items)
        *n_items = 0;
    /* first condemn it: with its submit run ended it can never be published */
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    struct submit_info si;
    st = submit_info_get(q, job_id, &si, err);
    if (st == ST_OK && si.ready)
        st = err_set(err, ST_ERR_INVALID_ARG,
                     "job %lld is ready: only a job being submitted "
                     "can be discarded",
                     (long long)job_id);
    if (st == ST_OK && !si.run_ended)
        st = queue_run_mark_ended(q, si.run, exit_reason, NULL, err);
    if ((st = queue_scope_leave(q, &sc, st, err)) != ST_OK)
        return st;
    /* then its items in bounded transactions, the last of them with the job itself */
    int64_t total = 0, changes = DISCARD_BATCH;
    while (st == ST_OK && changes == DISCARD_BATCH) {
        if ((st = queue_scope_enter(q, &sc, err)) != ST_OK)
            break;
        st = queue_run_changes(q, QS_ITEM_DELETE_BATCH, job_id, DISCARD_BATCH, &changes,
                               "deleting a discarded job's items", err);
        st = queue_scope_leave(q, &sc, st, err);
        if (st == ST_OK)
            total += changes;
    }
    if (st == ST_OK && (st = queue_scope_enter(q, &sc, err)) == ST_OK) {
        st = queue_run_changes(q, QS_ITEM_DELETE_BATCH, job_id, -1, &changes,
                               "deleting a discarded job's items", err);
        if (st == ST_OK) {
            total += changes;
            st = queue_run_changes(q, QS_JOB_DELETE, job_id, 0, NULL, "deleting a discarded job",
                                   err);
        }
        st = queue_scope_leave(q, &sc, st, err);
    }
    if (st == ST_OK && n_items)
        *n_items = total;
    return st;
}

/* One candidate row of QS_GC_CANDIDATES. */
struct gc_candidate {
    int64_t job;                /* the not-ready job */
    int64_t run;                /* its submit run, 0 if none */
    bool run_ended;             /* the run has ended (or there is none) */
    struct proc_identity other; /* the run's process, for a stale heartbeat */
};

/* Read up to GC_BATCH candidates with job id > after into c[]; *n gets how many. */
static enum status gc_candidates(struct queue *q, int64_t stale_before, int64_t after,
                                 struct gc_candidate *c, size_t *n, struct err_detail *err)
{
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_GC_CANDIDATES, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, stale_before);
    sqlite3_bind_int64(s, 2, after);
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW && *n < GC_BATCH) {
        struct gc_candidate *g = &c[(*n)++];
        memset(g, 0, sizeof(*g));
        g->job = sqlite3_column_int64(s, 0);
        g->run = sqlite3_column_int64(s, 1);
        g->run_ended = sqlite3_column_int(s, 2) != 0;
        const unsigned char *t;
        if ((t = sqlite3_column_text(s, 3)))
            snprintf(g->other.host, sizeof(g->other.host), "%s", (const char *)t);
        if ((t = sqlite3_column_text(s, 4)))
            snprintf(g->other.boot_id, sizeof(g->other.boot_id), "%s", (const char *)t);
        if ((t = sqlite3_column_text(s, 5)))
            snprintf(g->other.pid_ns, sizeof(g->other.pid_ns), "%s", (const char *)t);
        g->other.pid = sqlite3_column_int64(s, 6);
        g->other.start_ticks = sqlite3_column_int64(s, 7);
    }
    enum status st = ST_OK;
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "looking for jobs of dead submits", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_jobs_gc(struct queue *q, const struct proc_identity *self, int64_t stale_ms,
                          int64_t *n_deleted, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_deleted)
        *n_deleted = 0;
    enum status st = self ? queue_reap_dead(q, self, NULL, err) : ST_OK;
    int64_t stale_before = stale_ms > 0 ? queue_now(q) - stale_ms : INT64_MIN;
    int64_t after = 0, deleted = 0;
    bool more = true;
    while (st == ST_OK && more) {
        /* condemn a batch in one transaction (end the runs found dead), then discard each */
        struct gc_candidate cand[GC_BATCH];
        int64_t doomed[GC_BATCH];
        size_t n = 0, n_doomed = 0;
        struct queue_scope sc;
        if ((st = queue_scope_enter(q, &sc, err)) != ST_OK)
            break;
        st = gc_candidates(q, stale_before, after, cand, &n, err);
        for (size_t i = 0; st == ST_OK && i < n; i++) {
            after = cand[i].job;
            if (!cand[i].run_ended) { /* stale heartbeat: dead unless we can see it alive */
                if (self && proc_liveness(self, &cand[i].other) == PROC_ALIVE)
                    continue;
                st = queue_run_mark_ended(q, cand[i].run, "dead", NULL, err);
            }
            doomed[n_doomed++] = cand[i].job;
        }
        st = queue_scope_leave(q, &sc, st, err);
        more = n == GC_BATCH;
        for (size_t i = 0; st == ST_OK && i < n_doomed; i++) {
            st = queue_job_discard(q, doomed[i], "dead", NULL, err);
            if (st == ST_ERR_NOT_FOUND) /* another process collected it first */
                st = ST_OK;
            else if (st == ST_OK)
                deleted++;
        }
    }
    if (st == ST_OK && n_deleted)
        *n_deleted = deleted;
    return st;
}
