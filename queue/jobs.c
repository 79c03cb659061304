/* Jobs: create (with name rules), read, find, list, state, finish, cancel, retry of failed
 * items, per-state counts and error counts, and the recorded output directory. */
#include "queue/queue_internal.h"

#include "common/fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- jobs ------------------------------------------------------------------------------ */

enum status queue_job_name_check(const char *name, struct err_detail *err)
{
    if (!name || !*name)
        return err_set(err, ST_ERR_INVALID_ARG, "job name is empty");
    size_t n = strlen(name);
    bool digits = true;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '-';
        if (!ok)
            return err_set(err, ST_ERR_INVALID_ARG,
                           "job name \"%.64s\": only letters, digits, '.', '_' and '-' allowed",
                           name);
        digits = digits && c >= '0' && c <= '9';
    }
    if (n > 128)
        return err_set(err, ST_ERR_INVALID_ARG, "job name is longer than 128 characters");
    if (name[0] == '.')
        return err_set(err, ST_ERR_INVALID_ARG, "job name \"%s\" starts with '.'", name);
    if (digits)
        return err_set(err, ST_ERR_INVALID_ARG, "job name \"%s\" is all digits (ids are)", name);
    return ST_OK;
}

enum status queue_job_create(struct queue *q, const struct queue_job_spec *spec, int64_t *job_id,
                             struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *job_id = 0;
    enum status st = queue_job_name_check(spec->name, err);
    if (st != ST_OK)
        return st;
    if (!spec->model_path || !spec->out_dir)
        return err_set(err, ST_ERR_INVALID_ARG, "job %s: model_path and out_dir are required",
                       spec->name);
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_INSERT, err);
    if (!s)
        return err->status;
    queue_bind_str(s, 1, spec->name);
    sqlite3_bind_int64(s, 2, queue_now(q));
    queue_bind_str(s, 3, spec->model_path);
    queue_bind_str(s, 4, spec->model_sha256);
    queue_bind_str(s, 5, spec->params_json ? spec->params_json : "{}");
    queue_bind_str(s, 6, spec->out_dir);
    sqlite3_bind_int64(s, 7, (int64_t)spec->seed);
    if (spec->submit_run)
        sqlite3_bind_int64(s, 8, spec->submit_run);
    st = queue_step_done(q, s, "creating job", err);
    if (st == ST_ERR_INVALID_ARG && spec->submit_run) /* foreign key: the submit run */
        return err_set(err, ST_ERR_NOT_FOUND, "job %s: no submit run %lld", spec->name,
                       (long long)spec->submit_run);
    if (st == ST_ERR_EXISTS)
        return err_set(err, ST_ERR_EXISTS, "a job named \"%s\" already exists", spec->name);
    if (st == ST_OK)
        *job_id = sqlite3_last_insert_rowid(q->db);
    return st;
}

void queue_job_free(struct queue_job *j)
{
    if (!j)
        return;
    free(j->name);
    free(j->model_path);
    free(j->model_sha256);
    free(j->params_json);
    free(j->out_dir);
    memset(j, 0, sizeof(*j));
}

void queue_job_list_free(struct queue_job *jobs, size_t n)
{
    if (!jobs)
        return;
    for (size_t i = 0; i < n; i++)
        queue_job_free(&jobs[i]);
    free(jobs);
}

/* Fill j from the current row of a JOB_COLS statement. A row that breaks the schema (a NULL
 * where it says NOT NULL, an unknown state) is corruption: ST_ERR_FORMAT, never a half-filled
 * job whose NULL strings a caller would trip on. */
static enum status read_job(struct queue *q, sqlite3_stmt *s, struct queue_job *j,
                            struct err_detail *err)
{
    static const int required[] = {0, 1, 2, 4, 5, 7, 8, 9, 10}; /* NOT NULL in the schema */
    memset(j, 0, sizeof(*j));
    j->id = sqlite3_column_int64(s, 0);
    for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
        if (sqlite3_column_type(s, required[i]) == SQLITE_NULL) {
            char what[96];
            snprintf(what, sizeof(what), "job %lld has no %s", (long long)j->id,
                     sqlite3_column_name(s, required[i]));
            return queue_bad_row(q, what, err);
        }
    }
    int state = queue_job_state_parse((const char *)sqlite3_column_text(s, 4));
    if (state < 0 || j->id <= 0) {
        char what[96];
        snprintf(what, sizeof(what), "job %lld has an unknown state or id", (long long)j->id);
        return queue_bad_row(q, what, err);
    }
    j->state = (enum queue_job_state)state;
    j->created = sqlite3_column_int64(s, 2);
    j->finished = sqlite3_column_int64(s, 3);
    j->seed = (uint64_t)sqlite3_column_int64(s, 9);
    j->n_items = sqlite3_column_int64(s, 10);
    j->ready = sqlite3_column_int(s, 11) != 0;
    j->submit_run = sqlite3_column_int64(s, 12);
    enum status st = queue_col_dup(s, 1, &j->name, err);
    if (st == ST_OK)
        st = queue_col_dup(s, 5, &j->model_path, err);
    if (st == ST_OK)
        st = queue_col_dup(s, 6, &j->model_sha256, err);
    if (st == ST_OK)
        st = queue_col_dup(s, 7, &j->params_json, err);
    if (st == ST_OK)
        st = queue_col_dup(s, 8, &j->out_dir, err);
    if (st != ST_OK)
        queue_job_free(j);
    return st;
}

/* Step a one-row job query into out; ST_ERR_NOT_FOUND when there is no row. */
static enum status job_one(struct queue *q, sqlite3_stmt *s, const char *what,
                           struct queue_job *out, struct err_detail *err)
{
    int rc = sqlite3_step(s);
    enum status st;
    if (rc == SQLITE_ROW)
        st = read_job(q, s, out, err);
    else if (rc == SQLITE_DONE)
        st = err_set(err, ST_ERR_NOT_FOUND, "no job %s", what);
    else
        st = queue_sql_err(q, rc, "reading a job", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_job_get(struct queue *q, int64_t job_id, struct queue_job *out,
                          struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    memset(out, 0, sizeof(*out));
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_GET, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    char what[32];
    snprintf(what, sizeof(what), "with id %lld", (long long)job_id);
    return job_one(q, s, what, out, err);
}

enum status queue_job_find(struct queue *q, const char *id_or_name, struct queue_job *out,
                           struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    memset(out, 0, sizeof(*out));
    if (!id_or_name || !*id_or_name)
        return err_set(err, ST_ERR_INVALID_ARG, "empty job id or name");
    bool digits = strlen(id_or_name) <= 18;
    for (const char *c = id_or_name; *c; c++)
        digits = digits && *c >= '0' && *c <= '9';
    if (digits)
        return queue_job_get(q, strtoll(id_or_name, NULL, 10), out, err);
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_BY_NAME, err);
    if (!s)
        return err->status;
    queue_bind_str(s, 1, id_or_name);
    char what[160];
    snprintf(what, sizeof(what), "named \"%.128s\"", id_or_name);
    return job_one(q, s, what, out, err);
}

enum status queue_job_find_ready(struct queue *q, const char *id_or_name, struct queue_job *out,
                                 struct err_detail *err)
{
    enum status st = queue_job_find(q, id_or_name, out, err);
    if (st || out->ready)
        return st;
    st = err_set(err, ST_ERR_BUSY,
                 "job %lld '%s' is still being submitted (or its submit was killed: the next "
                 "submit, run or status deletes it)",
                 (long long)out->id, out->name ? out->name : "");
    queue_job_free(out);
    memset(out, 0, sizeof(*out));
    return st;
}

enum status queue_job_list(struct queue *q, struct queue_job **jobs, size_t *n,
                           struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *jobs = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_LIST, err);
    if (!s)
        return err->status;
    struct queue_job *arr = NULL;
    size_t len = 0, cap = 0;
    enum status st = ST_OK;
    int rc = SQLITE_DONE;
    while (st == ST_OK && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (len == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            struct queue_job *t = realloc(arr, ncap * sizeof(*arr));
            if (!t) {
                st = err_set(err, ST_ERR_NOMEM, "queue: out of memory listing jobs");
                break;
            }
            arr = t;
            cap = ncap;
        }
        st = read_job(q, s, &arr[len], err);
        if (st == ST_OK)
            len++;
    }
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "listing jobs", err);
    queue_stmt_done(s);
    if (st != ST_OK) {
        queue_job_list_free(arr, len);
        return st;
    }
    *jobs = arr;
    *n = len;
    return ST_OK;
}

enum status queue_job_state_get(struct queue *q, int64_t job_id, enum queue_job_state *state,
                                struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_STATE, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    int rc = sqlite3_step(s);
    enum status st = ST_OK;
    if (rc == SQLITE_ROW) {
        int v = queue_job_state_parse((const char *)sqlite3_column_text(s, 0));
        if (v < 0)
            st = queue_bad_row(q, "a job has an unknown state", err);
        else
            *state = (enum queue_job_state)v;
    } else if (rc == SQLITE_DONE) {
        st = err_set(err, ST_ERR_NOT_FOUND, "no job with id %lld", (long long)job_id);
    } else {
        st = queue_sql_err(q, rc, "reading a job state", err);
    }
    queue_stmt_done(s);
    return st;
}

enum status queue_jobs_finish(struct queue *q, int64_t job_id, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, job_id ? QS_JOB_FINISH : QS_JOB_FINISH_ALL, err);
    if (!s)
        return err->status;
    if (job_id) {
        sqlite3_bind_int64(s, 1, job_id);
        sqlite3_bind_int64(s, 2, queue_now(q));
    } else {
        sqlite3_bind_int64(s, 1, queue_now(q));
    }
    return queue_step_done(q, s, "marking finished jobs done", err);
}

void queue_set_job_batch(struct queue *q, int64_t n)
{
    q->job_batch = n > 0 ? n : QUEUE_JOB_BATCH;
}

/* One transaction per q->job_batch items: in one, a job of millions held the write lock
 * longer than the busy timeout (5M items: 57 s, the WAL grown to the database's size), and
 * every other process on the queue failed with "database is locked". The batch after which
 * none is left also marks the job cancelled, so a job is never cancelled with items still
 * queued; a cancel stopped half-way leaves a live job with some items cancelled, and the next
 * cancel finishes it. */
enum status queue_job_cancel(struct queue *q, int64_t job_id, int64_t *n_cancelled,
                             struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_cancelled)
        *n_cancelled = 0;
    const int64_t batch = q->job_batch;
    int64_t now = queue_now(q), n = 0, changed = 0, more = 1;
    enum status st = ST_OK;
    while (st == ST_OK && more) {
        struct queue_scope sc;
        if ((st = queue_scope_enter(q, &sc, err)) != ST_OK)
            break;
        enum queue_job_state js;
        changed = more = 0;
        st = queue_job_state_get(q, job_id, &js, err);
        if (st == ST_OK && (js == QUEUE_JOB_QUEUED || js == QUEUE_JOB_RUNNING)) {
            int64_t rejected = 0;
            for (int k = 0; st == ST_OK && k < 2; k++) {
                sqlite3_stmt *s =
                    queue_stmt(q, k ? QS_JOB_CANCEL_ITEMS : QS_JOB_CANCEL_REJECTED, err);
                st = s ? ST_OK : err->status;
                if (st == ST_OK) {
                    sqlite3_bind_int64(s, 1, job_id);
                    sqlite3_bind_int64(s, 2, now);
                    sqlite3_bind_int64(s, 3, batch);
                    st = queue_step_done(q, s, "cancelling items", err);
                    *(k ? &changed : &rejected) = sqlite3_changes(q->db);
                }
            }
            /* any left? (asked here, not inferred from a short batch: a batch that takes the
             * last items exactly must mark the job too, or a run finishing the job before the
             * next transaction would mark it done) */
            if (st == ST_OK && (changed == batch || rejected == batch)) {
                sqlite3_stmt *s = queue_stmt(q, QS_JOB_ANY_UNFINISHED, err);
                if (s == NULL)
                    st = err->status;
                if (st == ST_OK) {
                    sqlite3_bind_int64(s, 1, job_id);
                    int rc = sqlite3_step(s);
                    more = rc == SQLITE_ROW && sqlite3_column_int(s, 0);
                    queue_stmt_done(s);
                    if (rc != SQLITE_ROW)
                        st = queue_sql_err(q, rc, "cancelling items", err);
                }
            }
            if (st == ST_OK && !more) /* the last items: the job too */
                st = queue_run_changes(q, QS_JOB_CANCEL, job_id, now, NULL, "cancelling job", err);
        }
        st = queue_scope_leave(q, &sc, st, err);
        if (st == ST_OK)
            n += changed;
        if (st == ST_OK && more && fault_hit("queue.cancel"))
            st = err_set(err, ST_ERR_IO, "cancelling items: injected fault");
    }
    if (n_cancelled)
        *n_cancelled = n;
    return st;
}

/* One range [lo, hi) of item ids of queue_job_retry_failed, in the caller's transaction: the
 * failed items there back to the queue, their errors shards' superseded counts up by as many,
 * the job reopened when any was; *n gets how many. */
static enum status retry_range(struct queue *q, int64_t job_id, int64_t lo, int64_t hi, int64_t *n,
                               struct err_detail *err)
{
    *n = 0;
    /* the shards' counts first: they look at the items still failed and naming their shard */
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_RETRY_PICK, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    sqlite3_bind_int64(s, 2, lo);
    sqlite3_bind_int64(s, 3, hi);
    enum status st = ST_OK;
    int rc;
    while (st == ST_OK && (rc = sqlite3_step(s)) == SQLITE_ROW)
        st = queue_run_changes(q, QS_JOB_RETRY_SHARD, sqlite3_column_int64(s, 0),
                               sqlite3_column_int64(s, 1), NULL, "retrying failed items", err);
    queue_stmt_done(s);
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "retrying failed items", err);
    if (st == ST_OK && !(s = queue_stmt(q, QS_JOB_RETRY_ITEM, err)))
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, job_id);
        sqlite3_bind_int64(s, 2, lo);
        sqlite3_bind_int64(s, 3, hi);
        st = queue_step_done(q, s, "retrying failed items", err);
    }
    if (st == ST_OK)
        *n = sqlite3_changes(q->db);
    if (st == ST_OK && *n > 0) /* (nothing failed: the job keeps its state) */
        st = queue_run_changes(q, QS_JOB_REOPEN, job_id, 0, NULL, "retrying failed items", err);
    return st;
}

/* One transaction per q->job_batch item ids, for the reason queue_job_cancel gives (ranges of
 * ids rather than the next failed items: those would have to be found and sorted again each
 * time, and one UPDATE per item was twice as slow as the single transaction). */
enum status queue_job_retry_failed(struct queue *q, int64_t job_id, int64_t *n_retried,
                                   struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_retried)
        *n_retried = 0;
    const int64_t batch = q->job_batch;
    enum queue_job_state js;
    int64_t lo = 0, last = -1, n = 0;
    enum status st = queue_job_state_get(q, job_id, &js, err);
    if (st == ST_OK && js == QUEUE_JOB_CANCELLED)
        return err_set(err, ST_ERR_INVALID_ARG, "job %lld is cancelled; nothing can be retried",
                       (long long)job_id);
    sqlite3_stmt *s = st == ST_OK ? queue_stmt(q, QS_JOB_RETRY_SPAN, err) : NULL;
    if (st == ST_OK && !s)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, job_id);
        int rc = sqlite3_step(s);
        if (rc == SQLITE_ROW && sqlite3_column_type(s, 0) != SQLITE_NULL) {
            lo = sqlite3_column_int64(s, 0);
            last = sqlite3_column_int64(s, 1);
        }
        queue_stmt_done(s);
        if (rc != SQLITE_ROW)
            st = queue_sql_err(q, rc, "retrying failed items", err);
    }
    for (; st == ST_OK && lo <= last; lo += batch) {
        struct queue_scope sc;
        int64_t m = 0;
        if ((st = queue_scope_enter(q, &sc, err)) != ST_OK)
            break;
        st = queue_job_state_get(q, job_id, &js, err); /* cancelled since? */
        if (st == ST_OK && js == QUEUE_JOB_CANCELLED)
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "job %lld was cancelled while its failed items "
                         "were retried",
                         (long long)job_id);
        if (st == ST_OK)
            st = retry_range(q, job_id, lo, lo + batch, &m, err);
        st = queue_scope_leave(q, &sc, st, err);
        if (st == ST_OK)
            n += m;
        if (st == ST_OK && lo + batch <= last && fault_hit("queue.retry"))
            st = err_set(err, ST_ERR_IO, "retrying failed items: injected fault");
    }
    if (n_retried)
        *n_retried = n;
    return st;
}

enum status queue_job_counts(struct queue *q, int64_t job_id, struct queue_counts *out,
                             struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    memset(out, 0, sizeof(*out));
    sqlite3_stmt *s = queue_stmt(q, job_id ? QS_COUNTS_JOB : QS_COUNTS_ALL, err);
    if (!s)
        return err->status;
    if (job_id)
        sqlite3_bind_int64(s, 1, job_id);
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        int state = queue_item_state_parse((const char *)sqlite3_column_text(s, 0));
        int64_t count = sqlite3_column_int64(s, 1);
        if (state < 0) {
            queue_stmt_done(s);
            return queue_bad_row(q, "an item has an unknown state", err);
        }
        out->items[state] += count;
        out->total += count;
        out->prompt_tokens += (int64_t)sqlite3_column_double(s, 2);
        out->completion_tokens += (int64_t)sqlite3_column_double(s, 3);
        out->attempts += (int64_t)sqlite3_column_double(s, 4);
    }
    queue_stmt_done(s);
    if (rc != SQLITE_DONE)
        return queue_sql_err(q, rc, "counting items", err);

    s = queue_stmt(q, job_id ? QS_ERRORS_JOB : QS_ERRORS_ALL, err);
    if (!s)
        return err->status;
    if (job_id)
        sqlite3_bind_int64(s, 1, job_id);
    sqlite3_bind_int(s, 2, QUEUE_MAX_ERROR_CODES);
    while ((rc = sqlite3_step(s)) == SQLITE_ROW && out->n_error_codes < QUEUE_MAX_ERROR_CODES) {
        struct queue_error_count *e = &out->errors[out->n_error_codes++];
        const unsigned char *code = sqlite3_column_text(s, 0);
        snprintf(e->code, sizeof(e->code), "%s", code ? (const char *)code : "");
        e->count = sqlite3_column_int64(s, 1);
    }
    queue_stmt_done(s);
    if (rc != SQLITE_DONE && rc != SQLITE_ROW)
        return queue_sql_err(q, rc, "counting errors", err);
    return ST_OK;
}

enum status queue_job_unfinished(struct queue *q, int64_t job_id, int64_t *queued, int64_t *leased,
                                 struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    int64_t n[2] = {0, 0};
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_UNFINISHED, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW)
        n[queue_item_state_parse((const char *)sqlite3_column_text(s, 0)) == QUEUE_ITEM_LEASED] =
            sqlite3_column_int64(s, 1);
    queue_stmt_done(s);
    if (rc != SQLITE_DONE)
        return queue_sql_err(q, rc, "counting unfinished items", err);
    if (queued)
        *queued = n[0];
    if (leased)
        *leased = n[1];
    return ST_OK;
}

enum status queue_job_set_out_dir(struct queue *q, int64_t job_id, const char *out_dir,
                                  struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_SET_OUT, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    queue_bind_str(s, 2, out_dir);
    return queue_step_done(q, s, "recording the job's output directory", err);
}
