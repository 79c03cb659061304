/* Opening and closing a queue: file-system and file checks before anything is written, pragmas
 * and forward migrations, the database's location and id, and the clock. */
#include "queue/queue_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

/* ---- clock ----------------------------------------------------------------------------- */

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
        int rc = queue_migration_apply(q->db, m);
        if (rc != SQLITE_OK)
            st = queue_sql_err(q, rc, "migrating the queue schema", err);
        else
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

/* PRAGMA journal_mode (= set, when not NULL) into mode; the SQLite result code. */
static int journal_mode(struct queue *q, const char *set, char mode[16])
{
    char sql[64];
    snprintf(sql, sizeof(sql), "PRAGMA journal_mode%s%s", set ? " = " : "", set ? set : "");
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(q->db, sql, -1, &st, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const unsigned char *m = sqlite3_column_text(st, 0);
        snprintf(mode, 16, "%s", m ? (const char *)m : "");
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    return rc;
}

/* The busy handler: wait in steps of at most 10 ms (SQLite's own handler's steps, without its
 * longer ones) until the busy timeout has passed, or at once stop when the interrupt is set. */
static int busy_wait(void *arg, int count)
{
    static const int steps[] = {1, 2, 5, 10};
    const struct queue *q = arg;
    if (q->interrupt && *q->interrupt)
        return 0;
    /* waited so far: the steps before this one */
    int64_t waited =
        count <= 4 ? (int64_t[]){0, 1, 3, 8, 18}[count] : 18 + 10 * (int64_t)(count - 4);
    if (waited >= q->busy_ms)
        return 0;
    sqlite3_sleep(steps[count < 4 ? count : 3]);
    return 1;
}

void queue_set_interrupt(struct queue *q, const volatile sig_atomic_t *flag)
{
    if (q)
        q->interrupt = flag;
}

/* A part: rollback journal, and the write lock taken now and kept (locking_mode EXCLUSIVE
 * keeps every lock a connection gets until it closes). */
static enum status set_exclusive(struct queue *q, struct err_detail *err)
{
    char mode[16] = "";
    enum status st = exec(q, "PRAGMA locking_mode = EXCLUSIVE", "setting exclusive locking", err);
    if (st)
        return st;
    int rc = journal_mode(q, NULL, mode);
    if (rc == SQLITE_OK && strcmp(mode, "delete") != 0)
        rc = journal_mode(q, "DELETE", mode);
    if (rc != SQLITE_OK)
        return queue_sql_err(q, rc, "switching the queue to a rollback journal", err);
    if (strcmp(mode, "delete") != 0 && strcmp(mode, "memory") != 0)
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "queue: the database cannot use a rollback journal here (journal mode "
                       "\"%s\")",
                       mode);
    if ((st = exec(q, "BEGIN EXCLUSIVE", "locking the queue", err)) != ST_OK)
        return st;
    return exec(q, "COMMIT", "locking the queue", err);
}

static enum status set_pragmas(struct queue *q, const struct queue_options *opts,
                               struct err_detail *err)
{
    if (opts->exclusive) {
        enum status st = set_exclusive(q, err);
        q->exclusive = st == ST_OK;
        if (st == ST_OK)
            st = exec(q,
                      opts->sync_full ? "PRAGMA synchronous = FULL" : "PRAGMA synchronous = NORMAL",
                      "setting synchronous", err);
        if (st == ST_OK)
            st = exec(q, "PRAGMA foreign_keys = ON", "enabling foreign keys", err);
        return st;
    }
    /* WAL is persistent: only switch when needed. The switch wants an exclusive lock, and
     * SQLite can report SQLITE_BUSY for it without calling the busy handler while other
     * processes open the same new file (deadlock avoidance): retry for the busy timeout,
     * re-reading the mode, which one of them may have switched meanwhile. */
    const int wait_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS;
    char mode[16] = "";
    int rc = SQLITE_OK;
    for (int waited = 0;; waited += 10) {
        rc = journal_mode(q, NULL, mode);
        if (rc == SQLITE_OK && (!strcmp(mode, "wal") || !strcmp(mode, "memory")))
            break;
        if (rc == SQLITE_OK)
            rc = journal_mode(q, "WAL", mode);
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

enum status queue_meta_get(struct queue *q, const char *key, char *out, size_t cap, bool *found,
                           struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (cap)
        out[0] = 0;
    *found = false;
    sqlite3_stmt *s = queue_stmt(q, QS_META_GET, err);
    if (!s)
        return err->status;
    queue_bind_str(s, 1, key);
    int rc = sqlite3_step(s);
    const unsigned char *v = rc == SQLITE_ROW ? sqlite3_column_text(s, 0) : NULL;
    if (v && cap)
        snprintf(out, cap, "%s", (const char *)v);
    *found = v != NULL;
    enum status st = rc == SQLITE_ROW || rc == SQLITE_DONE
                         ? ST_OK
                         : queue_sql_err(q, rc, "reading the database's facts", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_meta_set(struct queue *q, const char *key, const char *value,
                           struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    sqlite3_stmt *s = queue_stmt(q, QS_META_SET, err);
    if (!s)
        return err->status;
    queue_bind_str(s, 1, key);
    queue_bind_str(s, 2, value);
    return queue_step_done(q, s, "writing the database's facts", err);
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
 * A directory that cannot be examined is left to the open to report. An exclusive file (a
 * part) uses no shared memory and holds its lock throughout, so it is fine on either. */
static enum status check_fs(const char *path, const struct queue_options *opts,
                            struct err_detail *err)
{
    if (opts->exclusive)
        return ST_OK;
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
        return queue_sql_fail(pk->db, pk->path, rc, "reading the schema", err);
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
        return queue_sql_fail(pk->db, pk->path, rc, "checking integrity", err);
    if (!lines[0])
        return ST_OK;
    return err_set(err, ST_ERR_FORMAT, "queue %s is corrupt: %s" QUEUE_CORRUPT_ADVICE, pk->path,
                   lines, pk->path);
}

/* A part of a partitioned queue (meta 'part' set) opened as a plain queue: refused, since
 * switching it to WAL would break the promise that one process at a time uses it. */
static enum status peek_part(struct peek *pk, struct err_detail *err)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(pk->db, "SELECT value FROM meta WHERE key = 'part'", -1, &st, NULL);
    char part[32] = "";
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const unsigned char *v = sqlite3_column_text(st, 0);
        snprintf(part, sizeof(part), "%s", v ? (const char *)v : "?");
        rc = SQLITE_DONE;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return queue_sql_fail(pk->db, pk->path, rc, "reading the database's facts", err);
    if (!part[0])
        return ST_OK;
    return err_set(err, ST_ERR_INVALID_ARG,
                   "queue %s is part %s of a partitioned queue: give its directory as --db "
                   "(with --part for a run)",
                   pk->path, part);
}

/* Open the file with FLAGS (never creating it), begin one read transaction and read the
 * schema version: one read transaction around every read of inspect(), since another process
 * may be creating this queue right now (its migration commits tables and version together),
 * and a version read before that commit with tables read after it would look like a foreign
 * database. Returns the SQLite code (extended); pk->db is left open, its transaction too, and
 * is NULL when the open failed. */
static int peek_begin(struct peek *pk, int flags, const struct queue_options *opts, int *v)
{
    int rc = sqlite3_open_v2(pk->path, &pk->db, flags, NULL);
    if (rc != SQLITE_OK) {
        if (pk->db)
            rc = sqlite3_extended_errcode(pk->db);
        sqlite3_close(pk->db);
        pk->db = NULL;
        return rc;
    }
    sqlite3_extended_result_codes(pk->db, 1);
    sqlite3_busy_timeout(pk->db,
                         opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS);
    sqlite3_stmt *s = NULL;
    rc = sqlite3_exec(pk->db, "BEGIN", NULL, NULL, NULL);
    if (rc == SQLITE_OK)
        rc = sqlite3_prepare_v2(pk->db, "PRAGMA user_version", -1, &s, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        *v = sqlite3_column_int(s, 0);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(s);
    return rc;
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
    int v = 0;
    int rc = peek_begin(&pk, SQLITE_OPEN_READONLY, opts, &v);
    if (rc == SQLITE_READONLY_ROLLBACK) {
        /* A hot journal: a process was killed in the middle of writing this file (a part, on
         * the rollback journal). Reading it means rolling that transaction back first, which
         * SQLite does on the first read of a connection allowed to write; the file then holds
         * its last committed state, which is what every reader must see. */
        sqlite3_close(pk.db);
        pk.db = NULL;
        rc = peek_begin(&pk, SQLITE_OPEN_READWRITE, opts, &v);
    }
    if (!pk.db)
        return err_set(err, ST_ERR_IO, "opening queue %s: %s", path, sqlite3_errstr(rc));
    enum status st = ST_OK;
    char names[256];
    bool quern = false;
    if (rc == SQLITE_READONLY_ROLLBACK)
        st = err_set(err, ST_ERR_IO,
                     "queue %s holds a transaction interrupted by a killed process (a hot "
                     "journal, %s-journal); rolling it back needs write access to the file and "
                     "its directory",
                     path, path);
    else if (rc != SQLITE_OK)
        st = queue_sql_fail(pk.db, path, rc, "reading the schema version", err);
    else if (v > QUEUE_SCHEMA_VERSION)
        st = refuse_newer(v, err);
    else
        st = peek_tables(&pk, names, sizeof(names), &quern, err);
    if (st == ST_OK && ((v == 0 && names[0]) || (v > 0 && !quern)))
        st = err_set(err, ST_ERR_FORMAT,
                     "queue %s is an SQLite database but not a quern queue (user_version %d, "
                     "tables: %s); refusing to change it",
                     path, v, names[0] ? names : "none");
    if (st == ST_OK && v >= 2 && !opts->exclusive)
        st = peek_part(&pk, err);
    if (st == ST_OK && v == 0 && opts->must_exist)
        st = err_set(err, ST_ERR_NOT_FOUND, "queue %s is an empty database, not a queue yet", path);
    if (st == ST_OK && opts->check_integrity)
        st = peek_quick_check(&pk, err);
    if (!sqlite3_get_autocommit(pk.db))
        sqlite3_exec(pk.db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close(pk.db);
    return st;
}

/* An exclusive file that stayed locked is in use: say so plainly. */
static enum status busy_in_use(enum status st, const char *path, const struct queue_options *opts,
                               struct err_detail *err)
{
    if (st != ST_ERR_BUSY || !opts->exclusive)
        return st;
    return err_set(err, ST_ERR_BUSY,
                   "queue %s is in use by another process (a part is used by one process at a "
                   "time)",
                   path);
}

/* Whether the file system holding path's directory is mounted read-only. */
static bool on_read_only_fs(const char *path)
{
    char *dir = db_dir(path);
    struct statvfs sv;
    bool ro = dir && statvfs(dir, &sv) == 0 && (sv.f_flag & ST_RDONLY);
    free(dir);
    return ro;
}

/* A side file of the queue (suffix "-wal", "-journal") that holds bytes: commits or a killed
 * transaction that the database file alone lacks. */
static bool side_file_used(const char *path, const char *suffix)
{
    char side[4200];
    struct stat sb;
    snprintf(side, sizeof(side), "%s%s", path, suffix);
    return stat(side, &sb) == 0 && sb.st_size > 0;
}

/* Open the queue on a read-only file system as it is stored (queue_options.read_only_ok): an
 * SQLite URI with immutable=1, which reads no WAL and writes nothing; so refused when a WAL or
 * a journal holds what the file lacks. Fills q->db and q->schema_version. */
static enum status open_read_only(struct queue *q, const char *path, const char *real,
                                  struct err_detail *err)
{
    struct stat sb;
    if (stat(real, &sb) != 0)
        return err_set(err, errno == ENOENT ? ST_ERR_NOT_FOUND : ST_ERR_IO, "queue %s: %s", path,
                       errno == ENOENT ? "does not exist" : strerror(errno));
    if (!S_ISREG(sb.st_mode) || sb.st_size == 0)
        return err_set(err, ST_ERR_NOT_FOUND, "queue %s is not a queue (%s)", path,
                       S_ISREG(sb.st_mode) ? "an empty file" : "not a regular file");
    for (int i = 0; i < 2; i++)
        if (side_file_used(real, i ? "-journal" : "-wal"))
            return err_set(err, ST_ERR_IO,
                           "queue %s is on a read-only file system, and %s%s holds %s the "
                           "database file lacks: reading it needs writing; copy the queue with "
                           "its %s file to writable storage (or mount it writable) to read it",
                           path, real, i ? "-journal" : "-wal",
                           i ? "a transaction interrupted by a killed process" : "commits",
                           i ? "-journal" : "-wal");
    /* file: URI: the path's '%', '?' and '#' escaped */
    size_t len = strlen(real);
    char *uri = malloc(3 * len + 32);
    if (!uri)
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory");
    char *o = uri + sprintf(uri, "file:");
    for (const char *c = real; *c; c++)
        o += (*c == '%' || *c == '?' || *c == '#') ? sprintf(o, "%%%02X", (unsigned char)*c)
                                                   : (*o = *c, 1);
    strcpy(o, "?immutable=1");
    int rc = sqlite3_open_v2(uri, &q->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, NULL);
    free(uri);
    if (rc != SQLITE_OK)
        return err_set(err, ST_ERR_IO, "opening queue %s read-only: %s", path,
                       q->db ? sqlite3_errmsg(q->db) : sqlite3_errstr(rc));
    sqlite3_extended_result_codes(q->db, 1);
    int v = 0;
    enum status st = read_user_version(q, &v, err);
    struct peek pk = {q->db, path};
    char names[256];
    bool quern = false;
    if (st == ST_OK && v > QUEUE_SCHEMA_VERSION)
        st = refuse_newer(v, err);
    if (st == ST_OK)
        st = peek_tables(&pk, names, sizeof(names), &quern, err);
    if (st == ST_OK && (v == 0 || !quern))
        st = err_set(err, ST_ERR_FORMAT,
                     "queue %s is an SQLite database but not a quern queue (user_version %d, "
                     "tables: %s)",
                     path, v, names[0] ? names : "none");
    if (st == ST_OK && v < QUEUE_READ_ONLY_MIN_VERSION)
        st = err_set(err, ST_ERR_UNSUPPORTED,
                     "queue %s has schema version %d, older than this quern reads without "
                     "upgrading it (%d), and is on a read-only file system: the upgrade writes, so "
                     "copy it to writable storage to read it",
                     path, v, QUEUE_READ_ONLY_MIN_VERSION);
    if (st == ST_OK && sqlite3_exec(q->db, "PRAGMA query_only = 1", NULL, NULL, NULL) != SQLITE_OK)
        st = queue_sql_err(q, sqlite3_extended_errcode(q->db), "opening read-only", err);
    q->schema_version = v;
    q->read_only = st == ST_OK;
    return st;
}

bool queue_read_only(const struct queue *q)
{
    return q->read_only;
}

enum status queue_open_opts(struct queue **out, const char *path, const struct queue_options *opts,
                            struct err_detail *err)
{
    *out = NULL;
    struct queue_options def = {0};
    if (!opts)
        opts = &def;
    if (!path || !*path)
        return err_set(err, ST_ERR_INVALID_ARG, "the queue's path (--db) is empty");
    /* Nothing below may create or change the file until the checks have passed. */
    /* (of the file itself: a symbolic link's own directory may be writable, or read-only) */
    char *real = realpath(path, NULL);
    const bool ro_fs = on_read_only_fs(real ? real : path), ro = ro_fs && opts->read_only_ok;
    if (!ro)
        free(real);
    if (ro_fs && !ro)
        return err_set(err, ST_ERR_IO,
                       "queue %s is on a read-only file system: this command writes the queue "
                       "(status, export and report read a queue there as it is stored)",
                       path);
    enum status st = ro ? ST_OK : check_fs(path, opts, err);
    if (st == ST_OK && !ro)
        st = inspect(path, opts, err);
    if (st != ST_OK)
        return busy_in_use(st, path, opts, err);
    struct queue *q = calloc(1, sizeof(*q));
    if (!q || !(q->path = strdup(path))) {
        free(q);
        if (ro)
            free(real);
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory");
    }
    q->now_ms = real_now_ms;
    q->job_batch = QUEUE_JOB_BATCH;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if ((q->dir = db_dir(path)) != NULL &&
        (q->file = malloc(strlen(q->dir) + strlen(base) + 2)) != NULL)
        sprintf(q->file, "%s/%s", strcmp(q->dir, "/") ? q->dir : "", base);
    if (!q->file) {
        free(q->dir);
        free(q->path);
        free(q);
        if (ro)
            free(real);
        return err_set(err, ST_ERR_NOMEM, "queue: out of memory");
    }
    if (ro) {
        q->busy_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS;
        /* (the file itself, its side files beside it: not beside a symbolic link to it) */
        st = open_read_only(q, path, real ? real : path, err);
        free(real);
        if (st != ST_OK)
            goto fail;
        *out = q;
        return ST_OK;
    }
    int flags = SQLITE_OPEN_READWRITE | (opts->must_exist ? 0 : SQLITE_OPEN_CREATE);
    int rc = sqlite3_open_v2(path, &q->db, flags, NULL);
    if (rc != SQLITE_OK) {
        const int e = q->db ? sqlite3_system_errno(q->db) : 0;
        st = err_set(err, ST_ERR_IO, "opening queue %s: %s%s", path,
                     q->db ? sqlite3_errmsg(q->db) : sqlite3_errstr(rc),
                     e == EMFILE || e == ENFILE
                         ? ": too many open files (raise `ulimit -n`: each part of a "
                           "partitioned queue holds two)"
                         : "");
        goto fail;
    }
    sqlite3_extended_result_codes(q->db, 1);
    q->busy_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : QUEUE_DEFAULT_BUSY_MS;
    q->interrupt = opts->interrupt;
    sqlite3_busy_handler(q->db, busy_wait, q);
    if ((st = set_pragmas(q, opts, err)) != ST_OK)
        goto fail;
    if ((st = migrate(q, err)) != ST_OK)
        goto fail;
    *out = q;
    return ST_OK;
fail:
    st = busy_in_use(st, path, opts, err);
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
