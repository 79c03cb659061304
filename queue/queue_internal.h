/* Private parts of the queue module shared by its .c files: the connection struct, the table of
 * prepared statements (SQL text in queue/schema.c), transaction scopes and SQLite helpers. */
#ifndef QUEUE_QUEUE_INTERNAL_H
#define QUEUE_QUEUE_INTERNAL_H

#include <sqlite3.h>

#include "queue/queue.h"

/* Every statement the module runs after open; prepared on first use, reused until close. */
enum queue_stmt_id {
    QS_BEGIN,
    QS_COMMIT,
    QS_ROLLBACK,
    QS_SAVEPOINT,
    QS_RELEASE_SP,
    QS_ROLLBACK_TO_SP,
    QS_JOB_INSERT,
    QS_JOB_GET,
    QS_JOB_BY_NAME,
    QS_JOB_LIST,
    QS_JOB_STATE,
    QS_JOB_ADD_ITEM,
    QS_JOB_START,
    QS_JOB_FINISH,
    QS_JOB_FINISH_ALL,
    QS_JOB_CANCEL_ITEMS,
    QS_JOB_CANCEL_REJECTED,
    QS_JOB_CANCEL,
    QS_JOB_RETRY_SPAN,
    QS_JOB_RETRY_PICK,
    QS_JOB_RETRY_SHARD,
    QS_JOB_RETRY_ITEM,
    QS_JOB_REOPEN,
    QS_JOB_SET_OUT,
    QS_META_GET,
    QS_META_SET,
    QS_JOB_SUBMIT_INFO,
    QS_JOB_PUBLISH,
    QS_JOB_PUBLISH_EMPTY,
    QS_ITEM_YIELD_ID,
    QS_JOB_DELETE,
    QS_GC_CANDIDATES,
    QS_COUNTS_JOB,
    QS_COUNTS_ALL,
    QS_JOB_UNFINISHED,
    QS_JOB_ANY_UNFINISHED,
    QS_ERRORS_JOB,
    QS_ERRORS_ALL,
    QS_ITEM_INSERT,
    QS_ITEM_DELETE_BATCH,
    QS_ITEM_OWNER,
    QS_ITEM_FINISH,
    QS_RUN_INSERT,
    QS_RUN_ACTIVE,
    QS_RUN_ENDED,
    QS_RUN_END,
    QS_RUN_END_DEAD,
    QS_RUN_HEARTBEAT,
    QS_RUN_STOPPING,
    QS_RUN_PROGRESS,
    QS_RUN_ENGINE,
    QS_JOB_WRITERS,
    QS_RUN_LIST_LIVE,
    QS_RUN_LIST_JOB,
    QS_RUN_LAST_ENDED,
    QS_SAMPLE_ADD,
    QS_SAMPLE_LIST,
    QS_LEASE_EXPIRE,
    QS_LEASE_REQUEUE_RUN,
    QS_LEASE_EXTEND,
    QS_LEASE_LIST,
    QS_CLAIM_JOB,
    QS_CLAIM_ANY,
    QS_RELEASE_ONE,
    QS_RELEASE_ALL,
    QS_ITEM_STARTED,
    QS_SHARD_GET,
    QS_SHARD_NEXT_SEQ,
    QS_SHARD_INSERT,
    QS_SHARD_ADOPT,
    QS_SHARD_CLOSE,
    QS_SHARD_COMMIT,
    QS_SHARD_LIST_JOB,
    QS_SHARD_LIST_ALL,
    QS_COUNT,
};

/* SQL text of each statement, indexed by enum queue_stmt_id (queue/schema.c). */
extern const char *const queue_stmt_sql[QS_COUNT];

/* One forward migration: running `sql` on a database at version - 1 brings it to version. */
struct queue_migration {
    int version;            /* user_version after this step */
    const char *sql;        /* statements run in the migration's transaction */
    int (*then)(sqlite3 *); /* then this, for what SQL alone cannot say (NULL: nothing); an
                               SQLite result code */
};
extern const struct queue_migration queue_migrations[]; /* ascending; the last is current */
extern const size_t queue_n_migrations;                 /* entries in queue_migrations */
/* Run migration m on db (in the caller's transaction) and set user_version to m->version; an
 * SQLite result code. */
int queue_migration_apply(sqlite3 *db, const struct queue_migration *m);

struct queue {
    sqlite3 *db;                   /* the connection, owned */
    char *path;                    /* the database file as given to queue_open, owned */
    bool user_tx;                  /* inside queue_tx_begin/commit */
    bool exclusive;                /* opened with queue_options.exclusive (a part) */
    bool read_only;                /* opened read-only (queue_options.read_only_ok) */
    int schema_version;            /* user_version after open */
    int64_t (*now_ms)(void *ctx);  /* clock; never NULL */
    void *clock_ctx;               /* passed to now_ms */
    sqlite3_stmt *stmts[QS_COUNT]; /* prepared lazily, finalized at close */
    char *dir;                     /* directory of the database file, absolute (owned) */
    char *file;                    /* the database file, absolute (owned) */
    int64_t job_batch;             /* items per transaction of queue_job_cancel and _retry_failed */
    int busy_ms;                   /* how long a wait for a locked database lasts */
    const volatile sig_atomic_t *interrupt; /* queue_set_interrupt: nonzero ends such a wait */
};

/* A write scope: BEGIN IMMEDIATE outside a user transaction, a savepoint inside one. */
struct queue_scope {
    bool savepoint; /* true: savepoint inside the user's transaction */
};

/* Public entry points accept err == NULL; this points it at a local so helpers can use it. */
#define QUEUE_ERR_LOCAL(err)                                                                       \
    struct err_detail err##_local_;                                                                \
    if (!(err))                                                                                    \
    (err) = &err##_local_

/* Current time in unix ms from the queue's clock. */
int64_t queue_now(struct queue *q);

/* The prepared statement id, reset and ready to bind; NULL with err set on failure. */
sqlite3_stmt *queue_stmt(struct queue *q, enum queue_stmt_id id, struct err_detail *err);

/* Reset a statement after use and drop its bindings (borrowed strings are not kept). */
void queue_stmt_done(sqlite3_stmt *st);

/* What to do about a damaged file, appended to every corruption message (one %s: the path). */
#define QUEUE_CORRUPT_ADVICE                                                                       \
    "; restore it from a backup, or salvage what is left with `sqlite3 %s .recover` into a new "   \
    "file"

/* queue_sql_err for a connection that may not be a struct queue yet (db may be NULL, path too). */
enum status queue_sql_fail(sqlite3 *db, const char *path, int rc, const char *what,
                           struct err_detail *err);

/* Map an SQLite result code to a status and describe it in err as "what: sqlite message". */
enum status queue_sql_err(struct queue *q, int rc, const char *what, struct err_detail *err);

/* A row that breaks the schema's rules (NULL in a NOT NULL column, an unknown state): the
 * file is damaged. ST_ERR_FORMAT with "queue PATH is corrupt: what" and the remedy. */
enum status queue_bad_row(struct queue *q, const char *what, struct err_detail *err);

/* Step a statement that returns no rows, then queue_stmt_done it. */
enum status queue_step_done(struct queue *q, sqlite3_stmt *st, const char *what,
                            struct err_detail *err);

/* Bind a string or NULL. */
int queue_bind_str(sqlite3_stmt *st, int idx, const char *s);

/* Copy column col as a malloc'd string into *out (NULL for SQL NULL); ST_ERR_NOMEM. */
enum status queue_col_dup(sqlite3_stmt *st, int col, char **out, struct err_detail *err);

/* Open a write scope; close it with queue_scope_leave passing the status of the work done in
 * it: ST_OK commits (or releases the savepoint), anything else rolls back. Returns st, or the
 * commit's error. */
enum status queue_scope_enter(struct queue *q, struct queue_scope *sc, struct err_detail *err);
enum status queue_scope_leave(struct queue *q, struct queue_scope *sc, enum status st,
                              struct err_detail *err);

/* Run the write statement id with ?1 = a (and ?2 = b when it has a second parameter);
 * *changes (may be NULL) gets the rows it changed. */
enum status queue_run_changes(struct queue *q, enum queue_stmt_id id, int64_t a, int64_t b,
                              int64_t *changes, const char *what, struct err_detail *err);

/* Current state of a job; ST_ERR_NOT_FOUND if it does not exist. */
enum status queue_job_state_get(struct queue *q, int64_t job_id, enum queue_job_state *state,
                                struct err_detail *err);

/* Set run_id's ended = now, exit_reason and summary_json (both may be NULL) unless it has
 * ended already; run_id 0 is a no-op. Leases are the caller's business. */
enum status queue_run_mark_ended(struct queue *q, int64_t run_id, const char *exit_reason,
                                 const char *summary_json, struct err_detail *err);

/* ST_OK if run_id exists and has not ended, else ST_ERR_INVALID_ARG. */
enum status queue_run_check(struct queue *q, int64_t run_id, struct err_detail *err);

/* Set jobs with no queued or leased item to done: job_id, or all when 0. */
enum status queue_jobs_finish(struct queue *q, int64_t job_id, struct err_detail *err);

/* Parse a stored state/kind name; -1 if unknown. */
int queue_job_state_parse(const char *s);
int queue_item_state_parse(const char *s);
int queue_shard_kind_parse(const char *s);

#endif
