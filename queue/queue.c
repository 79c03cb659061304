/* The queue's shared plumbing: state names, SQLite error mapping, the prepared-statement cache and
 * write scopes (BEGIN IMMEDIATE or savepoint) with the user's transactions. Opening is in
 * queue/open.c, jobs in queue/jobs.c, runs in queue/runs.c. */
#include "queue/queue_internal.h"

#include "common/fault.h"
#include "common/log.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* ---- names ----------------------------------------------------------------------------- */

static const char *const JOB_STATES[QUEUE_JOB_STATE_COUNT] = {"queued", "running", "done",
                                                              "cancelled"};
static const char *const ITEM_STATES[QUEUE_ITEM_STATE_COUNT] = {"queued", "leased", "done",
                                                                "failed", "cancelled"};
static const char *const SHARD_KINDS[QUEUE_SHARD_KIND_COUNT] = {"results", "errors"};

const char *queue_job_state_str(enum queue_job_state s)
{
    return (unsigned)s < QUEUE_JOB_STATE_COUNT ? JOB_STATES[s] : "?";
}

const char *queue_item_state_str(enum queue_item_state s)
{
    return (unsigned)s < QUEUE_ITEM_STATE_COUNT ? ITEM_STATES[s] : "?";
}

const char *queue_shard_kind_str(enum queue_shard_kind k)
{
    return (unsigned)k < QUEUE_SHARD_KIND_COUNT ? SHARD_KINDS[k] : "?";
}

static int parse_name(const char *const *names, int n, const char *s)
{
    for (int i = 0; s && i < n; i++)
        if (strcmp(names[i], s) == 0)
            return i;
    return -1;
}

int queue_job_state_parse(const char *s)
{
    return parse_name(JOB_STATES, QUEUE_JOB_STATE_COUNT, s);
}

int queue_item_state_parse(const char *s)
{
    return parse_name(ITEM_STATES, QUEUE_ITEM_STATE_COUNT, s);
}

int queue_shard_kind_parse(const char *s)
{
    return parse_name(SHARD_KINDS, QUEUE_SHARD_KIND_COUNT, s);
}

/* ---- SQLite helpers -------------------------------------------------------------------- */

/* queue_sql_err for a connection that may not be a struct queue yet (db may be NULL). */
enum status queue_sql_fail(sqlite3 *db, const char *path, int rc, const char *what,
                           struct err_detail *err)
{
    enum status st;
    switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
        st = ST_ERR_BUSY;
        break;
    case SQLITE_NOMEM:
        st = ST_ERR_NOMEM;
        break;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
        st = ST_ERR_FORMAT;
        break;
    case SQLITE_IOERR:
    case SQLITE_FULL:
    case SQLITE_CANTOPEN:
    case SQLITE_READONLY:
    case SQLITE_PERM:
        st = ST_ERR_IO;
        break;
    case SQLITE_CONSTRAINT:
        st = (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY)
                 ? ST_ERR_EXISTS
                 : ST_ERR_INVALID_ARG;
        break;
    default:
        st = ST_ERR_INTERNAL;
        break;
    }
    const char *msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    const char *p = path ? path : "(unknown)";
    if ((rc & 0xff) == SQLITE_CORRUPT)
        return err_set(err, st, "queue %s is corrupt (%s: %s)" QUEUE_CORRUPT_ADVICE, p, what, msg,
                       p);
    if ((rc & 0xff) == SQLITE_IOERR && db && sqlite3_system_errno(db) == EFBIG)
        return err_set(err, st,
                       "queue %s: %s: %s (file too large: the file-size limit, `ulimit -f`, "
                       "stops the queue or its journal growing)",
                       p, what, msg);
    if ((rc & 0xff) == SQLITE_NOTADB)
        return err_set(err, st,
                       "queue %s is not an SQLite database, or its header is destroyed (%s: %s)"
                       "; if it was a queue, restore it from a backup",
                       p, what, msg);
    if ((rc & 0xff) == SQLITE_FULL ||
        ((rc & 0xff) == SQLITE_IOERR && db && sqlite3_system_errno(db) == ENOSPC))
        return err_set(err, st,
                       "queue %s: %s: %s (no space left on its file system, which also "
                       "holds its -wal and -shm files)",
                       p, what, msg);
    if ((rc & 0xff) == SQLITE_READONLY || (rc & 0xff) == SQLITE_CANTOPEN ||
        (rc & 0xff) == SQLITE_PERM) {
        int e = db ? sqlite3_system_errno(db) : 0;
        if (e == EMFILE || e == ENFILE)
            return err_set(err, st,
                           "queue %s: %s: %s: %s (raise `ulimit -n`: a queue holds its file and "
                           "a journal or -wal and -shm open, each part of a partitioned queue "
                           "its own)",
                           p, what, msg, strerror(e));
        return err_set(err, st,
                       "queue %s: %s: %s%s%s (quern writes the queue and, beside it, its journal "
                       "files, also to read it: the file and its directory must be writable)",
                       p, what, msg, e ? ": " : "", e ? strerror(e) : "");
    }
    return err_set(err, st, "queue %s: %s: %s", p, what, msg);
}

enum status queue_checkpoint(struct queue *q, struct err_detail *err)
{
    static const char what[] = "copying the WAL's commits into the database (a checkpoint)";
    if (fault_hit("queue.checkpoint"))
        return queue_sql_fail(NULL, q->path, SQLITE_IOERR_FSYNC, what, err);
    int rc = sqlite3_wal_checkpoint_v2(q->db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
    if (rc == SQLITE_OK || rc == SQLITE_BUSY || rc == SQLITE_LOCKED)
        return ST_OK;
    return queue_sql_err(q, rc, what, err);
}

/* One per directory, shared by the queues there (a partitioned queue's parts: one file, not
 * one per part). */
static void reserve_path(const struct queue *q, char *out, size_t n)
{
    snprintf(out, n, "%s/" QUEUE_RESERVE_NAME, q->dir ? q->dir : ".");
}

void queue_reserve_keep(struct queue *q)
{
    char path[4200];
    struct statvfs sv;
    if (!q->dir || statvfs(q->dir, &sv))
        return;
    reserve_path(q, path, sizeof(path));
    uint64_t half = (uint64_t)sv.f_bavail * sv.f_frsize / 2, want = QUEUE_RESERVE_BYTES;
    if (half < want)
        want = half & ~(uint64_t)4095;
    int fd = want ? open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644) : -1;
    if (fd < 0)
        return; /* (there already, or no room, or not allowed) */
    int e = posix_fallocate(fd, 0, (off_t)want);
    if (e) {
        unlink(path);
        LOG_DEBUG("%s: no reserve file (%s)", path, strerror(e));
    }
    close(fd);
}

enum status queue_make_room(struct queue *q, struct err_detail *err)
{
    char path[4200];
    reserve_path(q, path, sizeof(path));
    if (q->dir && !unlink(path))
        LOG_WARN("%s's file system is full: the reserve file %s is deleted, to give the run's "
                 "work back (free space there; the next run makes it again)",
                 q->path ? q->path : "the queue", path);
    int rc = sqlite3_wal_checkpoint_v2(q->db, NULL, SQLITE_CHECKPOINT_TRUNCATE, NULL, NULL);
    return rc == SQLITE_OK ? ST_OK : queue_sql_err(q, rc, "checkpointing the WAL", err);
}

enum status queue_sql_err(struct queue *q, int rc, const char *what, struct err_detail *err)
{
    return queue_sql_fail(q ? q->db : NULL, q ? q->path : NULL, rc, what, err);
}

enum status queue_bad_row(struct queue *q, const char *what, struct err_detail *err)
{
    const char *p = q->path ? q->path : "(unknown)";
    return err_set(err, ST_ERR_FORMAT, "queue %s is corrupt (%s)" QUEUE_CORRUPT_ADVICE, p, what, p);
}

sqlite3_stmt *queue_stmt(struct queue *q, enum queue_stmt_id id, struct err_detail *err)
{
    assert((unsigned)id < QS_COUNT);
    if (!q->stmts[id]) {
        int rc = sqlite3_prepare_v3(q->db, queue_stmt_sql[id], -1, SQLITE_PREPARE_PERSISTENT,
                                    &q->stmts[id], NULL);
        if (rc != SQLITE_OK) {
            queue_sql_err(q, rc, "preparing a queue statement", err);
            q->stmts[id] = NULL;
            return NULL;
        }
    }
    return q->stmts[id];
}

void queue_stmt_done(sqlite3_stmt *st)
{
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
}

enum status queue_step_done(struct queue *q, sqlite3_stmt *st, const char *what,
                            struct err_detail *err)
{
    int rc = sqlite3_step(st);
    enum status s = ST_OK;
    if (rc != SQLITE_DONE && rc != SQLITE_ROW)
        s = queue_sql_err(q, rc, what, err);
    queue_stmt_done(st);
    return s;
}

int queue_bind_str(sqlite3_stmt *st, int idx, const char *s)
{
    return s ? sqlite3_bind_text(st, idx, s, -1, SQLITE_STATIC) : sqlite3_bind_null(st, idx);
}

enum status queue_col_dup(sqlite3_stmt *st, int col, char **out, struct err_detail *err)
{
    *out = NULL;
    const unsigned char *s = sqlite3_column_text(st, col);
    if (!s && sqlite3_column_type(st, col) == SQLITE_NULL)
        return ST_OK;
    if (!s)
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory reading a column");
    size_t n = (size_t)sqlite3_column_bytes(st, col);
    char *c = malloc(n + 1);
    if (!c)
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory copying a column");
    memcpy(c, s, n);
    c[n] = 0;
    *out = c;
    return ST_OK;
}

/* Run a statement from the cache that has no parameters and returns no rows. */
static enum status run_simple(struct queue *q, enum queue_stmt_id id, struct err_detail *err)
{
    sqlite3_stmt *st = queue_stmt(q, id, err);
    if (!st)
        return err ? err->status : ST_ERR_INTERNAL;
    return queue_step_done(q, st, queue_stmt_sql[id], err);
}

/* ---- write scopes and user transactions ------------------------------------------------ */

enum status queue_scope_enter(struct queue *q, struct queue_scope *sc, struct err_detail *err)
{
    sc->savepoint = q->user_tx;
    if (q->user_tx && sqlite3_get_autocommit(q->db))
        return err_set(err, ST_ERR_INTERNAL,
                       "queue: the open transaction was rolled back by an earlier error");
    return run_simple(q, sc->savepoint ? QS_SAVEPOINT : QS_BEGIN, err);
}

enum status queue_scope_leave(struct queue *q, struct queue_scope *sc, enum status st,
                              struct err_detail *err)
{
    if (st == ST_OK) {
        if (!sc->savepoint && fault_hit("queue.commit"))
            st = err_set(err, ST_ERR_IO, "queue: commit: injected fault");
        else
            st = run_simple(q, sc->savepoint ? QS_RELEASE_SP : QS_COMMIT, err);
        if (st == ST_OK)
            return ST_OK;
    }
    /* Undo. SQLite may already have rolled back on its own (I/O error, full disk), in which
     * case these fail harmlessly; the caller keeps the first error. */
    if (!sqlite3_get_autocommit(q->db)) {
        if (sc->savepoint) {
            run_simple(q, QS_ROLLBACK_TO_SP, NULL);
            run_simple(q, QS_RELEASE_SP, NULL);
        } else {
            run_simple(q, QS_ROLLBACK, NULL);
        }
    }
    return st;
}

enum status queue_tx_begin(struct queue *q, struct err_detail *err)
{
    if (q->user_tx)
        return err_set(err, ST_ERR_INVALID_ARG, "queue: transaction already open");
    enum status st = run_simple(q, QS_BEGIN, err);
    if (st == ST_OK)
        q->user_tx = true;
    return st;
}

enum status queue_tx_commit(struct queue *q, struct err_detail *err)
{
    if (!q->user_tx)
        return err_set(err, ST_ERR_INVALID_ARG, "queue: no transaction to commit");
    q->user_tx = false;
    if (sqlite3_get_autocommit(q->db))
        return err_set(err, ST_ERR_INTERNAL,
                       "queue: the transaction was rolled back by an earlier error");
    enum status st = fault_hit("queue.commit")
                         ? err_set(err, ST_ERR_IO, "queue: commit: injected fault")
                         : run_simple(q, QS_COMMIT, err);
    if (st != ST_OK && !sqlite3_get_autocommit(q->db))
        run_simple(q, QS_ROLLBACK, NULL);
    return st;
}

enum status queue_read_begin(struct queue *q, struct err_detail *err)
{
    if (q->user_tx)
        return err_set(err, ST_ERR_INVALID_ARG, "queue: transaction already open");
    int rc = sqlite3_exec(q->db, "BEGIN DEFERRED", NULL, NULL, NULL);
    if (rc != SQLITE_OK)
        return queue_sql_err(q, rc, "starting a read transaction", err);
    q->user_tx = true; /* (a scope inside takes a savepoint) */
    return ST_OK;
}

void queue_read_end(struct queue *q)
{
    queue_tx_rollback(q); /* (nothing was written) */
}

void queue_tx_rollback(struct queue *q)
{
    if (!q || !q->user_tx)
        return;
    q->user_tx = false;
    if (!sqlite3_get_autocommit(q->db))
        run_simple(q, QS_ROLLBACK, NULL);
}

enum status queue_run_changes(struct queue *q, enum queue_stmt_id id, int64_t a, int64_t b,
                              int64_t *changes, const char *what, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, id, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, a);
    if (sqlite3_bind_parameter_count(s) >= 2)
        sqlite3_bind_int64(s, 2, b);
    enum status st = queue_step_done(q, s, what, err);
    if (st == ST_OK && changes)
        *changes = sqlite3_changes(q->db);
    return st;
}
