/* Unit tests for queue/ files and jobs: schema creation, migration and the newer-version
 * refusal; the files queue_open refuses unchanged (not a queue, missing with must_exist,
 * corrupt with check_integrity, on a network file system) and damaged rows read as errors;
 * exclusive files (parts of a partitioned queue), and one a killed writer left a hot journal in;
 * items and duplicate custom_ids; and jobs being submitted: invisible to runs until
 * published, discarded in batches, collected when their submit died. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <limits.h>
#include <sys/stat.h>

#include <time.h>

#include "common/sha256.h"
#include "tests/test_queue_util.h"
#include "tests/test_util.h"

static void sql_exec(const char *path, const char *sql)
{
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        fail_msg("%s: %s", sql, msg);
    sqlite3_close(db);
}

/* ---- open, migrate, reopen ----------------------------------------------------------------- */

static void test_create_reopen(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION);
    int64_t job = make_job(q, "alpha", 3);
    queue_close(q);
    assert_int_equal(sql_int(f->path, "PRAGMA user_version"), QUEUE_SCHEMA_VERSION);

    /* journal mode is persistent WAL */
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(st, 0), "wal");
    sqlite3_finalize(st);
    sqlite3_close(db);

    q = open_q(f);
    struct queue_job j;
    assert_int_equal(queue_job_find(q, "alpha", &j, &err), ST_OK);
    assert_int_equal(j.id, job);
    assert_int_equal(j.n_items, 3);
    assert_int_equal(j.state, QUEUE_JOB_QUEUED);
    assert_string_equal(j.params_json, "{\"temperature\":0}");
    assert_string_equal(j.model_sha256, "ab");
    assert_true(j.seed == 0xFFFFFFFFFFFFFFF0ull);
    assert_int_equal(j.created, f->now);
    queue_job_free(&j);
    char idstr[32];
    snprintf(idstr, sizeof(idstr), "%lld", (long long)job);
    assert_int_equal(queue_job_find(q, idstr, &j, &err), ST_OK);
    assert_string_equal(j.name, "alpha");
    queue_job_free(&j);
    queue_job_free(NULL);
    assert_int_equal(queue_job_find(q, "beta", &j, &err), ST_ERR_NOT_FOUND);
    assert_int_equal(queue_job_find(q, "999", &j, &err), ST_ERR_NOT_FOUND);

    /* names: unique, directory-safe, never all digits */
    struct queue_job_spec spec = {.name = "alpha", .model_path = "m", .out_dir = "o"};
    int64_t id2 = 0;
    assert_int_equal(queue_job_create(q, &spec, &id2, &err), ST_ERR_EXISTS);
    const char *bad[] = {"", "12", "a/b", ".hidden", "sp ace"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        spec.name = bad[i];
        assert_int_equal(queue_job_create(q, &spec, &id2, &err), ST_ERR_INVALID_ARG);
    }
    spec.name = "beta-2.x_y";
    assert_int_equal(queue_job_create(q, &spec, &id2, &err), ST_OK);
    struct queue_job *list = NULL;
    size_t n = 0;
    assert_int_equal(queue_job_list(q, &list, &n, &err), ST_OK);
    assert_int_equal(n, 2);
    assert_string_equal(list[0].name, "alpha");
    assert_string_equal(list[1].name, "beta-2.x_y");
    assert_string_equal(list[1].params_json, "{}");
    assert_null(list[1].model_sha256);
    queue_job_list_free(list, n);
    queue_job_list_free(NULL, 0);
    queue_close(q);
    queue_close(NULL);
}

static enum status collect_scan(void *user, const struct queue_item_info *it)
{
    int64_t *v = user;
    v[0]++;
    v[1] = it->shard_record;
    v[2] = it->payload != NULL;
    return ST_OK;
}

/* The whole file at path into a malloc'd buffer (*n bytes); NULL if it cannot be read. */
static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *b = malloc(len > 0 ? (size_t)len : 1);
    *n = b ? fread(b, 1, (size_t)len, fp) : 0;
    fclose(fp);
    return b;
}

/* True when path+suffix exists. */
static bool exists_with(const char *path, const char *suffix)
{
    char p[256];
    snprintf(p, sizeof(p), "%s%s", path, suffix);
    return access(p, F_OK) == 0;
}

/* Open path with opts and expect status want; then the file is byte-for-byte as before, and
 * no -wal or -shm file was left beside it. */
static void expect_refused_unchanged(const char *path, const struct queue_options *opts,
                                     enum status want, const char *msg_part)
{
    size_t n0 = 0, n1 = 0;
    unsigned char *before = slurp(path, &n0);
    assert_non_null(before);
    struct err_detail err = {0};
    struct queue *q = (struct queue *)0x1;
    assert_int_equal(queue_open_opts(&q, path, opts, &err), want);
    assert_null(q);
    if (!strstr(err.msg, msg_part) || !strstr(err.msg, path))
        fail_msg("message \"%s\" lacks \"%s\" or the path", err.msg, msg_part);
    unsigned char *after = slurp(path, &n1);
    assert_non_null(after);
    assert_int_equal(n0, n1);
    assert_memory_equal(before, after, n0);
    assert_false(exists_with(path, "-wal"));
    assert_false(exists_with(path, "-shm"));
    free(before);
    free(after);
}

/* An SQLite file that is not a queue is refused and left exactly as it was: version 0 with a
 * table of its own, and a version >= 1 without quern's tables. A version-0 file with no tables
 * (what a fresh sqlite3 leaves) becomes a queue. */
static void test_foreign_file_refused(void **state)
{
    struct fixture *f = *state;
    sql_exec(f->path, "CREATE TABLE notes (x); INSERT INTO notes VALUES (42);");
    expect_refused_unchanged(f->path, NULL, ST_ERR_FORMAT, "not a quern queue (user_version 0, "
                                                           "tables: notes)");
    struct queue_options strict = {.check_integrity = true};
    expect_refused_unchanged(f->path, &strict, ST_ERR_FORMAT, "refusing to change it");
    assert_int_equal(sql_int(f->path, "PRAGMA user_version"), 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM sqlite_master"), 1);
    assert_int_equal(sql_int(f->path, "SELECT x FROM notes"), 42);
    assert_int_equal(sql_int(f->path, "SELECT journal_mode = 'delete' FROM pragma_journal_mode"),
                     1);

    /* a user_version of its own, some of quern's table names but not all */
    sql_exec(f->path, "PRAGMA user_version = 1; CREATE TABLE jobs (y); CREATE TABLE items (z);");
    expect_refused_unchanged(f->path, NULL, ST_ERR_FORMAT, "tables: items, jobs, notes");

    /* a database with nothing in it is as good as a new file */
    char empty[160];
    snprintf(empty, sizeof(empty), "%s/empty.db", f->dir);
    sql_exec(empty, "PRAGMA user_version = 0;");
    struct queue *q = NULL;
    struct err_detail err = {0};
    assert_int_equal(queue_open(&q, empty, &err), ST_OK);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION);
    queue_close(q);
}

/* must_exist: a missing or empty file is ST_ERR_NOT_FOUND naming it, and nothing is created; an
 * existing queue opens. */
static void test_must_exist(void **state)
{
    struct fixture *f = *state;
    struct queue_options o = {.must_exist = true};
    struct queue *q = (struct queue *)0x1;
    struct err_detail err = {0};
    assert_int_equal(queue_open_opts(&q, f->path, &o, &err), ST_ERR_NOT_FOUND);
    assert_null(q);
    assert_non_null(strstr(err.msg, f->path));
    assert_non_null(strstr(err.msg, "does not exist"));
    assert_false(exists_with(f->path, ""));
    assert_false(exists_with(f->path, "-wal"));

    FILE *fp = fopen(f->path, "wb"); /* an empty file */
    assert_non_null(fp);
    fclose(fp);
    assert_int_equal(queue_open_opts(&q, f->path, &o, &err), ST_ERR_NOT_FOUND);
    size_t n = 1;
    free(slurp(f->path, &n));
    assert_int_equal(n, 0);

    q = open_q(f); /* without must_exist the empty file becomes a queue */
    make_job(q, "j", 2);
    queue_close(q);
    o.check_integrity = true;
    assert_int_equal(queue_open_opts(&q, f->path, &o, &err), ST_OK);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION);
    queue_close(q);
}

/* A queue with a job of n items, checkpointed into the main file (no -wal left). */
static void make_closed_queue(struct fixture *f, int n)
{
    struct queue *q = open_q(f);
    make_job(q, "j", n);
    queue_close(q);
    sql_exec(f->path, "PRAGMA wal_checkpoint(TRUNCATE)");
}

/* Overwrite len bytes at off with a fixed pseudo-random pattern. */
static void scribble(const char *path, long off, size_t len)
{
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, off, SEEK_SET), 0);
    uint32_t x = 2463534242u;
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        fputc((int)(x & 0xff), fp);
    }
    fclose(fp);
}

/* check_integrity: pages of garbage in the middle of a queue (headers intact) are ST_ERR_FORMAT
 * with quick_check's words and the remedy, before anything is written. */
static void test_check_integrity(void **state)
{
    struct fixture *f = *state;
    make_closed_queue(f, 2000);
    int64_t pages = sql_int(f->path, "PRAGMA page_count");
    int64_t psize = sql_int(f->path, "PRAGMA page_size");
    assert_true(pages > 8);
    /* a few pages, header intact: whatever b-tree the counts walk there, they meet one */
    for (int64_t pg = pages / 2 - 2; pg <= pages / 2 + 2; pg++)
        scribble(f->path, (long)(pg * psize + 64), (size_t)psize - 64);
    struct queue_options o = {.must_exist = true, .check_integrity = true};
    struct err_detail err = {0};
    struct queue *q = (struct queue *)0x1;
    assert_int_equal(queue_open_opts(&q, f->path, &o, &err), ST_ERR_FORMAT);
    assert_null(q);
    assert_non_null(strstr(err.msg, "is corrupt"));
    assert_non_null(strstr(err.msg, ".recover"));
    assert_non_null(strstr(err.msg, f->path));
    /* without the check the open succeeds, and the damaged page is an error where it is met */
    assert_int_equal(queue_open(&q, f->path, &err), ST_OK);
    struct queue_counts c;
    assert_int_equal(queue_job_counts(q, 0, &c, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "is corrupt"));
    assert_non_null(strstr(err.msg, ".recover"));
    queue_close(q);
}

/* Rows that break the schema's rules (made here by editing the schema text, as damage can) are
 * ST_ERR_FORMAT from every call that reads them, never a job with NULL strings or an item in
 * state -1; quick_check names them too. */
static void test_damaged_rows(void **state)
{
    struct fixture *f = *state;
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 3);
    int64_t run = start_run(q, job);
    new_shard(q, run, job, QUEUE_SHARD_RESULTS, f);
    queue_close(q);
    sql_exec(f->path, "PRAGMA writable_schema = ON;"
                      "UPDATE sqlite_master SET sql = replace(sql, 'name TEXT NOT NULL UNIQUE',"
                      " 'name TEXT UNIQUE') WHERE name = 'jobs';");
    sql_exec(f->path, "PRAGMA ignore_check_constraints = ON;"
                      "UPDATE jobs SET name = NULL; UPDATE items SET state = 'bogus' WHERE id = 2;"
                      "UPDATE items SET payload = NULL WHERE id = 1;"
                      "UPDATE shards SET kind = 'bogus';");
    sql_exec(f->path, "PRAGMA writable_schema = ON;"
                      "UPDATE sqlite_master SET sql = replace(sql, 'name TEXT UNIQUE',"
                      " 'name TEXT NOT NULL UNIQUE') WHERE name = 'jobs';");
    struct err_detail err = {0};
    q = open_q(f);
    struct queue_job j;
    struct queue_job *jobs = NULL;
    size_t n = 0;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "has no name"));
    assert_non_null(strstr(err.msg, ".recover"));
    assert_null(j.name);
    assert_int_equal(queue_job_list(q, &jobs, &n, &err), ST_ERR_FORMAT);
    assert_null(jobs);
    struct queue_counts c;
    assert_int_equal(queue_job_counts(q, job, &c, &err), ST_ERR_FORMAT);
    int64_t v[3] = {0, 0, 0};
    assert_int_equal(queue_item_scan(q, job, collect_scan, v, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "unknown state"));
    struct queue_shard *sh = NULL;
    assert_int_equal(queue_shard_list(q, job, &sh, &n, &err), ST_ERR_FORMAT);
    assert_null(sh);
    /* a queued item without its request is a line rejected at submit (or re-queued by an
     * older retry): handed out without payload, so the run writes its error record */
    struct queue_claimed *items = NULL;
    assert_int_equal(queue_claim(q, job, run, 1, 1000, &items, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_int_equal(items[0].id, 1);
    assert_null(items[0].payload);
    queue_claimed_free(items, n);
    queue_close(q);

    struct queue_options o = {.check_integrity = true};
    assert_int_equal(queue_open_opts(&q, f->path, &o, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "NULL value in jobs.name"));
}

/* The file system table: network and cluster file systems refused, FUSE only warned about,
 * local ones unknown; a sign-extended f_type still matches. */
static void test_fs_kind(void **state)
{
    (void)state;
    static const struct {
        uint64_t magic;
        const char *name; /* NULL: not in the table */
        bool refuse;
    } cases[] = {
        {0x6969, "NFS", true},
        {0xFF534D42, "SMB/CIFS", true},
        {(uint64_t)(int64_t)(int32_t)0xFF534D42u, "SMB/CIFS", true},
        {0xFE534D42, "SMB2", true},
        {0x0BD00BD0, "Lustre", true},
        {0x47504653, "GPFS", true},
        {0x00C36400, "CephFS", true},
        {0x01021997, "9P", true},
        {0x5346414F, "AFS", true},
        {0x19830326, "BeeGFS", true},
        {0x20030528, "OrangeFS/PVFS2", true},
        {0x65735546, "FUSE", false},
        {0xEF53, NULL, false},       /* ext2/3/4 */
        {0x58465342, NULL, false},   /* XFS */
        {0x01021994, NULL, false},   /* tmpfs */
        {0x794C7630, NULL, false},   /* overlayfs */
        {0x6969000000ull, NULL, false}, /* only the low 32 bits count, and these are 0 */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        bool refuse = !cases[i].refuse;
        const char *name = queue_fs_kind(cases[i].magic, &refuse);
        if (cases[i].name) {
            assert_non_null(name);
            assert_string_equal(name, cases[i].name);
        } else {
            assert_null(name);
        }
        assert_int_equal(refuse, cases[i].refuse);
    }
    assert_non_null(queue_fs_kind(0x6969, NULL));
}

/* QUERN_TEST_FS_MAGIC: an NFS directory is refused before anything is created; a FUSE one
 * opens (with a warning). */
static void test_fs_refused(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = (struct queue *)0x1;
    setenv("QUERN_TEST_FS_MAGIC", "0x6969", 1);
    enum status st = queue_open(&q, f->path, &err);
    unsetenv("QUERN_TEST_FS_MAGIC");
    assert_int_equal(st, ST_ERR_UNSUPPORTED);
    assert_null(q);
    assert_non_null(strstr(err.msg, "NFS"));
    assert_non_null(strstr(err.msg, "node-local"));
    assert_non_null(strstr(err.msg, f->path));
    assert_false(exists_with(f->path, ""));

    setenv("QUERN_TEST_FS_MAGIC", "0x65735546", 1);
    st = queue_open(&q, f->path, &err);
    unsetenv("QUERN_TEST_FS_MAGIC");
    assert_int_equal(st, ST_OK);
    queue_close(q);
}

/* The journal mode a fresh connection reads from path. */
static void journal_of(const char *path, char *mode, size_t cap)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    snprintf(mode, cap, "%s", (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    sqlite3_close(db);
}

/* An exclusive file (a part): opens on a network file system, uses a rollback journal (a WAL
 * queue is switched back), holds its lock so a second connection of any kind is busy, keeps
 * its meta facts, and once marked as a part refuses a plain open without touching it. */
static void test_exclusive(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = NULL, *q2 = (struct queue *)0x1;
    char mode[16], v[32];
    bool found = true;
    /* a plain queue first (WAL), then the same file opened exclusive on "NFS" */
    assert_int_equal(queue_open(&q, f->path, &err), ST_OK);
    queue_close(q);
    journal_of(f->path, mode, sizeof(mode));
    assert_string_equal(mode, "wal");
    struct queue_options xo = {.exclusive = true, .busy_timeout_ms = 50};
    setenv("QUERN_TEST_FS_MAGIC", "0x6969", 1);
    enum status st = queue_open_opts(&q, f->path, &xo, &err);
    unsetenv("QUERN_TEST_FS_MAGIC");
    assert_int_equal(st, ST_OK);
    assert_int_equal(queue_meta_get(q, "part", v, sizeof(v), &found, &err), ST_OK);
    assert_false(found);
    assert_string_equal(v, "");
    assert_int_equal(queue_meta_set(q, "part", "3", &err), ST_OK);
    assert_int_equal(queue_meta_set(q, "part", "4", &err), ST_OK);
    /* in use: another exclusive open and a plain one are both busy */
    assert_int_equal(queue_open_opts(&q2, f->path, &xo, &err), ST_ERR_BUSY);
    assert_null(q2);
    assert_non_null(strstr(err.msg, "in use by another process"));
    struct queue_options po = {.busy_timeout_ms = 50};
    assert_int_equal(queue_open_opts(&q2, f->path, &po, &err), ST_ERR_BUSY);
    queue_close(q);
    journal_of(f->path, mode, sizeof(mode));
    assert_string_equal(mode, "delete");
    /* a part opened as a plain queue: refused, still a rollback-journal file */
    assert_int_equal(queue_open_opts(&q2, f->path, &po, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "part 4 of a partitioned queue"));
    journal_of(f->path, mode, sizeof(mode));
    assert_string_equal(mode, "delete");
    assert_int_equal(queue_open_opts(&q, f->path, &xo, &err), ST_OK);
    assert_int_equal(queue_meta_get(q, "part", v, sizeof(v), &found, &err), ST_OK);
    assert_true(found);
    assert_string_equal(v, "4");
    queue_close(q);
}

/* A process killed in the middle of writing a part (rollback journal) leaves a hot journal;
 * the next open must roll it back and see the last committed state. A read-only look at
 * such a file fails (SQLITE_READONLY_ROLLBACK), which is how a restarted array task once
 * failed to open its own part after kill -9. */
static void test_exclusive_hot_journal(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = NULL;
    struct queue_options xo = {.exclusive = true, .busy_timeout_ms = 50};
    assert_int_equal(queue_open_opts(&q, f->path, &xo, &err), ST_OK);
    assert_int_equal(queue_meta_set(q, "part", "1", &err), ST_OK);
    queue_close(q);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* a small page cache spills the transaction's pages to the file before commit, so
         * the journal is synced with its header: hot once this process is gone */
        sqlite3 *db = NULL;
        if (sqlite3_open(f->path, &db) != SQLITE_OK ||
            sqlite3_exec(db, "PRAGMA cache_size = 1; BEGIN IMMEDIATE", NULL, NULL, NULL) !=
                SQLITE_OK)
            _exit(2);
        for (int i = 0; i < 200; i++) {
            char sql[128];
            snprintf(sql, sizeof(sql),
                     "INSERT INTO meta (key, value) VALUES ('uncommitted%d', hex(zeroblob(500)))",
                     i);
            if (sqlite3_exec(db, sql, NULL, NULL, NULL) != SQLITE_OK)
                _exit(3);
        }
        _exit(0); /* as kill -9 would: no commit, no rollback, no close */
    }
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    char journal[PATH_MAX];
    snprintf(journal, sizeof(journal), "%s-journal", f->path);
    struct stat sb;
    assert_int_equal(stat(journal, &sb), 0);
    assert_true(sb.st_size > 0);
    /* a read-only connection cannot read it: the state the fix handles */
    sqlite3 *ro = NULL;
    assert_int_equal(sqlite3_open_v2(f->path, &ro, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_extended_result_codes(ro, 1);
    assert_int_equal(sqlite3_exec(ro, "SELECT count(*) FROM meta", NULL, NULL, NULL),
                     SQLITE_READONLY_ROLLBACK);
    sqlite3_close(ro);
    assert_int_equal(queue_open_opts(&q, f->path, &xo, &err), ST_OK);
    char v[32];
    bool found = true;
    assert_int_equal(queue_meta_get(q, "uncommitted7", v, sizeof(v), &found, &err), ST_OK);
    assert_false(found);
    assert_int_equal(queue_meta_get(q, "part", v, sizeof(v), &found, &err), ST_OK);
    assert_true(found);
    assert_string_equal(v, "1");
    queue_close(q);
    assert_int_equal(stat(journal, &sb), -1);
}

/* The schema of a database as text: its user_version, then each object's SQL by type and name
 * (SQLite keeps a table's text up to date through ALTER TABLE). Appended to *buf. */
static void schema_text(const char *path, char **buf, size_t *len)
{
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_stmt *st = NULL;
    const char *sql = "SELECT type || ' ' || name || ': ' || sql FROM sqlite_master "
                      "WHERE sql IS NOT NULL ORDER BY type, name";
    assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK);
    FILE *m = open_memstream(buf, len);
    assert_non_null(m);
    while (sqlite3_step(st) == SQLITE_ROW)
        fprintf(m, "%s\n", (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    sqlite3_close(db);
    fclose(m);
}

/* Apply migrations [0, k) to the file at path as queue_open does (one transaction). */
static void migrate_to(const char *path, size_t k)
{
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "BEGIN", NULL, NULL, NULL), SQLITE_OK);
    for (size_t i = 0; i < k; i++)
        assert_int_equal(queue_migration_apply(db, &queue_migrations[i]), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
}

/* Every version's schema and migration text equal those it shipped with
 * (tests/fixtures/queue_schema.txt: the sha256 of each migration's SQL, so an edited data
 * statement is caught too, and the tables it leaves): a migration edited after it shipped
 * leaves queues of that version in several forms, and a quern expecting one fails on the
 * others. (A `then` hook is C: not covered.) QUERN_SCHEMA_FIXTURE_WRITE=1 writes the file
 * instead, for a new version (check that only its own section was added). */
static void test_schema_versions(void **state)
{
    struct fixture *f = *state;
    char *all = NULL;
    size_t all_len = 0;
    FILE *out = open_memstream(&all, &all_len);
    assert_non_null(out);
    for (size_t k = 1; k <= queue_n_migrations; k++) {
        char path[256], *text = NULL;
        size_t len = 0;
        snprintf(path, sizeof(path), "%s/v%zu.db", f->dir, k);
        migrate_to(path, k);
        assert_int_equal(sql_int(path, "PRAGMA user_version"), queue_migrations[k - 1].version);
        schema_text(path, &text, &len);
        char hex[SHA256_HEX_LEN];
        sha256_buf_hex(queue_migrations[k - 1].sql, strlen(queue_migrations[k - 1].sql), hex);
        fprintf(out, "-- version %d\n-- its SQL's sha256 %s\n%s", queue_migrations[k - 1].version,
                hex, text);
        free(text);
    }
    fclose(out);
    assert_int_equal(queue_migrations[queue_n_migrations - 1].version, QUEUE_SCHEMA_VERSION);
    const char *fixture = "tests/fixtures/queue_schema.txt";
    if (getenv("QUERN_SCHEMA_FIXTURE_WRITE")) {
        FILE *w = fopen(fixture, "w");
        assert_non_null(w);
        assert_int_equal(fwrite(all, 1, all_len, w), all_len);
        assert_int_equal(fclose(w), 0);
    }
    size_t want_len = 0;
    char *want = test_read_file(fixture, &want_len);
    if (!want)
        fail_msg("missing %s", fixture);
    if (want_len != all_len || memcmp(want, all, all_len))
        fail_msg("the schema differs from %s (a shipped migration was changed?); now:\n%s", fixture,
                 all);
    /* a new queue is the last version's schema */
    char *fresh = NULL;
    size_t fresh_len = 0;
    queue_close(open_q(f));
    schema_text(f->path, &fresh, &fresh_len);
    char head[32];
    snprintf(head, sizeof(head), "-- version %d\n", QUEUE_SCHEMA_VERSION);
    const char *last = strstr(all, head);
    assert_non_null(last);
    last = strchr(strchr(last, '\n') + 1, '\n') + 1; /* (past the sha256 line) */
    assert_int_equal(strlen(last), fresh_len);
    assert_memory_equal(last, fresh, fresh_len);
    free(fresh);
    free(want);
    free(all);
}

/* Version 6 shipped in three forms (39a5249: the index and runs.stopping; edcb352: and
 * model_files; 0b56cea: and items.error_param). Each migrates to the one schema of version 7,
 * its job and items kept, and a rejected line keeps its field after. */
static void test_migrate_v6_forms(void **state)
{
#define MODEL_FILES_V6                                                                             \
    "CREATE TABLE model_files ("                                                                   \
    "  path TEXT PRIMARY KEY,"                                                                     \
    "  dev INTEGER NOT NULL,"                                                                      \
    "  ino INTEGER NOT NULL,"                                                                      \
    "  size INTEGER NOT NULL,"                                                                     \
    "  mtime_ns INTEGER NOT NULL,"                                                                 \
    "  ctime_ns INTEGER NOT NULL,"                                                                 \
    "  sha256 TEXT NOT NULL);"
    struct fixture *f = *state;
    static const char *const forms[3] = {
        "CREATE INDEX samples_run ON samples (run_id, t);"
        "ALTER TABLE runs ADD COLUMN stopping INTEGER;",
        "CREATE INDEX samples_run ON samples (run_id, t);"
        "ALTER TABLE runs ADD COLUMN stopping INTEGER;" MODEL_FILES_V6,
        "CREATE INDEX samples_run ON samples (run_id, t);"
        "ALTER TABLE runs ADD COLUMN stopping INTEGER;"
        "ALTER TABLE items ADD COLUMN error_param TEXT;" MODEL_FILES_V6,
    };
    char *fresh = NULL;
    size_t fresh_len = 0;
    queue_close(open_q(f));
    schema_text(f->path, &fresh, &fresh_len);
    for (int form = 0; form < 3; form++) {
        char path[256];
        snprintf(path, sizeof(path), "%s/six-%d.db", f->dir, form);
        migrate_to(path, 5);
        sql_exec(path, forms[form]);
        sql_exec(path,
                 "PRAGMA user_version = 6;"
                 "INSERT INTO jobs (name, created, model_path, out_dir) VALUES ('a', 1, 'm', 'o');"
                 "INSERT INTO items (job_id, custom_id, payload, state) VALUES (1, 'x', '{}', "
                 "'queued');");
        struct queue *q = NULL;
        struct err_detail err = {0};
        assert_int_equal(queue_open(&q, path, &err), ST_OK);
        assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION);
        struct queue_item_spec bad = {.line_no = 2,
                                      .error_code = "unknown_field",
                                      .error_msg = "no such field",
                                      .error_param = "max_token"};
        assert_int_equal(queue_item_add(q, 1, &bad, NULL, &err), ST_OK);
        queue_close(q);
        char *text = NULL;
        size_t len = 0;
        schema_text(path, &text, &len);
        assert_int_equal(len, fresh_len);
        assert_memory_equal(text, fresh, len);
        free(text);
        assert_int_equal(sql_int(path, "SELECT count(*) FROM items WHERE custom_id = 'x'"), 1);
        assert_int_equal(sql_int(path, "SELECT count(*) FROM items WHERE error_param = "
                                       "'max_token'"),
                         1);
    }
    free(fresh);
}

/* A version-1 database with a finished item migrates to version 2: the data stays, the item's
 * record index is unknown (-1), the database gets a uuid, and the new columns work. */
static void test_migrate_v1_to_v2(void **state)
{
    struct fixture *f = *state;
    sql_exec(f->path, queue_migrations[0].sql);
    sql_exec(f->path, "PRAGMA user_version = 1;"
                      "INSERT INTO jobs (name, created, model_path, out_dir) VALUES ('old', 1, 'm', 'o');"
                      "INSERT INTO runs (job_id, started, heartbeat, ended) VALUES (1, 1, 1, 2);"
                      "INSERT INTO shards (job_id, kind, seq, path, run_id, created, records)"
                      " VALUES (1, 'results', 0, 'p', 1, 1, 1);"
                      "INSERT INTO items (job_id, custom_id, payload, state, shard_id)"
                      " VALUES (1, 'a', '{}', 'done', 1);");
    struct queue *q = open_q(f);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION); /* through v2 */
    struct err_detail err = {0};
    int64_t v[3] = {0, 0, 0};
    assert_int_equal(queue_item_scan(q, 1, collect_scan, v, &err), ST_OK);
    assert_int_equal(v[0], 1);
    assert_int_equal(v[1], -1);
    assert_int_equal(v[2], 1);
    queue_close(q);
    assert_int_equal(sql_int(f->path, "SELECT length(value) FROM meta WHERE key = 'db_uuid'"), 32);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM runs WHERE kind = 'run'"), 1);
}

/* Version 2 -> 3 adds runs.progress_json: a live run of a version-2 queue is listed with no
 * progress, and can store some. */
static void test_migrate_v2_to_v3(void **state)
{
    struct fixture *f = *state;
    sql_exec(f->path, queue_migrations[0].sql);
    sql_exec(f->path, queue_migrations[1].sql);
    sql_exec(f->path, "PRAGMA user_version = 2;"
                      "INSERT INTO jobs (name, created, model_path, out_dir)"
                      " VALUES ('old', 1, 'm', 'o');"
                      "INSERT INTO runs (job_id, host, pid, started, heartbeat)"
                      " VALUES (1, 'h', 7, 1, 2);"
                      "INSERT INTO runs (job_id, started, heartbeat, ended) VALUES (1, 1, 1, 2);");
    struct queue *q = open_q(f);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION);
    struct err_detail err = {0};
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    assert_int_equal(queue_run_list_live(q, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].id, 1);
    assert_int_equal(runs[0].job_id, 1);
    assert_int_equal(runs[0].pid, 7);
    assert_string_equal(runs[0].host, "h");
    assert_null(runs[0].progress_json);
    queue_run_info_free(runs, n);
    assert_int_equal(queue_run_progress(q, 1, "{\"x\":1}", &err), ST_OK);
    queue_close(q);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM runs WHERE progress_json IS NULL"), 1);
    assert_int_equal(sql_int(f->path, "SELECT heartbeat FROM runs WHERE id = 1"), f->now);
}

/* A version-4 queue migrates to version 5: its runs have no engine; a run can record one, and
 * the job's runs list it; queue_job_writers says which run committed which shard's records (a
 * finished item's lease owner), per shard, with the run's host and engine; items not finished
 * or in no shard are not counted. */
static void test_migrate_v4_to_v5_engine(void **state)
{
    struct fixture *f = *state;
    for (int i = 0; i < 4; i++)
        sql_exec(f->path, queue_migrations[i].sql);
    sql_exec(f->path,
             "PRAGMA user_version = 4;"
             "INSERT INTO jobs (name, created, model_path, out_dir) VALUES ('a', 1, 'm', 'o');"
             "INSERT INTO runs (job_id, host, pid, started, heartbeat, ended)"
             " VALUES (1, 'h1', 7, 1, 2, 3), (1, 'h2', 8, 4, 5, NULL);"
             "INSERT INTO shards (job_id, kind, seq, path, run_id, created, records)"
             " VALUES (1, 'results', 0, 'p0', 1, 1, 3), (1, 'errors', 0, 'e0', 2, 1, 1),"
             " (1, 'results', 1, 'p1', 2, 1, 1);"
             "INSERT INTO items (job_id, custom_id, payload, state, lease_owner, shard_id)"
             " VALUES (1, 'a', '{}', 'done', 1, 1), (1, 'b', '{}', 'done', 1, 1),"
             " (1, 'c', '{}', 'done', 2, 1), (1, 'd', '{}', 'failed', 2, 2),"
             " (1, 'e', '{}', 'done', 2, 3), (1, 'f', '{}', 'leased', 2, NULL),"
             " (1, 'g', '{}', 'queued', NULL, NULL);"
             "INSERT INTO samples VALUES (1, 1, 1, 5, 3, 0, 9, 9, 0, 1, 0, 1, 8, 4, 4, 0, 0);");
    struct queue *q = open_q(f);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION);
    struct err_detail err = {0};
    assert_int_equal(queue_run_set_engine(q, 2, "{\"matmul\":\"q8\"}", &err), ST_OK);
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    assert_int_equal(queue_run_list_job(q, 1, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 2);
    assert_null(runs[0].engine_json);
    assert_string_equal(runs[1].engine_json, "{\"matmul\":\"q8\"}");
    assert_int_equal(runs[0].worked, 1); /* its sample shows tokens */
    assert_int_equal(runs[1].worked, 1); /* no sample, but it made shards with records */
    queue_run_info_free(runs, n);
    assert_int_equal(queue_run_list_live(q, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_string_equal(runs[0].engine_json, "{\"matmul\":\"q8\"}");
    queue_run_info_free(runs, n);
    struct queue_writer *w = NULL;
    assert_int_equal(queue_job_writers(q, 1, &w, &n, &err), ST_OK);
    /* (shard, run, records, host, engine) */
    assert_int_equal(n, 4);
    const int64_t want[4][3] = {{1, 1, 2}, {1, 2, 1}, {2, 2, 1}, {3, 2, 1}};
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(w[i].shard_id, want[i][0]);
        assert_int_equal(w[i].run_id, want[i][1]);
        assert_int_equal(w[i].records, want[i][2]);
        assert_string_equal(w[i].host, want[i][1] == 1 ? "h1" : "h2");
        if (want[i][1] == 1)
            assert_null(w[i].engine_json);
        else
            assert_string_equal(w[i].engine_json, "{\"matmul\":\"q8\"}");
    }
    queue_writers_free(w, n);
    assert_int_equal(queue_job_writers(q, 2, &w, &n, &err), ST_OK); /* no such job: none */
    assert_int_equal(n, 0);
    assert_null(w);
    assert_int_equal(queue_run_set_engine(q, 9, "{}", &err), ST_ERR_INVALID_ARG);
    queue_close(q);
}

/* A version-3 queue with a run migrates to version 4: samples can be added for its job and
 * come back in time order with every field; another job's are not listed. */
static void test_migrate_v3_to_v4_samples(void **state)
{
    struct fixture *f = *state;
    for (int i = 0; i < 3; i++)
        sql_exec(f->path, queue_migrations[i].sql);
    sql_exec(f->path, "PRAGMA user_version = 3;"
                      "INSERT INTO jobs (name, created, model_path, out_dir)"
                      " VALUES ('a', 1, 'm', 'o'), ('b', 1, 'm', 'o');"
                      "INSERT INTO runs (job_id, host, pid, started, heartbeat)"
                      " VALUES (1, 'h', 7, 1, 2);");
    struct queue *q = open_q(f);
    assert_int_equal(queue_schema_version(q), QUEUE_SCHEMA_VERSION); /* through v4 */
    struct err_detail err = {0};
    struct queue_sample s = {0}, *got = NULL;
    size_t n = 0;
    for (int i = 0; i < 3; i++) {
        s.t_ms = 3000 - 1000 * i; /* added newest first */
        s.run_id = 1;
        s.job_id = 1;
        for (int k = 0; k < QUEUE_SAMPLE_FIELDS; k++)
            s.v[k] = 100 * i + k;
        assert_int_equal(queue_sample_add(q, &s, &err), ST_OK);
    }
    s.job_id = 2;
    s.t_ms = 0; /* now, from the queue's clock */
    assert_int_equal(queue_sample_add(q, &s, &err), ST_OK);
    assert_int_equal(queue_sample_list(q, 1, &got, &n, &err), ST_OK);
    assert_int_equal(n, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(got[i].t_ms, 1000 * (i + 1));
        assert_int_equal(got[i].run_id, 1);
        for (int k = 0; k < QUEUE_SAMPLE_FIELDS; k++)
            assert_int_equal(got[i].v[k], 100 * (2 - i) + k);
    }
    free(got);
    assert_int_equal(queue_sample_list(q, 2, &got, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_int_equal(got[0].t_ms, f->now);
    free(got);
    assert_string_equal(queue_sample_field_name(QUEUE_SAMPLE_CACHED_TOKENS), "cached_tokens");
    assert_null(queue_sample_field_name(QUEUE_SAMPLE_FIELDS));
    /* a sample of a run that does not exist breaks the foreign key */
    s.run_id = 99;
    assert_int_not_equal(queue_sample_add(q, &s, &err), ST_OK);
    queue_close(q);
}

/* queue_run_list_job: the runs started for the job, and runs for any job that recorded
 * samples for it; not another job's runs, nor any-job runs that never worked on it. */
static void test_run_list_job(void **state)
{
    struct fixture *f = *state;
    struct queue *q = open_q(f);
    int64_t j1 = make_job(q, "a", 2), j2 = make_job(q, "b", 2);
    int64_t r1 = start_run(q, j1), any_b = start_run(q, 0), any_none = start_run(q, 0);
    (void)any_none;
    struct queue_sample s = {0};
    s.run_id = any_b;
    s.job_id = j2;
    struct err_detail err = {0};
    assert_int_equal(queue_sample_add(q, &s, &err), ST_OK);
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    assert_int_equal(queue_run_list_job(q, j1, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].id, r1);
    assert_int_equal(runs[0].ended_ms, 0);
    assert_null(runs[0].exit_reason);
    queue_run_info_free(runs, n);
    assert_int_equal(queue_run_end(q, any_b, "drained", NULL, NULL, &err), ST_OK);
    assert_int_equal(queue_run_list_job(q, j2, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].id, any_b);
    assert_true(runs[0].ended_ms > 0);
    assert_string_equal(runs[0].exit_reason, "drained");
    assert_int_equal(runs[0].worked, 0); /* its one sample shows no token computed */
    queue_run_info_free(runs, n);
    queue_close(q);
}

static void test_newer_version_refused(void **state)
{
    struct fixture *f = *state;
    struct queue *q = open_q(f);
    queue_close(q);
    char sql[64];
    snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", QUEUE_SCHEMA_VERSION + 1);
    sql_exec(f->path, sql);
    struct err_detail err = {0};
    q = (struct queue *)0x1;
    assert_int_equal(queue_open(&q, f->path, &err), ST_ERR_UNSUPPORTED);
    assert_null(q);
    assert_non_null(strstr(err.msg, "newer"));
    assert_int_equal(sql_int(f->path, "PRAGMA user_version"), QUEUE_SCHEMA_VERSION + 1);

    /* a file that is not SQLite at all */
    char junk[160];
    snprintf(junk, sizeof(junk), "%s/junk.db", f->dir);
    FILE *fp = fopen(junk, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 4096; i++)
        fputc('x', fp);
    fclose(fp);
    assert_int_equal(queue_open(&q, junk, &err), ST_ERR_FORMAT);
    assert_null(q);
    /* a directory that does not exist */
    assert_int_equal(queue_open(&q, "/nonexistent-dir/q.db", &err), ST_ERR_IO);
}

/* ---- items --------------------------------------------------------------------------------- */

static void test_item_add_duplicate(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 0);
    struct queue_item_spec it = {
        .custom_id = "a", .payload = "{}", .source = "in.jsonl", .line_no = 1};
    int64_t id = 0;
    assert_int_equal(queue_item_add(q, job, &it, &id, &err), ST_OK);
    assert_true(id > 0);
    it.payload = "{\"other\":1}";
    assert_int_equal(queue_item_add(q, job, &it, &id, &err), ST_ERR_EXISTS);
    assert_int_equal(id, 0);
    assert_non_null(strstr(err.msg, "\"a\""));

    /* inside a transaction a duplicate fails alone; the transaction goes on */
    assert_int_equal(queue_tx_begin(q, &err), ST_OK);
    assert_int_equal(queue_tx_begin(q, &err), ST_ERR_INVALID_ARG);
    it.custom_id = "b";
    assert_int_equal(queue_item_add(q, job, &it, NULL, &err), ST_OK);
    assert_int_equal(queue_item_add(q, job, &it, NULL, &err), ST_ERR_EXISTS);
    it.custom_id = "c";
    assert_int_equal(queue_item_add(q, job, &it, NULL, &err), ST_OK);
    assert_int_equal(queue_tx_commit(q, &err), ST_OK);
    assert_int_equal(queue_tx_commit(q, &err), ST_ERR_INVALID_ARG);

    /* a rolled-back transaction leaves nothing */
    assert_int_equal(queue_tx_begin(q, &err), ST_OK);
    it.custom_id = "d";
    assert_int_equal(queue_item_add(q, job, &it, NULL, &err), ST_OK);
    queue_tx_rollback(q);
    queue_tx_rollback(q);

    /* rejected lines: no custom_id needed, several may lack one; queued until a run writes
     * their error record */
    struct queue_item_spec bad = {.line_no = 7,
                                  .error_code = "invalid_json",
                                  .error_msg = "line 7: expected a key"};
    assert_int_equal(queue_item_add(q, job, &bad, NULL, &err), ST_OK);
    bad.line_no = 8;
    assert_int_equal(queue_item_add(q, job, &bad, &id, &err), ST_OK);
    assert_int_equal(item_state(f, id), QUEUE_ITEM_QUEUED);
    assert_int_equal(item_int(f, id, "finished IS NULL AND payload IS NULL"), 1);
    bad.error_code = "missing_custom_id";
    assert_int_equal(queue_item_add(q, job, &bad, NULL, &err), ST_OK);
    /* a queued item needs custom_id and payload */
    struct queue_item_spec incomplete = {.custom_id = "e"};
    assert_int_equal(queue_item_add(q, job, &incomplete, NULL, &err), ST_ERR_INVALID_ARG);
    it.custom_id = "z";
    assert_int_equal(queue_item_add(q, 9999, &it, NULL, &err), ST_ERR_NOT_FOUND);

    struct queue_counts c;
    assert_int_equal(queue_job_counts(q, job, &c, &err), ST_OK);
    assert_int_equal(c.total, 6);
    assert_int_equal(c.items[QUEUE_ITEM_QUEUED], 6);
    assert_int_equal(c.items[QUEUE_ITEM_FAILED], 0);
    /* a claim hands a rejected line out with its code, message and position */
    int64_t run = start_run(q, job);
    size_t nc = 0;
    struct queue_claimed *cl = claim(q, job, run, 10, 1000, &nc);
    assert_int_equal(nc, 6);
    int rejects = 0;
    for (size_t i = 0; i < nc; i++) {
        if (!cl[i].error_code) {
            assert_non_null(cl[i].payload);
            continue;
        }
        rejects++;
        assert_null(cl[i].payload);
        assert_null(cl[i].custom_id);
        assert_true(cl[i].line_no == 7 || cl[i].line_no == 8);
        assert_non_null(strstr(cl[i].error_msg, "expected a key"));
    }
    assert_int_equal(rejects, 3);
    queue_claimed_free(cl, nc);
    struct queue_job j;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.n_items, 6);
    queue_job_free(&j);

    /* cancelled jobs take no items */
    assert_int_equal(queue_job_cancel(q, job, NULL, &err), ST_OK);
    it.custom_id = "after-cancel";
    assert_int_equal(queue_item_add(q, job, &it, NULL, &err), ST_ERR_INVALID_ARG);
    queue_close(q);
}

/* ---- jobs being submitted ---------------------------------------------------------------- */

/* A submit run for `me` (kind 'submit'), and a not-ready job it writes with n queued items
 * s00000.. added in one transaction (the submit's bounded commits). */
static int64_t start_submit(struct queue *q, const struct proc_identity *me, int64_t *run)
{
    struct queue_run_spec rs = {.host = me->host,
                                .pid = me->pid,
                                .boot_id = me->boot_id,
                                .pid_ns = me->pid_ns,
                                .pstart = me->start_ticks,
                                .submit = true};
    *run = 0;
    return queue_run_start(q, &rs, run, NULL) == ST_OK ? *run : 0;
}

static int64_t make_submitting_job(struct queue *q, const char *name, int64_t run, int n)
{
    struct queue_job_spec spec = {
        .name = name, .model_path = "m.gguf", .out_dir = "out", .submit_run = run};
    int64_t job = 0;
    if (queue_job_create(q, &spec, &job, NULL) != ST_OK || queue_tx_begin(q, NULL) != ST_OK)
        return 0;
    for (int i = 0; i < n; i++) {
        char cid[32];
        snprintf(cid, sizeof(cid), "s%05d", i);
        struct queue_item_spec it = {.custom_id = cid, .payload = "{}", .line_no = i + 1};
        if (queue_item_add(q, job, &it, NULL, NULL) != ST_OK)
            return 0;
        if (i % 1000 == 999 &&
            (queue_run_heartbeat(q, run, NULL) != ST_OK || queue_tx_commit(q, NULL) != ST_OK ||
             queue_tx_begin(q, NULL) != ST_OK))
            return 0;
    }
    return queue_tx_commit(q, NULL) == ST_OK ? job : 0;
}

static int64_t count_where(struct fixture *f, const char *table, const char *col, int64_t v)
{
    char sql[160];
    snprintf(sql, sizeof(sql), "SELECT count(*) FROM %s WHERE %s = %lld", table, col, (long long)v);
    return sql_int(f->path, sql);
}

/* A job being submitted is invisible to runs until it is published: no claim (of that job or
 * of any job) takes its items, no run can be started on it, an empty claim does not mark it
 * done, and counts over all jobs leave it out; list and get show ready = false. */
static void test_not_ready_job_invisible(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    struct proc_identity self;
    proc_identity_self(&self);
    int64_t ready_job = make_job(q, "ready", 2);
    int64_t srun = 0;
    assert_true(start_submit(q, &self, &srun) > 0);
    int64_t job = make_submitting_job(q, "sub", srun, 5);
    assert_true(job > 0);
    struct queue_job j = {0};
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_false(j.ready);
    assert_int_equal(j.submit_run, srun);
    assert_int_equal(j.n_items, 5);
    queue_job_free(&j);
    struct queue_job *jobs = NULL;
    size_t nj = 0;
    assert_int_equal(queue_job_list(q, &jobs, &nj, &err), ST_OK);
    assert_int_equal(nj, 2);
    assert_true(jobs[0].ready);
    assert_false(jobs[1].ready);
    queue_job_list_free(jobs, nj);

    /* a run on the job is refused; a run on any job claims only the ready job's items */
    struct queue_run_spec rs = {.job_id = job, .host = "h", .pid = 1};
    int64_t refused = 0;
    assert_int_equal(queue_run_start(q, &rs, &refused, &err), ST_ERR_INVALID_ARG);
    rs.job_id = 999;
    assert_int_equal(queue_run_start(q, &rs, &refused, &err), ST_ERR_NOT_FOUND);
    int64_t run = start_run(q, 0);
    size_t n = 9;
    struct queue_claimed *c = claim(q, job, run, 10, 60000, &n);
    assert_int_equal(n, 0);
    assert_null(c);
    c = claim(q, 0, run, 10, 60000, &n);
    assert_int_equal(n, 2);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(c[i].job_id, ready_job);
    queue_claimed_free(c, n);
    c = claim(q, 0, run, 10, 60000, &n);
    assert_int_equal(n, 0);
    assert_int_equal(count_where(f, "items", "job_id", job), 5);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'leased'"), 2);

    /* an empty not-ready job is not marked done by a claim that finds nothing */
    int64_t srun2 = 0;
    assert_true(start_submit(q, &self, &srun2) > 0);
    int64_t empty = make_submitting_job(q, "empty", srun2, 0);
    assert_true(empty > 0);
    c = claim(q, empty, run, 10, 60000, &n);
    assert_int_equal(n, 0);
    c = claim(q, 0, run, 10, 60000, &n);
    assert_int_equal(n, 0);
    enum queue_job_state js;
    assert_int_equal(queue_job_state_get(q, empty, &js, &err), ST_OK);
    assert_int_equal(js, QUEUE_JOB_QUEUED);

    /* counts over all jobs leave the not-ready jobs out; the job's own counts show them */
    struct queue_counts counts;
    assert_int_equal(queue_job_counts(q, 0, &counts, &err), ST_OK);
    assert_int_equal(counts.total, 2);
    assert_int_equal(queue_job_counts(q, job, &counts, &err), ST_OK);
    assert_int_equal(counts.total, 5);

    /* submit runs do not count as run time of any job (nor does a run over all jobs that has
     * recorded no sample of it yet) */
    f->now += 5000;
    assert_int_equal(queue_run_heartbeat(q, srun, &err), ST_OK);
    int64_t first = 0, last = 0;
    assert_int_equal(queue_job_timing(q, ready_job, &first, &last, NULL, &err), ST_OK);
    assert_int_equal(first, 0);
    assert_int_equal(last, 0);

    /* publish: ready, the submit run ended as "submitted"; now its items can be claimed */
    assert_int_equal(queue_job_publish(q, job, "{\"lines\":5}", &err), ST_OK);
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_true(j.ready);
    queue_job_free(&j);
    char sql[160];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM runs WHERE id = %lld AND exit_reason = 'submitted'"
             " AND ended IS NOT NULL AND kind = 'submit'",
             (long long)srun);
    assert_int_equal(sql_int(f->path, sql), 1);
    assert_int_equal(queue_job_publish(q, job, NULL, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_run_heartbeat(q, srun, &err), ST_ERR_CONFLICT);
    c = claim(q, job, run, 10, 60000, &n);
    assert_int_equal(n, 5);
    queue_claimed_free(c, n);
    assert_int_equal(queue_job_counts(q, 0, &counts, &err), ST_OK);
    assert_int_equal(counts.total, 7);
    /* a discarded submit's job can never be published, and is gone with its items */
    int64_t gone = 0;
    assert_int_equal(queue_job_discard(q, ready_job, "failed", &gone, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_job_discard(q, empty, "failed", &gone, &err), ST_OK);
    assert_int_equal(gone, 0);
    assert_int_equal(queue_job_publish(q, empty, NULL, &err), ST_ERR_NOT_FOUND);
    queue_close(q);
}

/* queue_job_discard deletes a big job in bounded transactions, and ends its submit run first. */
static void test_discard_batches(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    struct proc_identity self;
    proc_identity_self(&self);
    int64_t srun = 0;
    assert_true(start_submit(q, &self, &srun) > 0);
    int64_t job = make_submitting_job(q, "big", srun, 25001);
    assert_true(job > 0);
    int64_t gone = 0;
    assert_int_equal(queue_job_discard(q, job, "interrupted", &gone, &err), ST_OK);
    assert_int_equal(gone, 25001);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items"), 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs"), 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM runs WHERE exit_reason = 'interrupted'"
                                      " AND ended IS NOT NULL"),
                     1);
    assert_int_equal(queue_job_discard(q, job, "failed", &gone, &err), ST_ERR_NOT_FOUND);
    queue_close(q);
}

/* queue_job_cancel in bounded transactions: a job of 25 items cancelled 10 at a time (some
 * leased by a run, one done; queue_job_unfinished counts them before and after), every
 * unfinished item cancelled, the done one kept, the job cancelled with the last batch and the
 * count right; a batch that ends exactly at the last item still marks the job; a cancelled job
 * stays as it is. */
static void test_cancel_batches(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    queue_set_job_batch(q, 10);
    int64_t job = make_job(q, "c25", 25);
    int64_t run = start_run(q, job);
    size_t nc = 0;
    struct queue_claimed *cl = claim(q, job, run, 4, 60000, &nc);
    assert_int_equal(nc, 4);
    queue_claimed_free(cl, nc);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'leased'"), 4);
    char sql[160];
    snprintf(sql, sizeof(sql),
             "UPDATE items SET state = 'done' WHERE id = (SELECT min(id) FROM"
             " items WHERE state = 'queued')");
    sql_exec(f->path, sql);
    int64_t n = 0, queued = -1, leased = -1;
    assert_int_equal(queue_job_unfinished(q, job, &queued, &leased, &err), ST_OK);
    assert_int_equal(queued, 20);
    assert_int_equal(leased, 4);
    assert_int_equal(queue_job_cancel(q, job, &n, &err), ST_OK);
    assert_int_equal(n, 24);
    assert_int_equal(queue_job_unfinished(q, job, &queued, &leased, &err), ST_OK);
    assert_int_equal(queued + leased, 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'cancelled'"), 24);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'done'"), 1);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs WHERE state = 'cancelled'"), 1);
    assert_int_equal(queue_job_cancel(q, job, &n, &err), ST_OK);
    assert_int_equal(n, 0);
    /* 20 items: two full batches, the second (the last items) marking the job */
    int64_t job2 = make_job(q, "c20", 20);
    assert_int_equal(queue_job_cancel(q, job2, &n, &err), ST_OK);
    assert_int_equal(n, 20);
    snprintf(sql, sizeof(sql), "SELECT count(*) FROM jobs WHERE id = %lld AND state = 'cancelled'",
             (long long)job2);
    assert_int_equal(sql_int(f->path, sql), 1);
    /* lines rejected at submit (no payload, an error) become failed, never cancelled, in every
     * transaction: 23 of them and 5 good ones, 10 a batch (the second batch's cancel of the
     * good ones took the rejected ones the first left) */
    int64_t job5 = make_job(q, "rj", 28);
    snprintf(sql, sizeof(sql),
             "UPDATE items SET payload = NULL, error_code = 'invalid_json' WHERE job_id = %lld"
             " AND id < (SELECT min(id) + 23 FROM items WHERE job_id = %lld)",
             (long long)job5, (long long)job5);
    sql_exec(f->path, sql);
    assert_int_equal(queue_job_cancel(q, job5, &n, &err), ST_OK);
    assert_int_equal(n, 5);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM items WHERE job_id = %lld AND state = 'failed' AND"
             " payload IS NULL",
             (long long)job5);
    assert_int_equal(sql_int(f->path, sql), 23);
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM items WHERE job_id = %lld AND state = 'cancelled' AND"
             " payload IS NOT NULL",
             (long long)job5);
    assert_int_equal(sql_int(f->path, sql), 5);
    /* a cancel stopped between its transactions (3 of 6 items cancelled, the job still live),
     * whose other items a run then finished: the claim that finds nothing ends the job
     * cancelled, not done (the manifest would say complete, without "cancelled") */
    int64_t job3 = make_job(q, "c6", 6);
    snprintf(sql, sizeof(sql),
             "UPDATE items SET state = CASE WHEN id %% 2 = 0 THEN 'cancelled' ELSE 'done' END"
             " WHERE job_id = %lld",
             (long long)job3);
    sql_exec(f->path, sql);
    cl = claim(q, job3, start_run(q, job3), 4, 60000, &nc);
    assert_int_equal(nc, 0);
    queue_claimed_free(cl, nc);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs WHERE name = 'c6' AND"
                                      " state = 'cancelled'"),
                     1);
    /* and one whose items all finished ends done (a claim of any job: every job at once) */
    int64_t job4 = make_job(q, "d3", 3);
    snprintf(sql, sizeof(sql), "UPDATE items SET state = 'done' WHERE job_id = %lld",
             (long long)job4);
    sql_exec(f->path, sql);
    cl = claim(q, 0, start_run(q, job4), 4, 60000, &nc);
    assert_int_equal(nc, 0);
    queue_claimed_free(cl, nc);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs WHERE name = 'd3' AND"
                                      " state = 'done'"),
                     1);
    queue_close(q);
}

/* queue_job_retry_failed in bounded transactions: 25 failed items over two errors shards (one
 * failed item without a payload, rejected at submit, stays; one without a shard is retried and
 * counted nowhere) retried 10 ids at a time: every
 * other item queued again without its shard, each shard's superseded count up by its items,
 * the done job running again and the count right; a second retry finds nothing. */
static void test_retry_batches(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    queue_set_job_batch(q, 10);
    int64_t job = make_job(q, "r26", 26);
    int64_t run = start_run(q, job);
    int64_t sh[2] = {new_shard(q, run, job, QUEUE_SHARD_ERRORS, f),
                     new_shard(q, run, job, QUEUE_SHARD_ERRORS, f)};
    char sql[512];
    snprintf(sql, sizeof(sql),
             "UPDATE items SET state = 'failed', shard_id = CASE WHEN id %% 3 = 0 THEN %lld"
             " ELSE %lld END, shard_record = id; UPDATE items SET payload = NULL, shard_id ="
             " NULL WHERE id = (SELECT max(id) FROM items); UPDATE items SET shard_id = NULL"
             " WHERE id = (SELECT min(id) + 1 FROM items); UPDATE jobs SET state = 'done'",
             (long long)sh[0], (long long)sh[1]);
    sql_exec(f->path, sql);
    int64_t want0 = sql_int(f->path, "SELECT count(*) FROM items WHERE id % 3 = 0 AND payload"
                                     " IS NOT NULL AND shard_id IS NOT NULL"),
            n = 0;
    assert_int_equal(queue_job_retry_failed(q, job, &n, &err), ST_OK);
    assert_int_equal(n, 25);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'queued' AND"
                                      " shard_id IS NULL AND attempts = 0"),
                     25);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'failed'"), 1);
    snprintf(sql, sizeof(sql), "SELECT superseded FROM shards WHERE id = %lld", (long long)sh[0]);
    assert_int_equal(sql_int(f->path, sql), want0);
    snprintf(sql, sizeof(sql), "SELECT superseded FROM shards WHERE id = %lld", (long long)sh[1]);
    assert_int_equal(sql_int(f->path, sql), 24 - want0); /* one had no shard: counted nowhere */
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs WHERE state = 'running'"), 1);
    assert_int_equal(queue_job_retry_failed(q, job, &n, &err), ST_OK);
    assert_int_equal(n, 0);
    queue_close(q);
}

static void sample_at(struct queue *q, int64_t run, int64_t job, int64_t t)
{
    struct err_detail err = {0};
    struct queue_sample smp = {.t_ms = t, .run_id = run, .job_id = job};
    assert_int_equal(queue_sample_add(q, &smp, &err), ST_OK);
}

static void expect_timing(struct queue *q, int64_t job, int64_t first, int64_t last, int64_t worked)
{
    struct err_detail err = {0};
    int64_t f0 = -1, l0 = -1, w0 = -1;
    assert_int_equal(queue_job_timing(q, job, &f0, &l0, &w0, &err), ST_OK);
    assert_int_equal(f0, first);
    assert_int_equal(l0, last);
    assert_int_equal(w0, worked);
}

/* A job's time span counts a run over all jobs only for its own work on the job (from the end
 * of its work on the job before, by its samples, to its last sample of this one); before, every
 * such run counted whole for every job: a job that ran for a second showed "over 31 s of runs",
 * one never run the span of every run. */
static void test_job_timing(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t a = make_job(q, "a", 1), b = make_job(q, "b", 1), c = make_job(q, "c", 1);
    int64_t r1 = start_run(q, 0); /* at 1,000,000: a, then b */
    sample_at(q, r1, a, 1005000);
    sample_at(q, r1, a, 1010000);
    sample_at(q, r1, b, 1015000);
    sample_at(q, r1, b, 1020000);
    f->now = 1021000;
    assert_int_equal(queue_run_end(q, r1, "drained", NULL, NULL, &err), ST_OK);
    f->now = 1100000;
    int64_t r2 = start_run(q, b); /* b alone */
    f->now = 1200000;
    assert_int_equal(queue_run_end(q, r2, "drained", NULL, NULL, &err), ST_OK);
    /* b: r1 from its last sample of a to its end (it did nothing after b), then r2; the 79 s
     * between the runs are no time of b's (before, status divided by the whole span) */
    expect_timing(q, a, 1000000, 1010000, 10000);
    expect_timing(q, b, 1010000, 1200000, 11000 + 100000);
    expect_timing(q, c, 0, 0, 0);
    expect_timing(q, 0, 1000000, 1200000, 21000 + 100000); /* any job: every run */
    /* a live run over all jobs, working on a: until its heartbeat; once it has moved on to c,
     * until its last sample of a */
    f->now = 1300000;
    int64_t r3 = start_run(q, 0);
    sample_at(q, r3, a, 1305000);
    f->now = 1308000;
    assert_int_equal(queue_run_heartbeat(q, r3, &err), ST_OK);
    expect_timing(q, a, 1000000, 1308000, 10000 + 8000);
    sample_at(q, r3, c, 1309000);
    expect_timing(q, a, 1000000, 1305000, 10000 + 5000);
    expect_timing(q, c, 1305000, 1309000, 4000);
    /* the run list of a job: the runs with its samples, and those started for it */
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    assert_int_equal(queue_run_list_job(q, b, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 2);
    assert_int_equal(runs[0].id, r1);
    assert_int_equal(runs[1].id, r2);
    queue_run_info_free(runs, n);
    assert_int_equal(queue_run_list_job(q, c, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].id, r3);
    queue_run_info_free(runs, n);
    /* a run found dead stopped at its last heartbeat, not when another process noticed (as
     * older quern recorded its end); one over all jobs killed while on a job likewise */
    f->now = 1400000;
    int64_t r4 = start_run(q, c);
    f->now = 1405000;
    assert_int_equal(queue_run_heartbeat(q, r4, &err), ST_OK);
    char sql[160];
    snprintf(sql, sizeof(sql),
             "UPDATE runs SET ended = 1500000, exit_reason = 'dead' WHERE id = %lld",
             (long long)r4);
    sql_exec(f->path, sql);
    f->now = 1500000;
    expect_timing(q, c, 1305000, 1405000, 4000 + 5000);
    int64_t r5 = start_run(q, 0); /* at 1,500,000 */
    sample_at(q, r5, b, 1502000);
    f->now = 1507000;
    assert_int_equal(queue_run_heartbeat(q, r5, &err), ST_OK);
    snprintf(sql, sizeof(sql),
             "UPDATE runs SET ended = 1600000, exit_reason = 'dead' WHERE id = %lld",
             (long long)r5);
    sql_exec(f->path, sql);
    expect_timing(q, b, 1010000, 1507000, 11000 + 100000 + 7000);
    queue_close(q);
}

/* queue_model_sha reads a file once and then knows it by its identity; a file changed since is
 * read again, and one changed within the last 2 s is not recorded (a write in the same clock
 * tick could hide behind an unchanged identity). */
static void test_model_sha(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    char path[512], want[SHA256_HEX_LEN], got[SHA256_HEX_LEN];
    snprintf(path, sizeof(path), "%s.model", f->path);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 100000; i++)
        fputc(i * 7 % 251, fp);
    fclose(fp);
    int cached = -1;
    /* just written: hashed, not recorded */
    assert_int_equal(queue_model_sha(q, path, got, &cached, &err), ST_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(sha256_file(path, SHA256_WHOLE_FILE, want, &err), ST_OK);
    assert_string_equal(got, want);
    assert_int_equal(queue_model_sha(q, path, got, &cached, &err), ST_OK);
    assert_int_equal(cached, 0);
    /* settled: recorded once read, then not read again */
    struct timespec ts = {2, 200000000};
    nanosleep(&ts, NULL);
    assert_int_equal(queue_model_sha(q, path, got, &cached, &err), ST_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(queue_model_sha(q, path, got, &cached, &err), ST_OK);
    assert_int_equal(cached, 1);
    assert_string_equal(got, want);
    /* changed: read again, the new hash */
    fp = fopen(path, "ab");
    assert_non_null(fp);
    fputc('x', fp);
    fclose(fp);
    assert_int_equal(queue_model_sha(q, path, got, &cached, &err), ST_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(sha256_file(path, SHA256_WHOLE_FILE, want, &err), ST_OK);
    assert_string_equal(got, want);
    /* a missing file is an error */
    unlink(path);
    assert_int_equal(queue_model_sha(q, path, got, &cached, &err), ST_ERR_IO);
    queue_close(q);
}

/* proc_tag_self names this process: alive; a dead child's tag, dead; another host's or boot's,
 * or a malformed one, unknown. */
static void test_proc_tag(void **state)
{
    (void)state;
    char tag[300], other[400];
    assert_int_equal(proc_tag_self(tag, sizeof(tag)), 0);
    assert_int_equal(proc_tag_liveness(tag), PROC_ALIVE);
    assert_int_equal(proc_tag_self(other, 8), -1); /* does not fit */
    assert_int_equal(test_dead_proc_tag(other, sizeof(other)), 0);
    assert_int_equal(proc_tag_liveness(other), PROC_DEAD); /* exited and reaped */
    /* the same process on another host, or another boot: nothing can be said */
    snprintf(other, sizeof(other), "%s-x", tag);
    assert_int_equal(proc_tag_liveness(other), PROC_UNKNOWN);
    char *boot = strchr(strchr(strchr(tag, '.') + 1, '.') + 1, '.') + 1;
    *boot = *boot == '0' ? '1' : '0';
    assert_int_equal(proc_tag_liveness(tag), PROC_UNKNOWN);
    assert_int_equal(proc_tag_liveness("12.34"), PROC_UNKNOWN);
    assert_int_equal(proc_tag_liveness(""), PROC_UNKNOWN);
    assert_int_equal(proc_tag_liveness("-1.5.6.0123456789ab.h"), PROC_UNKNOWN);
}

/* queue_jobs_gc deletes the job of a submit whose process died (a forked child that exits
 * without publishing) with its items, so its name can be used again, and the job of a submit
 * on another host once its heartbeat is stale; it leaves alone a not-ready job whose submit is
 * alive (this process, even with a stale heartbeat), a remote one with a fresh heartbeat, and
 * every ready job. */
static void test_jobs_gc(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    struct proc_identity self;
    proc_identity_self(&self);
    if (!self.boot_id[0] || !self.pid_ns[0] || !self.start_ticks)
        fail_msg("no /proc identity on this machine");
    int64_t ready_job = make_job(q, "ready", 3);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct queue *cq = NULL;
        struct proc_identity me;
        proc_identity_self(&me);
        int64_t run = 0;
        if (queue_open(&cq, f->path, NULL) || !start_submit(cq, &me, &run) ||
            !make_submitting_job(cq, "dead", run, 1500))
            _exit(1);
        _exit(0); /* killed mid-submit: never published, connection not closed */
    }
    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    int64_t dead_job = sql_int(f->path, "SELECT id FROM jobs WHERE name = 'dead'");
    assert_true(dead_job > 0);
    assert_int_equal(count_where(f, "items", "job_id", dead_job), 1500);

    /* this process's own submit, and two on another host: one goes stale, one stays fresh */
    int64_t mine_run = 0, stale_run = 0, fresh_run = 0;
    assert_true(start_submit(q, &self, &mine_run) > 0);
    int64_t mine = make_submitting_job(q, "mine", mine_run, 4);
    struct proc_identity other = self;
    snprintf(other.host, sizeof(other.host), "elsewhere");
    assert_true(start_submit(q, &other, &stale_run) > 0);
    int64_t stale = make_submitting_job(q, "stale", stale_run, 2);
    f->now += 600000;
    assert_true(start_submit(q, &other, &fresh_run) > 0);
    int64_t fresh = make_submitting_job(q, "fresh", fresh_run, 2);
    assert_true(mine > 0 && stale > 0 && fresh > 0);

    int64_t deleted = 0;
    assert_int_equal(queue_jobs_gc(q, &self, 300000, &deleted, &err), ST_OK);
    assert_int_equal(deleted, 2);
    assert_int_equal(count_where(f, "jobs", "id", dead_job), 0);
    assert_int_equal(count_where(f, "items", "job_id", dead_job), 0);
    assert_int_equal(count_where(f, "jobs", "id", stale), 0);
    assert_int_equal(count_where(f, "items", "job_id", stale), 0);
    assert_int_equal(count_where(f, "items", "job_id", mine), 4);
    assert_int_equal(count_where(f, "items", "job_id", fresh), 2);
    assert_int_equal(count_where(f, "items", "job_id", ready_job), 3);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM runs WHERE exit_reason = 'dead'"), 2);
    /* the stale submit finds out at its next heartbeat */
    assert_int_equal(queue_run_heartbeat(q, stale_run, &err), ST_ERR_CONFLICT);
    assert_int_equal(queue_job_publish(q, stale, NULL, &err), ST_ERR_NOT_FOUND);
    /* the name is free again; nothing more to collect */
    int64_t again = make_job(q, "dead", 1);
    assert_true(again > dead_job);
    assert_int_equal(queue_jobs_gc(q, &self, 300000, &deleted, &err), ST_OK);
    assert_int_equal(deleted, 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs"), 4);
    /* the live submit publishes as usual */
    assert_int_equal(queue_job_publish(q, mine, NULL, &err), ST_OK);
    queue_close(q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_create_reopen, setup, teardown),
        cmocka_unit_test_setup_teardown(test_foreign_file_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_must_exist, setup, teardown),
        cmocka_unit_test_setup_teardown(test_check_integrity, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_rows, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fs_kind, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fs_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_exclusive, setup, teardown),
        cmocka_unit_test_setup_teardown(test_exclusive_hot_journal, setup, teardown),
        cmocka_unit_test_setup_teardown(test_newer_version_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_item_add_duplicate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_schema_versions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v6_forms, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v1_to_v2, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v2_to_v3, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v3_to_v4_samples, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v4_to_v5_engine, setup, teardown),
        cmocka_unit_test_setup_teardown(test_run_list_job, setup, teardown),
        cmocka_unit_test_setup_teardown(test_not_ready_job_invisible, setup, teardown),
        cmocka_unit_test_setup_teardown(test_discard_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retry_batches, setup, teardown),
        cmocka_unit_test(test_proc_tag),
        cmocka_unit_test_setup_teardown(test_model_sha, setup, teardown),
        cmocka_unit_test_setup_teardown(test_job_timing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_jobs_gc, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
