/* Output shards in the queue: creating, adopting, closing and listing them, and
 * queue_commit_shard, the one transaction per flush that makes "a record is in a shard iff its
 * item is done" true. */
#include "queue/queue_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void queue_shard_list_free(struct queue_shard *shards, size_t n)
{
    if (!shards)
        return;
    for (size_t i = 0; i < n; i++)
        free(shards[i].path);
    free(shards);
}

/* Fill sh from the current row of a SHARD_COLS statement; path is malloc'd. A row that breaks
 * the schema (no path, an unknown kind or state) is ST_ERR_FORMAT. */
static enum status read_shard(struct queue *q, sqlite3_stmt *s, struct queue_shard *sh,
                              struct err_detail *err)
{
    memset(sh, 0, sizeof(*sh));
    sh->id = sqlite3_column_int64(s, 0);
    sh->job_id = sqlite3_column_int64(s, 1);
    int kind = queue_shard_kind_parse((const char *)sqlite3_column_text(s, 2));
    const char *state = (const char *)sqlite3_column_text(s, 9);
    if (kind < 0 || !state || (strcmp(state, "open") != 0 && strcmp(state, "closed") != 0) ||
        sqlite3_column_type(s, 4) == SQLITE_NULL) {
        char what[96];
        snprintf(what, sizeof(what), "shard %lld has no path or an unknown kind or state",
                 (long long)sh->id);
        return queue_bad_row(q, what, err);
    }
    sh->kind = (enum queue_shard_kind)kind;
    sh->seq = sqlite3_column_int64(s, 3);
    sh->run_id = sqlite3_column_int64(s, 5);
    sh->committed_bytes = (uint64_t)sqlite3_column_int64(s, 6);
    sh->records = (uint64_t)sqlite3_column_int64(s, 7);
    sh->superseded = (uint64_t)sqlite3_column_int64(s, 8);
    sh->state = strcmp(state, "closed") == 0 ? QUEUE_SHARD_CLOSED : QUEUE_SHARD_OPEN;
    const unsigned char *sha = sqlite3_column_text(s, 10);
    snprintf(sh->sha256, sizeof(sh->sha256), "%s", sha ? (const char *)sha : "");
    return queue_col_dup(s, 4, &sh->path, err);
}

/* One shard by id into *sh (caller frees sh->path); ST_ERR_NOT_FOUND if missing. */
static enum status shard_get(struct queue *q, int64_t shard_id, struct queue_shard *sh,
                             struct err_detail *err)
{
    memset(sh, 0, sizeof(*sh));
    sqlite3_stmt *s = queue_stmt(q, QS_SHARD_GET, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, shard_id);
    int rc = sqlite3_step(s);
    enum status st;
    if (rc == SQLITE_ROW)
        st = read_shard(q, s, sh, err);
    else if (rc == SQLITE_DONE)
        st = err_set(err, ST_ERR_NOT_FOUND, "no shard with id %lld", (long long)shard_id);
    else
        st = queue_sql_err(q, rc, "reading a shard", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_shard_next_seq(struct queue *q, int64_t job_id, enum queue_shard_kind kind,
                                 int64_t *seq, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *seq = 0;
    if ((unsigned)kind >= QUEUE_SHARD_KIND_COUNT)
        return err_set(err, ST_ERR_INVALID_ARG, "bad shard kind %d", (int)kind);
    sqlite3_stmt *s = queue_stmt(q, QS_SHARD_NEXT_SEQ, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    queue_bind_str(s, 2, queue_shard_kind_str(kind));
    int rc = sqlite3_step(s);
    enum status st = ST_OK;
    if (rc == SQLITE_ROW)
        *seq = sqlite3_column_int64(s, 0);
    else
        st = queue_sql_err(q, rc, "finding the next shard number", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_shard_create(struct queue *q, int64_t run_id, int64_t job_id,
                               enum queue_shard_kind kind, int64_t seq, const char *path,
                               int64_t *shard_id, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *shard_id = 0;
    if ((unsigned)kind >= QUEUE_SHARD_KIND_COUNT || seq < 0 || !path || !*path)
        return err_set(err, ST_ERR_INVALID_ARG, "shard: bad kind, seq or path");
    enum status st = queue_run_check(q, run_id, err);
    if (st != ST_OK)
        return st;
    sqlite3_stmt *s = queue_stmt(q, QS_SHARD_INSERT, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    queue_bind_str(s, 2, queue_shard_kind_str(kind));
    sqlite3_bind_int64(s, 3, seq);
    queue_bind_str(s, 4, path);
    sqlite3_bind_int64(s, 5, run_id);
    sqlite3_bind_int64(s, 6, queue_now(q));
    st = queue_step_done(q, s, "creating a shard", err);
    if (st == ST_ERR_EXISTS)
        return err_set(err, ST_ERR_EXISTS, "shard %s %lld of job %lld or path %s already exists",
                       queue_shard_kind_str(kind), (long long)seq, (long long)job_id, path);
    if (st == ST_ERR_INVALID_ARG) /* foreign key: the job */
        return err_set(err, ST_ERR_NOT_FOUND, "shard: no job with id %lld", (long long)job_id);
    if (st == ST_OK)
        *shard_id = sqlite3_last_insert_rowid(q->db);
    return st;
}

enum status queue_shard_adopt(struct queue *q, int64_t shard_id, int64_t run_id, int64_t stale_ms,
                              struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    st = queue_run_check(q, run_id, err);
    sqlite3_stmt *s = NULL;
    if (st == ST_OK && (s = queue_stmt(q, QS_SHARD_ADOPT, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, shard_id);
        sqlite3_bind_int64(s, 2, run_id);
        sqlite3_bind_int64(s, 3, queue_now(q) - stale_ms);
        st = queue_step_done(q, s, "adopting a shard", err);
    }
    if (st == ST_OK && sqlite3_changes(q->db) == 0) {
        struct queue_shard sh;
        st = shard_get(q, shard_id, &sh, err);
        if (st == ST_OK)
            st = err_set(err, ST_ERR_CONFLICT,
                         sh.state == QUEUE_SHARD_CLOSED ? "shard %lld is closed"
                                                        : "shard %lld: run %lld is still alive",
                         (long long)shard_id, (long long)sh.run_id);
        free(sh.path);
    }
    return queue_scope_leave(q, &sc, st, err);
}

static bool is_sha256_hex(const char *s)
{
    if (!s || strlen(s) != 64)
        return false;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return false;
    return true;
}

enum status queue_shard_close(struct queue *q, int64_t run_id, int64_t shard_id,
                              const char *sha256_hex, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (!is_sha256_hex(sha256_hex))
        return err_set(err, ST_ERR_INVALID_ARG, "shard %lld: sha256 must be 64 lower-case hex",
                       (long long)shard_id);
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    sqlite3_stmt *s = queue_stmt(q, QS_SHARD_CLOSE, err);
    if (!s)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, shard_id);
        sqlite3_bind_int64(s, 2, run_id);
        queue_bind_str(s, 3, sha256_hex);
        sqlite3_bind_int64(s, 4, queue_now(q));
        st = queue_step_done(q, s, "closing a shard", err);
    }
    if (st == ST_OK && sqlite3_changes(q->db) == 0) {
        struct queue_shard sh;
        st = shard_get(q, shard_id, &sh, err);
        if (st == ST_OK && sh.state == QUEUE_SHARD_CLOSED)
            st = err_set(err, ST_ERR_INVALID_ARG, "shard %lld is already closed",
                         (long long)shard_id);
        else if (st == ST_OK)
            st = err_set(err, ST_ERR_CONFLICT, "shard %lld belongs to run %lld, not %lld",
                         (long long)shard_id, (long long)sh.run_id, (long long)run_id);
        free(sh.path);
    }
    return queue_scope_leave(q, &sc, st, err);
}

enum status queue_shard_list(struct queue *q, int64_t job_id, struct queue_shard **shards,
                             size_t *n, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *shards = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, job_id ? QS_SHARD_LIST_JOB : QS_SHARD_LIST_ALL, err);
    if (!s)
        return err->status;
    if (job_id)
        sqlite3_bind_int64(s, 1, job_id);
    struct queue_shard *arr = NULL;
    size_t len = 0, cap = 0;
    enum status st = ST_OK;
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (len == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            struct queue_shard *t = realloc(arr, ncap * sizeof(*arr));
            if (!t) {
                st = err_set(err, ST_ERR_NOMEM, "queue: out of memory listing shards");
                break;
            }
            arr = t;
            cap = ncap;
        }
        st = read_shard(q, s, &arr[len], err);
        if (st != ST_OK)
            break;
        len++;
    }
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "listing shards", err);
    queue_stmt_done(s);
    if (st != ST_OK) {
        queue_shard_list_free(arr, len);
        return st;
    }
    *shards = arr;
    *n = len;
    return ST_OK;
}

/* Why item id could not be finished by run_id: ST_ERR_CONFLICT when it is simply no longer
 * ours (the lost case), ST_ERR_INVALID_ARG for caller mistakes. */
static enum status why_not_finished(struct queue *q, int64_t id, int64_t run_id,
                                    const struct queue_shard *sh, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_ITEM_OWNER, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, id);
    int rc = sqlite3_step(s);
    enum status st;
    if (rc == SQLITE_ROW) {
        int64_t job = sqlite3_column_int64(s, 0);
        int state = queue_item_state_parse((const char *)sqlite3_column_text(s, 1));
        int64_t owner = sqlite3_column_int64(s, 2);
        int64_t shard = sqlite3_column_int64(s, 3);
        if (job != sh->job_id)
            st = err_set(err, ST_ERR_INVALID_ARG, "item %lld belongs to job %lld, not %lld",
                         (long long)id, (long long)job, (long long)sh->job_id);
        else if ((state == QUEUE_ITEM_DONE || state == QUEUE_ITEM_FAILED) && owner == run_id &&
                 shard == sh->id)
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "item %lld is already finished in shard %lld (listed twice?)",
                         (long long)id, (long long)shard);
        else
            st = err_set(err, ST_ERR_CONFLICT,
                         "item %lld is no longer leased by run %lld (it is %s, owner %lld)",
                         (long long)id, (long long)run_id,
                         queue_item_state_str((enum queue_item_state)(state < 0 ? 0 : state)),
                         (long long)owner);
    } else if (rc == SQLITE_DONE) {
        st = err_set(err, ST_ERR_INVALID_ARG, "no item with id %lld", (long long)id);
    } else {
        st = queue_sql_err(q, rc, "reading an item", err);
    }
    queue_stmt_done(s);
    return st;
}

/* Check the shard may take this commit (see queue.h). */
static enum status check_commit(const struct queue_shard *sh, int64_t run_id,
                                uint64_t committed_bytes, uint64_t records, size_t n_done,
                                struct err_detail *err)
{
    if (sh->state != QUEUE_SHARD_OPEN)
        return err_set(err, ST_ERR_INVALID_ARG, "shard %lld is closed", (long long)sh->id);
    if (sh->run_id != run_id)
        return err_set(err, ST_ERR_CONFLICT, "shard %lld belongs to run %lld, not %lld",
                       (long long)sh->id, (long long)sh->run_id, (long long)run_id);
    if (committed_bytes > (uint64_t)INT64_MAX || records > (uint64_t)INT64_MAX)
        return err_set(err, ST_ERR_RANGE, "shard %lld: length out of range", (long long)sh->id);
    if (committed_bytes < sh->committed_bytes)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "shard %lld: committed length would shrink from %llu to %llu",
                       (long long)sh->id, (unsigned long long)sh->committed_bytes,
                       (unsigned long long)committed_bytes);
    if (records != sh->records + n_done)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "shard %lld: %llu records + %zu items committed != %llu records",
                       (long long)sh->id, (unsigned long long)sh->records, n_done,
                       (unsigned long long)records);
    return ST_OK;
}

enum status queue_commit_shard(struct queue *q, int64_t run_id, int64_t shard_id,
                               uint64_t committed_bytes, uint64_t records,
                               const struct queue_done *done, size_t n_done, bool *lost,
                               struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (lost && n_done)
        memset(lost, 0, n_done * sizeof(*lost));
    if (n_done && !done)
        return err_set(err, ST_ERR_INVALID_ARG, "commit: %zu items but no array", n_done);
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    struct queue_shard sh;
    st = shard_get(q, shard_id, &sh, err);
    if (st == ST_OK)
        st = check_commit(&sh, run_id, committed_bytes, records, n_done, err);
    bool errors_shard = sh.kind == QUEUE_SHARD_ERRORS;
    int64_t now = queue_now(q);
    size_t n_lost = 0;
    struct err_detail lost_err = {0}, first_lost = {0};
    for (size_t i = 0; st == ST_OK && i < n_done; i++) {
        const struct queue_done *d = &done[i];
        if ((d->error_code != NULL) != errors_shard) {
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "item %lld: %s go to %s shards, shard %lld is a %s shard",
                         (long long)d->item_id, d->error_code ? "failed items" : "results",
                         d->error_code ? "errors" : "results", (long long)shard_id,
                         queue_shard_kind_str(sh.kind));
            break;
        }
        sqlite3_stmt *s = queue_stmt(q, QS_ITEM_FINISH, err);
        if (!s) {
            st = err->status;
            break;
        }
        sqlite3_bind_int64(s, 1, d->item_id);
        sqlite3_bind_int64(s, 2, run_id);
        queue_bind_str(s, 3,
                       queue_item_state_str(errors_shard ? QUEUE_ITEM_FAILED : QUEUE_ITEM_DONE));
        sqlite3_bind_int64(s, 4, shard_id);
        queue_bind_str(s, 5, d->error_code);
        queue_bind_str(s, 6, d->error_msg);
        sqlite3_bind_int64(s, 7, d->prompt_tokens);
        sqlite3_bind_int64(s, 8, d->completion_tokens);
        sqlite3_bind_int64(s, 9, now);
        sqlite3_bind_int64(s, 10, sh.job_id);
        sqlite3_bind_int64(s, 11, (int64_t)sh.records + (int64_t)i);
        if (d->ttft_ms > 0)
            sqlite3_bind_double(s, 12, d->ttft_ms);
        if (d->tpot_ms > 0)
            sqlite3_bind_double(s, 13, d->tpot_ms);
        st = queue_step_done(q, s, "finishing an item", err);
        if (st != ST_OK || sqlite3_changes(q->db) == 1)
            continue;
        /* Not ours: find out why. Lost items are collected (all of them, for the caller);
         * anything else is a caller error that ends the commit. */
        enum status why = why_not_finished(q, d->item_id, run_id, &sh, &lost_err);
        if (why != ST_ERR_CONFLICT) {
            st = err_set(err, why, "%s", lost_err.msg);
            break;
        }
        if (n_lost++ == 0)
            first_lost = lost_err;
        if (lost)
            lost[i] = true;
    }
    if (st == ST_OK && n_lost)
        st = err_set(err, ST_ERR_CONFLICT,
                     "shard %lld: %zu of %zu items are no longer leased by run %lld; nothing "
                     "committed (first: %.300s)",
                     (long long)shard_id, n_lost, n_done, (long long)run_id, first_lost.msg);
    if (st == ST_OK) {
        sqlite3_stmt *s = queue_stmt(q, QS_SHARD_COMMIT, err);
        if (!s)
            st = err->status;
        if (st == ST_OK) {
            sqlite3_bind_int64(s, 1, shard_id);
            sqlite3_bind_int64(s, 2, (int64_t)committed_bytes);
            sqlite3_bind_int64(s, 3, (int64_t)records);
            st = queue_step_done(q, s, "recording the shard length", err);
        }
    }
    if (st == ST_OK && n_done)
        st = queue_jobs_finish(q, sh.job_id, err);
    free(sh.path);
    st = queue_scope_leave(q, &sc, st, err);
    if (st != ST_OK && st != ST_ERR_CONFLICT && lost && n_done)
        memset(lost, 0, n_done * sizeof(*lost));
    return st;
}
