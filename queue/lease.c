/* Items and their leases: adding items to a job, claiming queued items for a run, heartbeats,
 * graceful release and the expiry sweep. Finishing items is queue_commit_shard (shards.c). */
#include "queue/queue_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Insert it into job_id (QS_ITEM_INSERT, a rejected line when it has an error_code). */
static enum status insert_item(struct queue *q, int64_t job_id, const struct queue_item_spec *it,
                               struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_ITEM_INSERT, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    queue_bind_str(s, 2, it->custom_id);
    queue_bind_str(s, 3, it->source);
    if (it->line_no > 0)
        sqlite3_bind_int64(s, 4, it->line_no);
    queue_bind_str(s, 5, it->payload);
    queue_bind_str(s, 6, queue_item_state_str(QUEUE_ITEM_QUEUED));
    sqlite3_bind_int(s, 7, it->priority);
    sqlite3_bind_int(s, 8, it->max_attempts ? it->max_attempts : QUEUE_DEFAULT_MAX_ATTEMPTS);
    queue_bind_str(s, 9, it->error_code);
    queue_bind_str(s, 10, it->error_msg);
    queue_bind_str(s, 12, it->error_param);
    return queue_step_done(q, s, "adding an item", err);
}

/* A line rejected at submit that holds custom_id (read from its broken text) gives it up to a
 * valid line (its record then names none): 1 when one did. */
static enum status yield_rejected_id(struct queue *q, int64_t job_id, const char *custom_id,
                                     int *yielded, struct err_detail *err)
{
    *yielded = 0;
    sqlite3_stmt *y = queue_stmt(q, QS_ITEM_YIELD_ID, err);
    if (!y)
        return err->status;
    sqlite3_bind_int64(y, 1, job_id);
    queue_bind_str(y, 2, custom_id);
    enum status st = queue_step_done(q, y, "freeing a custom_id", err);
    if (!st)
        *yielded = sqlite3_changes(q->db) == 1;
    return st;
}

enum status queue_item_add(struct queue *q, int64_t job_id, const struct queue_item_spec *it,
                           int64_t *item_id, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (item_id)
        *item_id = 0;
    bool rejected = it->error_code != NULL;
    if (!rejected && (!it->custom_id || !it->payload))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "a queued item needs a custom_id and a payload (line %lld)",
                       (long long)it->line_no);
    if (it->max_attempts < 0)
        return err_set(err, ST_ERR_INVALID_ARG, "max_attempts %d < 0", (int)it->max_attempts);

    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    st = insert_item(q, job_id, it, err);
    int yielded = 0;
    if (st == ST_ERR_EXISTS && !rejected) {
        enum status ys = yield_rejected_id(q, job_id, it->custom_id, &yielded, err);
        if (ys)
            st = ys;
        else if (yielded)
            st = insert_item(q, job_id, it, err);
    }
    if (st == ST_ERR_EXISTS)
        err_set(err, ST_ERR_EXISTS, "custom_id \"%.200s\" is already used in job %lld",
                it->custom_id ? it->custom_id : "", (long long)job_id);
    if (st == ST_OK && sqlite3_changes(q->db) == 0) {
        /* the INSERT ... SELECT found no live job: say which way */
        enum queue_job_state js;
        st = queue_job_state_get(q, job_id, &js, err);
        if (st == ST_OK)
            st = err_set(err, ST_ERR_INVALID_ARG, "job %lld is cancelled; cannot add items",
                         (long long)job_id);
    }
    int64_t id = st == ST_OK ? sqlite3_last_insert_rowid(q->db) : 0;
    sqlite3_stmt *s = NULL;
    if (st == ST_OK && (s = queue_stmt(q, QS_JOB_ADD_ITEM, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, job_id);
        sqlite3_bind_int(s, 2, 1);
        st = queue_step_done(q, s, "counting the job's items", err);
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && item_id)
        *item_id = id;
    return st;
}

void queue_claimed_free(struct queue_claimed *items, size_t n)
{
    if (!items)
        return;
    for (size_t i = 0; i < n; i++) {
        free(items[i].custom_id);
        free(items[i].payload);
        free(items[i].error_code);
        free(items[i].error_msg);
        free(items[i].error_param);
        free(items[i].source);
    }
    free(items);
}

/* Claim order: priority descending, then id ascending. */
static int claimed_cmp(const void *a, const void *b)
{
    const struct queue_claimed *x = a, *y = b;
    if (x->priority != y->priority)
        return x->priority > y->priority ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Step the claim statement and collect its RETURNING rows into a growing array. */
static enum status collect_claimed(struct queue *q, sqlite3_stmt *s, struct queue_claimed **out,
                                   size_t *n_out, struct err_detail *err)
{
    struct queue_claimed *arr = NULL;
    size_t n = 0, cap = 0;
    enum status st = ST_OK;
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 64;
            struct queue_claimed *t = realloc(arr, ncap * sizeof(*arr));
            if (!t) {
                st = err_set(err, ST_ERR_NOMEM, "queue: out of memory claiming items");
                break;
            }
            arr = t;
            cap = ncap;
        }
        struct queue_claimed *c = &arr[n];
        memset(c, 0, sizeof(*c));
        c->id = sqlite3_column_int64(s, 0);
        c->job_id = sqlite3_column_int64(s, 1);
        c->priority = sqlite3_column_int(s, 4);
        c->attempts = sqlite3_column_int(s, 5);
        c->max_attempts = sqlite3_column_int(s, 6);
        c->line_no = sqlite3_column_int64(s, 10);
        n++;
        st = queue_col_dup(s, 2, &c->custom_id, err);
        if (st == ST_OK)
            st = queue_col_dup(s, 3, &c->payload, err);
        if (st == ST_OK)
            st = queue_col_dup(s, 7, &c->error_code, err);
        if (st == ST_OK)
            st = queue_col_dup(s, 8, &c->error_msg, err);
        if (st == ST_OK)
            st = queue_col_dup(s, 9, &c->source, err);
        if (st == ST_OK)
            st = queue_col_dup(s, 11, &c->error_param, err);
        if (st != ST_OK)
            break;
    }
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "claiming items", err);
    queue_stmt_done(s);
    if (st != ST_OK) {
        queue_claimed_free(arr, n);
        return st;
    }
    *out = arr;
    *n_out = n;
    return ST_OK;
}

enum status queue_claim(struct queue *q, int64_t job_id, int64_t run_id, int max_items,
                        int64_t lease_ms, struct queue_claimed **items, size_t *n,
                        struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *items = NULL;
    *n = 0;
    if (max_items <= 0 || lease_ms <= 0)
        return err_set(err, ST_ERR_INVALID_ARG, "claim: max_items %d and lease_ms %lld must be > 0",
                       max_items, (long long)lease_ms);
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t now = queue_now(q);
    struct queue_claimed *arr = NULL;
    size_t len = 0;
    st = queue_run_check(q, run_id, err);
    if (st == ST_OK)
        st = queue_run_changes(q, QS_LEASE_EXPIRE, now, run_id, NULL, "requeueing expired leases",
                               err);
    sqlite3_stmt *s = NULL;
    if (st == ST_OK && (s = queue_stmt(q, job_id ? QS_CLAIM_JOB : QS_CLAIM_ANY, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, run_id);
        sqlite3_bind_int64(s, 2, now + lease_ms);
        if (job_id)
            sqlite3_bind_int64(s, 3, job_id);
        sqlite3_bind_int(s, 4, max_items);
        st = collect_claimed(q, s, &arr, &len, err);
    }
    if (st == ST_OK && len > 1)
        qsort(arr, len, sizeof(*arr), claimed_cmp);
    /* first claim of a job: queued -> running; once per distinct job in the batch */
    for (size_t i = 0; st == ST_OK && i < len; i++) {
        bool seen = false;
        for (size_t k = 0; k < i && !seen; k++)
            seen = arr[k].job_id == arr[i].job_id;
        if (!seen)
            st = queue_run_changes(q, QS_JOB_START, arr[i].job_id, 0, NULL, "starting a job", err);
    }
    if (st == ST_OK && len == 0)
        st = queue_jobs_finish(q, job_id, err);
    st = queue_scope_leave(q, &sc, st, err);
    if (st != ST_OK) {
        queue_claimed_free(arr, len);
        return st;
    }
    *items = arr;
    *n = len;
    return ST_OK;
}

enum status queue_lease_extend(struct queue *q, int64_t run_id, int64_t lease_ms, int64_t *n_held,
                               struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_held)
        *n_held = 0;
    if (lease_ms <= 0)
        return err_set(err, ST_ERR_INVALID_ARG, "lease_ms %lld must be > 0", (long long)lease_ms);
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t now = queue_now(q), held = 0, beat = 0;
    st = queue_run_changes(q, QS_RUN_HEARTBEAT, run_id, now, &beat, "heartbeat", err);
    if (st == ST_OK && beat == 0)
        st = queue_run_check(q, run_id, err); /* says why: missing or ended */
    if (st == ST_OK)
        st = queue_run_changes(q, QS_LEASE_EXTEND, run_id, now + lease_ms, &held,
                               "extending leases", err);
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_held)
        *n_held = held;
    return st;
}

enum status queue_lease_list(struct queue *q, int64_t run_id, int64_t **ids, size_t *n,
                             struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *ids = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_LEASE_LIST, err); /* one SELECT: a read, no write scope */
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    enum status st = ST_OK;
    int64_t *v = NULL;
    size_t k = 0, cap = 0;
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (k == cap) {
            int64_t *nv = realloc(v, sizeof(*v) * (cap = cap ? cap * 2 : 256));
            if (!nv) {
                st = err_set(err, ST_ERR_NOMEM, "out of memory");
                break;
            }
            v = nv;
        }
        v[k++] = sqlite3_column_int64(s, 0);
    }
    queue_stmt_done(s);
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "listing leases", err);
    if (st != ST_OK) {
        free(v);
        return st;
    }
    *ids = v;
    *n = k;
    return ST_OK;
}

enum status queue_release(struct queue *q, int64_t run_id, const int64_t *ids, size_t n,
                          int64_t *n_released, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_released)
        *n_released = 0;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t total = 0, c = 0;
    if (!ids) {
        st = queue_run_changes(q, QS_RELEASE_ALL, run_id, 0, &total, "releasing leases", err);
    } else {
        for (size_t i = 0; st == ST_OK && i < n; i++) {
            st = queue_run_changes(q, QS_RELEASE_ONE, run_id, ids[i], &c, "releasing a lease", err);
            total += c;
        }
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_released)
        *n_released = total;
    return st;
}

enum status queue_mark_started(struct queue *q, int64_t run_id, const int64_t *ids, size_t n,
                               int started, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (!n)
        return ST_OK;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    for (size_t i = 0; st == ST_OK && i < n; i++) {
        sqlite3_stmt *s = queue_stmt(q, QS_ITEM_STARTED, err);
        if (!s) {
            st = err->status;
            break;
        }
        sqlite3_bind_int64(s, 1, run_id);
        sqlite3_bind_int64(s, 2, ids[i]);
        sqlite3_bind_int(s, 3, started != 0);
        st = queue_step_done(q, s, "marking items started", err);
    }
    return queue_scope_leave(q, &sc, st, err);
}

enum status queue_lease_expire(struct queue *q, int64_t *n_expired, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_expired)
        *n_expired = 0;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t c = 0;
    st = queue_run_changes(q, QS_LEASE_EXPIRE, queue_now(q), 0, &c, "requeueing expired leases",
                           err);
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_expired)
        *n_expired = c;
    return st;
}
