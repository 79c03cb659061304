/* The queue connection: open with pragmas and forward migrations, the prepared-statement cache,
 * write scopes (BEGIN IMMEDIATE or savepoint), the clock, and the job and run calls. Item,
 * lease and shard calls live in queue/lease.c and queue/shards.c. */
#include "queue/queue_internal.h"

#include "common/fault.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

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

static int64_t real_now_ms(void *ctx)
{
    (void)ctx;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t queue_now(struct queue *q)
{
    return q->now_ms(q->clock_ctx);
}

void queue_set_clock(struct queue *q, int64_t (*now_ms)(void *ctx), void *ctx)
{
    q->now_ms = now_ms ? now_ms : real_now_ms;
    q->clock_ctx = now_ms ? ctx : NULL;
}

/* What to do about a damaged file, appended to every corruption message. */
#define CORRUPT_ADVICE                                                                             \
    "; restore it from a backup, or salvage what is left with `sqlite3 %s .recover` into a new "   \
    "file"

/* queue_sql_err for a connection that may not be a struct queue yet (db may be NULL). */
static enum status sql_fail(sqlite3 *db, const char *path, int rc, const char *what,
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
        return err_set(err, st, "queue %s is corrupt (%s: %s)" CORRUPT_ADVICE, p, what, msg, p);
    if ((rc & 0xff) == SQLITE_NOTADB)
        return err_set(err, st,
                       "queue %s is not an SQLite database, or its header is destroyed (%s: %s)"
                       "; if it was a queue, restore it from a backup",
                       p, what, msg);
    return err_set(err, st, "%s: %s", what, msg);
}

enum status queue_sql_err(struct queue *q, int rc, const char *what, struct err_detail *err)
{
    return sql_fail(q ? q->db : NULL, q ? q->path : NULL, rc, what, err);
}

enum status queue_bad_row(struct queue *q, const char *what, struct err_detail *err)
{
    const char *p = q->path ? q->path : "(unknown)";
    return err_set(err, ST_ERR_FORMAT, "queue %s is corrupt (%s)" CORRUPT_ADVICE, p, what, p);
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

void queue_tx_rollback(struct queue *q)
{
    if (!q || !q->user_tx)
        return;
    q->user_tx = false;
    if (!sqlite3_get_autocommit(q->db))
        run_simple(q, QS_ROLLBACK, NULL);
}

/* ---- open / close ---------------------------------------------------------------------- */

static enum status exec(struct queue *q, const char *sql, const char *what, struct err_detail *err)
{
    int rc = sqlite3_exec(q->db, sql, NULL, NULL, NULL);
    return rc == SQLITE_OK ? ST_OK : queue_sql_err(q, rc, what, err);
}

static enum status read_user_version(struct queue *q, int *v, struct err_detail *err)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(q->db, "PRAGMA user_version", -1, &st, NULL);
    if (rc == SQLITE_OK) {
        rc = sqlite3_step(st);
        if (rc == SQLITE_ROW) {
            *v = sqlite3_column_int(st, 0);
            rc = SQLITE_OK;
        }
    }
    enum status s =
        rc == SQLITE_OK ? ST_OK : queue_sql_err(q, rc, "reading the schema version", err);
    sqlite3_finalize(st);
    return s;
}

static enum status refuse_newer(int v, struct err_detail *err)
{
    return err_set(err, ST_ERR_UNSUPPORTED,
                   "queue database has schema version %d, newer than this quern understands "
                   "(%d): it was written by a newer quern; use that version",
                   v, QUEUE_SCHEMA_VERSION);
}

/* Bring the schema to QUEUE_SCHEMA_VERSION in one transaction. The version is read again
 * under the write lock: another process may have migrated meanwhile. */
static enum status migrate(struct queue *q, struct err_detail *err)
{
    int v = 0;
    enum status st = read_user_version(q, &v, err);
    if (st != ST_OK)
        return st;
    if (v > QUEUE_SCHEMA_VERSION)
        return refuse_newer(v, err);
    if (v == QUEUE_SCHEMA_VERSION) {
        q->schema_version = v;
        return ST_OK;
    }
    if ((st = exec(q, "BEGIN IMMEDIATE", "locking the queue for migration", err)) != ST_OK)
        return st;
    st = read_user_version(q, &v, err);
    if (st == ST_OK && v > QUEUE_SCHEMA_VERSION)
        st = refuse_newer(v, err);
    for (size_t i = 0; st == ST_OK && i < queue_n_migrations; i++) {
        const struct queue_migration *m = &queue_migrations[i];
        if (m->version <= v)
            continue;
        char pragma[64];
        snprintf(pragma, sizeof(pragma), "PRAGMA user_version = %d", m->version);
        st = exec(q, m->sql, "migrating the queue schema", err);
        if (st == ST_OK)
            st = exec(q, pragma, "setting the schema version", err);
        if (st == ST_OK)
            v = m->version;
    }
    if (st == ST_OK)
        st = exec(q, "COMMIT", "committing the migration", err);
    if (st != ST_OK) {
        sqlite3_exec(q->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    q->schema_version = v;
    return ST_OK;
}

/* PRAGMA journal_mode (= WAL when set) into mode; the SQLite result code. */
static int journal_mode(struct queue *q, int set, char mode[16])
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(q->db, set ? "PRAGMA journal_mode = WAL" : "PRAGMA journal_mode",
                                -1, &st, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const unsigned char *m = sqlite3_column_text(st, 0);
        snprintf(mode, 16, "%s", m ? (const char *)m : "");
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    return rc;
}

static enum status set_pragmas(struct queue *q, const struct queue_options *opts,
                               struct err_detail *err)
{
    /* WAL is persistent: only switch when needed. The switch wants an exclusive lock, and
     * SQLite can report SQLITE_BUSY for it without calling the busy handler while other
     * processes open the same new file (deadlock avoidance): retry for the busy timeout,
     * re-reading the mode, which one of them may have switched meanwhile. */
    const int wait_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS;
    char mode[16] = "";
    int rc = SQLITE_OK;
    for (int waited = 0;; waited += 10) {
        rc = journal_mode(q, 0, mode);
        if (rc == SQLITE_OK && (!strcmp(mode, "wal") || !strcmp(mode, "memory")))
            break;
        if (rc == SQLITE_OK)
            rc = journal_mode(q, 1, mode);
        if (rc != SQLITE_OK && ((rc & 0xFF) == SQLITE_BUSY || (rc & 0xFF) == SQLITE_LOCKED) &&
            waited < wait_ms) {
            sqlite3_sleep(10);
            continue;
        }
        if (rc != SQLITE_OK)
            return queue_sql_err(q, rc, "switching the queue to WAL mode", err);
        if (strcmp(mode, "wal") != 0)
            return err_set(err, ST_ERR_UNSUPPORTED,
                           "queue: the database cannot use WAL mode here (journal mode \"%s\"); "
                           "put it on a local file system",
                           mode);
        break;
    }
    enum status s =
        exec(q, opts->sync_full ? "PRAGMA synchronous = FULL" : "PRAGMA synchronous = NORMAL",
             "setting synchronous", err);
    if (s == ST_OK)
        s = exec(q, "PRAGMA foreign_keys = ON", "enabling foreign keys", err);
    return s;
}

/* Absolute directory of the database file at path (malloc'd), from the working directory when
 * path is relative; NULL when out of memory. */
static char *db_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    size_t n = slash ? (size_t)(slash - path) : 0;
    if (slash && n == 0)
        return strdup("/");
    if (path[0] == '/')
        return strndup(path, n);
    char cwd[4096];
    if (!getcwd(cwd, sizeof(cwd)))
        snprintf(cwd, sizeof(cwd), ".");
    size_t len = strlen(cwd) + n + 2;
    char *d = malloc(len);
    if (d)
        snprintf(d, len, "%s%s%.*s", cwd, n ? "/" : "", (int)n, path);
    return d;
}

enum status queue_resolve_path(struct queue *q, const char *stored, char *out, size_t cap,
                               struct err_detail *err)
{
    int n = stored[0] == '/' ? snprintf(out, cap, "%s", stored)
                             : snprintf(out, cap, "%s/%s", q->dir, stored);
    if (n < 0 || (size_t)n >= cap)
        return err_set(err, ST_ERR_RANGE, "path too long: %.200s", stored);
    return ST_OK;
}

enum status queue_db_uuid(struct queue *q, char out[33], struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    out[0] = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_META_GET, err);
    if (!s)
        return err->status;
    queue_bind_str(s, 1, "db_uuid");
    int rc = sqlite3_step(s);
    enum status st = ST_OK;
    const unsigned char *v = rc == SQLITE_ROW ? sqlite3_column_text(s, 0) : NULL;
    if (v && strlen((const char *)v) == 32)
        memcpy(out, v, 33);
    else if (rc == SQLITE_ROW || rc == SQLITE_DONE)
        st = err_set(err, ST_ERR_FORMAT, "queue: the database has no valid db_uuid");
    else
        st = queue_sql_err(q, rc, "reading the database id", err);
    queue_stmt_done(s);
    return st;
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

/* ---- what kind of file and file system -------------------------------------------------- */

/* statfs f_type values (linux/magic.h and the file systems' own sources) of file systems where
 * SQLite's WAL cannot be trusted: its index (the -shm file) is shared memory, which every
 * process that opens the database maps, and mappings are not kept coherent across hosts. */
static const struct fs_magic {
    uint32_t magic;   /* statfs f_type */
    const char *name; /* file system name for messages */
    bool refuse;      /* true: network or cluster file system; false: maybe local (FUSE) */
} FS_MAGICS[] = {
    {0x00006969, "NFS", true},      {0x0000517B, "SMB", true},
    {0xFF534D42, "SMB/CIFS", true}, {0xFE534D42, "SMB2", true},
    {0x0BD00BD0, "Lustre", true},   {0x47504653, "GPFS", true},
    {0x00C36400, "CephFS", true},   {0x01021997, "9P", true},
    {0x5346414F, "AFS", true},      {0x6B414653, "AFS (kAFS)", true},
    {0x19830326, "BeeGFS", true},   {0x20030528, "OrangeFS/PVFS2", true},
    {0x65735546, "FUSE", false},
};

const char *queue_fs_kind(uint64_t magic, bool *refuse)
{
    if (refuse)
        *refuse = false;
    for (size_t i = 0; i < sizeof(FS_MAGICS) / sizeof(FS_MAGICS[0]); i++) {
        /* f_type is a signed word: on 32-bit hosts 0xFF534D42 arrives sign-extended */
        if (FS_MAGICS[i].magic == (uint32_t)magic) {
            if (refuse)
                *refuse = FS_MAGICS[i].refuse;
            return FS_MAGICS[i].name;
        }
    }
    return NULL;
}

/* Refuse a database whose directory is on a network or cluster file system; warn on FUSE.
 * A directory that cannot be examined is left to the open to report. */
static enum status check_fs(const char *path, struct err_detail *err)
{
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == dir)
        dir[1] = 0;
    else
        *slash = 0;
    uint64_t magic;
    const char *test = getenv("QUERN_TEST_FS_MAGIC"); /* test-only override, see queue.h */
    if (test && *test) {
        magic = strtoull(test, NULL, 0);
    } else {
        struct statfs sf;
        if (statfs(dir, &sf) != 0)
            return ST_OK;
        magic = (uint64_t)sf.f_type;
    }
    bool refuse = false;
    const char *kind = queue_fs_kind(magic, &refuse);
    if (!kind)
        return ST_OK;
    if (!refuse) {
        LOG_WARN("queue %s is on a %s file system: fine if the mount is local (or only this host "
                 "uses it), but SQLite's WAL does not work across hosts; on a shared mount put "
                 "the queue on node-local storage",
                 path, kind);
        return ST_OK;
    }
    return err_set(err, ST_ERR_UNSUPPORTED,
                   "queue %s is on a %s file system (%s): the queue uses SQLite's WAL mode, whose "
                   "index is shared memory that does not work across hosts, so concurrent runs "
                   "would corrupt it. Put the queue on node-local storage (local disk or /tmp), "
                   "one queue per Slurm array task",
                   path, kind, dir);
}

/* A read-only connection for inspecting a file before anything is written to it. */
struct peek {
    sqlite3 *db;      /* SQLITE_OPEN_READONLY connection, owned */
    const char *path; /* the file, borrowed */
};

/* Every table name except SQLite's own, comma-separated (shortened with "..."), and whether
 * the four tables every quern queue has are among them. */
static enum status peek_tables(struct peek *pk, char *names, size_t cap, bool *quern,
                               struct err_detail *err)
{
    static const char sql[] = "SELECT name FROM sqlite_master WHERE type = 'table'"
                              " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name";
    static const char *const ours[] = {"jobs", "items", "runs", "shards"};
    bool have[4] = {false, false, false, false};
    names[0] = 0;
    size_t len = 0;
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(pk->db, sql, -1, &st, NULL);
    while (st && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *n = (const char *)sqlite3_column_text(st, 0);
        if (!n)
            continue;
        for (int i = 0; i < 4; i++)
            have[i] = have[i] || strcmp(n, ours[i]) == 0;
        if (len + strlen(n) + 8 < cap)
            len += (size_t)snprintf(names + len, cap - len, "%s%s", len ? ", " : "", n);
        else if (len + 5 < cap && strcmp(names + len - 3, "...") != 0)
            len += (size_t)snprintf(names + len, cap - len, ", ...");
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return sql_fail(pk->db, pk->path, rc, "reading the schema", err);
    *quern = have[0] && have[1] && have[2] && have[3];
    return ST_OK;
}

/* PRAGMA quick_check: ST_OK on "ok", else ST_ERR_FORMAT with its first lines. */
static enum status peek_quick_check(struct peek *pk, struct err_detail *err)
{
    sqlite3_stmt *st = NULL;
    char lines[320] = "";
    size_t len = 0;
    int n = 0;
    int rc = sqlite3_prepare_v2(pk->db, "PRAGMA quick_check(4)", -1, &st, NULL);
    while (st && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *t = (const char *)sqlite3_column_text(st, 0);
        if (n++ == 0 && t && strcmp(t, "ok") == 0)
            continue;
        if (len + 4 < sizeof(lines))
            len += (size_t)snprintf(lines + len, sizeof(lines) - len, "%s%s", len ? "; " : "",
                                    t ? t : "?");
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return sql_fail(pk->db, pk->path, rc, "checking integrity", err);
    if (!lines[0])
        return ST_OK;
    return err_set(err, ST_ERR_FORMAT, "queue %s is corrupt: %s" CORRUPT_ADVICE, pk->path, lines,
                   pk->path);
}

/* Look at the file read-only and decide whether queue_open may change it: a missing or empty
 * database becomes a new queue, a queue is migrated, anything else is refused. Every refusal
 * leaves the file as it was, and every message names the path. */
static enum status inspect(const char *path, const struct queue_options *opts,
                           struct err_detail *err)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        if (errno != ENOENT)
            return err_set(err, ST_ERR_IO, "queue %s: %s", path, strerror(errno));
        if (opts->must_exist)
            return err_set(err, ST_ERR_NOT_FOUND, "queue %s does not exist", path);
        return ST_OK;
    }
    if (S_ISDIR(sb.st_mode))
        return err_set(err, ST_ERR_INVALID_ARG, "queue %s is a directory, not a database file",
                       path);
    if (S_ISREG(sb.st_mode) && sb.st_size == 0) {
        if (opts->must_exist)
            return err_set(err, ST_ERR_NOT_FOUND, "queue %s is an empty file, not a queue", path);
        return ST_OK;
    }
    struct peek pk = {NULL, path};
    int rc = sqlite3_open_v2(path, &pk.db, SQLITE_OPEN_READONLY, NULL);
    enum status st = ST_OK;
    if (rc != SQLITE_OK) {
        st = err_set(err, ST_ERR_IO, "opening queue %s: %s", path,
                     pk.db ? sqlite3_errmsg(pk.db) : sqlite3_errstr(rc));
        sqlite3_close(pk.db);
        return st;
    }
    sqlite3_extended_result_codes(pk.db, 1);
    sqlite3_busy_timeout(pk.db,
                         opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS);
    int v = 0;
    sqlite3_stmt *s = NULL;
    rc = sqlite3_prepare_v2(pk.db, "PRAGMA user_version", -1, &s, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        v = sqlite3_column_int(s, 0);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(s);
    char names[256];
    bool quern = false;
    if (rc != SQLITE_OK)
        st = sql_fail(pk.db, path, rc, "reading the schema version", err);
    else if (v > QUEUE_SCHEMA_VERSION)
        st = refuse_newer(v, err);
    else
        st = peek_tables(&pk, names, sizeof(names), &quern, err);
    if (st == ST_OK && ((v == 0 && names[0]) || (v > 0 && !quern)))
        st = err_set(err, ST_ERR_FORMAT,
                     "queue %s is an SQLite database but not a quern queue (user_version %d, "
                     "tables: %s); refusing to change it",
                     path, v, names[0] ? names : "none");
    if (st == ST_OK && v == 0 && opts->must_exist)
        st = err_set(err, ST_ERR_NOT_FOUND, "queue %s is an empty database, not a queue yet", path);
    if (st == ST_OK && opts->check_integrity)
        st = peek_quick_check(&pk, err);
    sqlite3_close(pk.db);
    return st;
}

enum status queue_open_opts(struct queue **out, const char *path, const struct queue_options *opts,
                            struct err_detail *err)
{
    *out = NULL;
    struct queue_options def = {0};
    if (!opts)
        opts = &def;
    /* Nothing below may create or change the file until the checks have passed. */
    enum status st = check_fs(path, err);
    if (st == ST_OK)
        st = inspect(path, opts, err);
    if (st != ST_OK)
        return st;
    struct queue *q = calloc(1, sizeof(*q));
    if (!q || !(q->path = strdup(path))) {
        free(q);
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory");
    }
    q->now_ms = real_now_ms;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if ((q->dir = db_dir(path)) != NULL &&
        (q->file = malloc(strlen(q->dir) + strlen(base) + 2)) != NULL)
        sprintf(q->file, "%s/%s", strcmp(q->dir, "/") ? q->dir : "", base);
    if (!q->file) {
        free(q->dir);
        free(q->path);
        free(q);
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory");
    }
    int flags = SQLITE_OPEN_READWRITE | (opts->must_exist ? 0 : SQLITE_OPEN_CREATE);
    int rc = sqlite3_open_v2(path, &q->db, flags, NULL);
    if (rc != SQLITE_OK) {
        st = err_set(err, ST_ERR_IO, "opening queue %s: %s", path,
                     q->db ? sqlite3_errmsg(q->db) : sqlite3_errstr(rc));
        goto fail;
    }
    sqlite3_extended_result_codes(q->db, 1);
    sqlite3_busy_timeout(q->db,
                         opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS);
    if ((st = set_pragmas(q, opts, err)) != ST_OK)
        goto fail;
    if ((st = migrate(q, err)) != ST_OK)
        goto fail;
    *out = q;
    return ST_OK;
fail:
    if (err && !strstr(err->msg, path))
        err_prefix(err, "queue %s", path);
    queue_close(q);
    return st;
}

enum status queue_open(struct queue **out, const char *path, struct err_detail *err)
{
    return queue_open_opts(out, path, NULL, err);
}

void queue_close(struct queue *q)
{
    if (!q)
        return;
    for (int i = 0; i < QS_COUNT; i++)
        sqlite3_finalize(q->stmts[i]);
    if (q->db && !sqlite3_get_autocommit(q->db))
        sqlite3_exec(q->db, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close(q->db);
    free(q->dir);
    free(q->file);
    free(q->path);
    free(q);
}

const char *queue_db_path(const struct queue *q)
{
    return q->file;
}

int queue_schema_version(struct queue *q)
{
    return q->schema_version;
}

/* ---- jobs ------------------------------------------------------------------------------ */

/* Names become directory names: [A-Za-z0-9._-]{1,128}, no leading '.', not all digits (so
 * that queue_job_find can tell names from ids). */
static enum status check_job_name(const char *name, struct err_detail *err)
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
    enum status st = check_job_name(spec->name, err);
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

enum status queue_job_cancel(struct queue *q, int64_t job_id, int64_t *n_cancelled,
                             struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_cancelled)
        *n_cancelled = 0;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    enum queue_job_state js;
    int64_t now = queue_now(q), changed = 0;
    st = queue_job_state_get(q, job_id, &js, err);
    if (st == ST_OK && (js == QUEUE_JOB_QUEUED || js == QUEUE_JOB_RUNNING)) {
        sqlite3_stmt *s = queue_stmt(q, QS_JOB_CANCEL_ITEMS, err);
        st = s ? ST_OK : err->status;
        if (st == ST_OK) {
            sqlite3_bind_int64(s, 1, job_id);
            sqlite3_bind_int64(s, 2, now);
            st = queue_step_done(q, s, "cancelling items", err);
            changed = sqlite3_changes(q->db);
        }
        if (st == ST_OK && (s = queue_stmt(q, QS_JOB_CANCEL, err)) == NULL)
            st = err->status;
        if (st == ST_OK) {
            sqlite3_bind_int64(s, 1, job_id);
            sqlite3_bind_int64(s, 2, now);
            st = queue_step_done(q, s, "cancelling job", err);
        }
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_cancelled)
        *n_cancelled = changed;
    return st;
}

enum status queue_job_retry_failed(struct queue *q, int64_t job_id, int64_t *n_retried,
                                   struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_retried)
        *n_retried = 0;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    enum queue_job_state js;
    int64_t changed = 0;
    st = queue_job_state_get(q, job_id, &js, err);
    if (st == ST_OK && js == QUEUE_JOB_CANCELLED)
        st = err_set(err, ST_ERR_INVALID_ARG, "job %lld is cancelled; nothing can be retried",
                     (long long)job_id);
    /* superseded counts first: they look at items still failed and pointing at the shard */
    static const enum queue_stmt_id steps[] = {QS_JOB_RETRY_SHARDS, QS_JOB_RETRY_ITEMS,
                                               QS_JOB_REOPEN};
    for (size_t i = 0; st == ST_OK && i < sizeof(steps) / sizeof(steps[0]); i++) {
        sqlite3_stmt *s = queue_stmt(q, steps[i], err);
        if (!s) {
            st = err->status;
            break;
        }
        sqlite3_bind_int64(s, 1, job_id);
        st = queue_step_done(q, s, "retrying failed items", err);
        if (steps[i] == QS_JOB_RETRY_ITEMS)
            changed = sqlite3_changes(q->db);
        if (steps[i] == QS_JOB_RETRY_ITEMS && changed == 0)
            break; /* nothing failed: the job keeps its state */
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_retried)
        *n_retried = changed;
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

/* ---- runs ------------------------------------------------------------------------------ */

enum status queue_run_start(struct queue *q, const struct queue_run_spec *spec, int64_t *run_id,
                            struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *run_id = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_INSERT, err);
    if (!s)
        return err->status;
    if (spec->job_id)
        sqlite3_bind_int64(s, 1, spec->job_id);
    else
        sqlite3_bind_null(s, 1);
    queue_bind_str(s, 2, spec->worker_id);
    queue_bind_str(s, 3, spec->host);
    sqlite3_bind_int64(s, 4, spec->pid);
    sqlite3_bind_int64(s, 5, queue_now(q));
    queue_bind_str(s, 6, spec->boot_id);
    queue_bind_str(s, 7, spec->pid_ns);
    if (spec->pstart > 0)
        sqlite3_bind_int64(s, 8, spec->pstart);
    else
        sqlite3_bind_null(s, 8);
    queue_bind_str(s, 9, spec->submit ? "submit" : "run");
    enum status st = queue_step_done(q, s, "recording a run", err);
    if (st == ST_OK && sqlite3_changes(q->db) == 0) { /* the job is missing or not ready */
        enum queue_job_state js;
        st = queue_job_state_get(q, spec->job_id, &js, err);
        if (st == ST_OK)
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "run for job %lld: the job is still being submitted",
                         (long long)spec->job_id);
        else if (st == ST_ERR_NOT_FOUND)
            err_set(err, st, "run for job %lld: no such job", (long long)spec->job_id);
        return st;
    }
    if (st == ST_OK)
        *run_id = sqlite3_last_insert_rowid(q->db);
    return st;
}

enum status queue_run_check(struct queue *q, int64_t run_id, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_ENDED, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    int rc = sqlite3_step(s);
    enum status st = ST_OK;
    if (rc == SQLITE_ROW) {
        if (sqlite3_column_int(s, 0))
            st = err_set(err, ST_ERR_INVALID_ARG, "run %lld has ended", (long long)run_id);
    } else if (rc == SQLITE_DONE) {
        st = err_set(err, ST_ERR_INVALID_ARG, "no run with id %lld", (long long)run_id);
    } else {
        st = queue_sql_err(q, rc, "reading a run", err);
    }
    queue_stmt_done(s);
    return st;
}

enum status queue_run_end(struct queue *q, int64_t run_id, const char *exit_reason,
                          const char *summary_json, int64_t *n_requeued, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_requeued)
        *n_requeued = 0;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t requeued = 0;
    st = queue_run_check(q, run_id, err);
    sqlite3_stmt *s = NULL;
    if (st == ST_OK && (s = queue_stmt(q, QS_LEASE_REQUEUE_RUN, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, run_id);
        st = queue_step_done(q, s, "requeueing the run's leases", err);
        requeued = sqlite3_changes(q->db);
    }
    if (st == ST_OK && (s = queue_stmt(q, QS_RUN_END, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, run_id);
        sqlite3_bind_int64(s, 2, queue_now(q));
        queue_bind_str(s, 3, exit_reason);
        queue_bind_str(s, 4, summary_json);
        st = queue_step_done(q, s, "ending the run", err);
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_requeued)
        *n_requeued = requeued;
    return st;
}

enum status queue_run_mark_ended(struct queue *q, int64_t run_id, const char *exit_reason,
                                 const char *summary_json, struct err_detail *err)
{
    if (!run_id)
        return ST_OK;
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_END, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    sqlite3_bind_int64(s, 2, queue_now(q));
    queue_bind_str(s, 3, exit_reason);
    queue_bind_str(s, 4, summary_json);
    return queue_step_done(q, s, "ending a run", err);
}

/* End one run found dead: its leases go back to queued (attempts kept), ended = now. */
static enum status end_dead_run(struct queue *q, int64_t run_id, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_LEASE_REQUEUE_RUN, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    enum status st = queue_step_done(q, s, "requeueing a dead run's leases", err);
    return st == ST_OK ? queue_run_mark_ended(q, run_id, "dead", NULL, err) : st;
}

enum status queue_reap_dead(struct queue *q, const struct proc_identity *self, int64_t *n_reaped,
                            struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_reaped)
        *n_reaped = 0;
    if (!self->host[0])
        return ST_OK;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t dead[64];
    size_t n_dead = 0;
    int64_t total = 0;
    bool more = true;
    while (st == ST_OK && more) { /* batches of 64: ids are collected before any update */
        more = false;
        n_dead = 0;
        sqlite3_stmt *s = queue_stmt(q, QS_RUN_ACTIVE, err);
        if (!s) {
            st = err->status;
            break;
        }
        queue_bind_str(s, 1, self->host);
        int rc;
        while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
            struct proc_identity other;
            memset(&other, 0, sizeof(other));
            const unsigned char *t;
            if ((t = sqlite3_column_text(s, 1)))
                snprintf(other.host, sizeof(other.host), "%s", (const char *)t);
            if ((t = sqlite3_column_text(s, 2)))
                snprintf(other.boot_id, sizeof(other.boot_id), "%s", (const char *)t);
            if ((t = sqlite3_column_text(s, 3)))
                snprintf(other.pid_ns, sizeof(other.pid_ns), "%s", (const char *)t);
            other.pid = sqlite3_column_int64(s, 4);
            other.start_ticks = sqlite3_column_int64(s, 5);
            if (proc_liveness(self, &other) != PROC_DEAD)
                continue;
            if (n_dead == sizeof(dead) / sizeof(dead[0])) {
                more = true;
                break;
            }
            dead[n_dead++] = sqlite3_column_int64(s, 0);
        }
        if (rc != SQLITE_ROW && rc != SQLITE_DONE)
            st = queue_sql_err(q, rc, "listing active runs", err);
        queue_stmt_done(s);
        for (size_t i = 0; st == ST_OK && i < n_dead; i++)
            st = end_dead_run(q, dead[i], err);
        total += (int64_t)n_dead;
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_reaped)
        *n_reaped = total;
    return st;
}

/* Heartbeat (with progress_json when id is QS_RUN_PROGRESS); a run that has ended or is missing
 * is an error, see queue_run_heartbeat. */
static enum status run_touch(struct queue *q, enum queue_stmt_id id, int64_t run_id,
                             const char *progress_json, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, id, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    sqlite3_bind_int64(s, 2, queue_now(q));
    if (id == QS_RUN_PROGRESS)
        queue_bind_str(s, 3, progress_json);
    enum status st = queue_step_done(q, s, "heartbeat", err);
    if (st != ST_OK || sqlite3_changes(q->db) > 0)
        return st;
    /* no row changed: the run is missing, or it has ended */
    if ((s = queue_stmt(q, QS_RUN_ENDED, err)) == NULL)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    int rc = sqlite3_step(s);
    if (rc == SQLITE_ROW)
        st = err_set(err, ST_ERR_CONFLICT, "run %lld has ended (another process took it for dead)",
                     (long long)run_id);
    else if (rc == SQLITE_DONE)
        st = err_set(err, ST_ERR_INVALID_ARG, "no run with id %lld", (long long)run_id);
    else
        st = queue_sql_err(q, rc, "reading a run", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_run_heartbeat(struct queue *q, int64_t run_id, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    return run_touch(q, QS_RUN_HEARTBEAT, run_id, NULL, err);
}

enum status queue_run_progress(struct queue *q, int64_t run_id, const char *progress_json,
                               struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    return run_touch(q, QS_RUN_PROGRESS, run_id, progress_json, err);
}

void queue_run_info_free(struct queue_run_info *runs, size_t n)
{
    for (size_t i = 0; runs && i < n; i++) {
        free(runs[i].worker_id);
        free(runs[i].host);
        free(runs[i].progress_json);
    }
    free(runs);
}

enum status queue_run_list_live(struct queue *q, struct queue_run_info **runs, size_t *n,
                                struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *runs = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_LIST_LIVE, err);
    if (!s)
        return err->status;
    int64_t now = queue_now(q);
    struct queue_run_info *a = NULL;
    size_t cnt = 0, cap = 0;
    enum status st = ST_OK;
    int rc = SQLITE_DONE;
    while (st == ST_OK && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (cnt == cap) {
            size_t nc = cap ? cap * 2 : 8;
            struct queue_run_info *na = realloc(a, sizeof(*na) * nc);
            if (!na) {
                st = err_set(err, ST_ERR_NOMEM, "out of memory listing runs");
                break;
            }
            a = na;
            cap = nc;
        }
        struct queue_run_info *r = &a[cnt++];
        memset(r, 0, sizeof(*r));
        r->id = sqlite3_column_int64(s, 0);
        r->job_id = sqlite3_column_int64(s, 1);
        r->pid = sqlite3_column_int64(s, 4);
        r->started_ms = sqlite3_column_int64(s, 5);
        r->heartbeat_ms = sqlite3_column_int64(s, 6);
        r->age_ms = now > r->heartbeat_ms ? now - r->heartbeat_ms : 0;
        if ((st = queue_col_dup(s, 2, &r->worker_id, err)) == ST_OK &&
            (st = queue_col_dup(s, 3, &r->host, err)) == ST_OK)
            st = queue_col_dup(s, 7, &r->progress_json, err);
    }
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "listing live runs", err);
    queue_stmt_done(s);
    if (st != ST_OK) {
        queue_run_info_free(a, cnt);
        return st;
    }
    *runs = a;
    *n = cnt;
    return ST_OK;
}
