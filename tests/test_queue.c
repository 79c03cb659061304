/* Unit tests for queue/: schema creation, migration and the newer-version refusal; the files
 * queue_open refuses unchanged (not a queue, missing with must_exist, corrupt with
 * check_integrity, on a network file system) and damaged rows read as errors; items and
 * duplicate custom_ids; claim order and limits; lease expiry with a fake clock; the
 * all-or-nothing shard commit and its exactly-once rule; runs' live progress; release, cancel,
 * retry and counts; shards; four forked processes draining one queue with no item done
 * twice; and jobs being submitted: invisible to runs until published, discarded in batches,
 * collected when their submit died. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/proc.h"
#include "queue/queue.h"
#include "queue/queue_internal.h"

/* ---- fixture: a temporary directory per test, a fake clock -------------------------------- */

struct fixture {
    char dir[64];   /* mkdtemp directory */
    char path[128]; /* dir/queue.db */
    int64_t now;    /* fake clock, unix ms */
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    snprintf(f->dir, sizeof(f->dir), "/tmp/quern-test-queue-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    snprintf(f->path, sizeof(f->path), "%s/queue.db", f->dir);
    f->now = 1000000;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    DIR *d = opendir(f->dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            char p[512];
            snprintf(p, sizeof(p), "%s/%s", f->dir, e->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(f->dir);
    free(f);
    return 0;
}

static int64_t fake_clock(void *ctx)
{
    return *(int64_t *)ctx;
}

static struct queue *open_q(struct fixture *f)
{
    struct queue *q = NULL;
    struct err_detail err = {0};
    enum status st = queue_open(&q, f->path, &err);
    if (st != ST_OK)
        fail_msg("queue_open: %s", err.msg);
    queue_set_clock(q, fake_clock, &f->now);
    return q;
}

/* A job named name with n queued items c00000.. (payload {"i":k}, priority 0). */
static int64_t make_job(struct queue *q, const char *name, int n)
{
    struct err_detail err = {0};
    struct queue_job_spec spec = {.name = name,
                                  .model_path = "m.gguf",
                                  .model_sha256 = "ab",
                                  .params_json = "{\"temperature\":0}",
                                  .out_dir = "out",
                                  .seed = 0xFFFFFFFFFFFFFFF0ull};
    int64_t job = 0;
    assert_int_equal(queue_job_create(q, &spec, &job, &err), ST_OK);
    assert_true(job > 0);
    assert_int_equal(queue_tx_begin(q, &err), ST_OK);
    for (int i = 0; i < n; i++) {
        char cid[32], payload[32];
        snprintf(cid, sizeof(cid), "c%05d", i);
        snprintf(payload, sizeof(payload), "{\"i\":%d}", i);
        struct queue_item_spec it = {.custom_id = cid, .payload = payload, .line_no = i + 1};
        if (queue_item_add(q, job, &it, NULL, &err) != ST_OK)
            fail_msg("item_add: %s", err.msg);
    }
    assert_int_equal(queue_tx_commit(q, &err), ST_OK);
    return job;
}

static int64_t start_run(struct queue *q, int64_t job)
{
    struct err_detail err = {0};
    struct queue_run_spec rs = {.job_id = job, .worker_id = "w", .host = "h", .pid = getpid()};
    int64_t run = 0;
    assert_int_equal(queue_run_start(q, &rs, &run, &err), ST_OK);
    assert_true(run > 0);
    return run;
}

static int64_t new_shard(struct queue *q, int64_t run, int64_t job, enum queue_shard_kind kind,
                         struct fixture *f)
{
    struct err_detail err = {0};
    int64_t seq = -1, id = 0;
    assert_int_equal(queue_tx_begin(q, &err), ST_OK);
    assert_int_equal(queue_shard_next_seq(q, job, kind, &seq, &err), ST_OK);
    char path[256];
    snprintf(path, sizeof(path), "%s/%lld-%s-%05lld", f->dir, (long long)job,
             queue_shard_kind_str(kind), (long long)seq);
    assert_int_equal(queue_shard_create(q, run, job, kind, seq, path, &id, &err), ST_OK);
    assert_int_equal(queue_tx_commit(q, &err), ST_OK);
    return id;
}

/* Independent look at the file: the first column of the first row of sql as an integer. */
static int64_t sql_int(const char *path, const char *sql)
{
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        fail_msg("%s: %s", sql, sqlite3_errmsg(db));
    int64_t v = -1;
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
}

static void sql_exec(const char *path, const char *sql)
{
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        fail_msg("%s: %s", sql, msg);
    sqlite3_close(db);
}

static int64_t item_int(struct fixture *f, int64_t item, const char *col)
{
    char sql[128];
    snprintf(sql, sizeof(sql), "SELECT %s FROM items WHERE id = %lld", col, (long long)item);
    return sql_int(f->path, sql);
}

static enum queue_item_state item_state(struct fixture *f, int64_t item)
{
    char sql[160];
    snprintf(sql, sizeof(sql),
             "SELECT CASE state WHEN 'queued' THEN 0 WHEN 'leased' THEN 1 WHEN 'done' THEN 2 "
             "WHEN 'failed' THEN 3 WHEN 'cancelled' THEN 4 END FROM items WHERE id = %lld",
             (long long)item);
    return (enum queue_item_state)sql_int(f->path, sql);
}

static struct queue_claimed *claim(struct queue *q, int64_t job, int64_t run, int max,
                                   int64_t lease_ms, size_t *n)
{
    struct err_detail err = {0};
    struct queue_claimed *c = NULL;
    if (queue_claim(q, job, run, max, lease_ms, &c, n, &err) != ST_OK)
        fail_msg("claim: %s", err.msg);
    return c;
}

static struct queue_shard get_shard(struct queue *q, int64_t job, int64_t shard_id)
{
    struct err_detail err = {0};
    struct queue_shard *sh = NULL, out = {0};
    size_t n = 0;
    assert_int_equal(queue_shard_list(q, job, &sh, &n, &err), ST_OK);
    bool found = false;
    for (size_t i = 0; i < n; i++)
        if (sh[i].id == shard_id) {
            out = sh[i];
            out.path = NULL;
            found = true;
        }
    queue_shard_list_free(sh, n);
    assert_true(found);
    return out;
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

/* check_integrity: a page of garbage in the middle of a queue (header intact) is ST_ERR_FORMAT
 * with quick_check's words and the remedy, before anything is written. */
static void test_check_integrity(void **state)
{
    struct fixture *f = *state;
    make_closed_queue(f, 2000);
    int64_t pages = sql_int(f->path, "PRAGMA page_count");
    int64_t psize = sql_int(f->path, "PRAGMA page_size");
    assert_true(pages > 8);
    scribble(f->path, (long)(pages / 2 * psize + 64), (size_t)psize / 2);
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

/* queue_run_progress stores the document with the heartbeat; queue_run_list_live lists runs
 * (not submits) that have not ended, with their heartbeat's age by the queue's clock; a run
 * that ended, or none, is refused as by queue_run_heartbeat. */
static void test_run_progress(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 2);
    int64_t a = start_run(q, job), b = start_run(q, 0);
    struct queue_run_spec sub = {.host = "h", .pid = 1, .submit = true};
    int64_t s = 0;
    assert_int_equal(queue_run_start(q, &sub, &s, &err), ST_OK);
    f->now += 5000;
    assert_int_equal(queue_run_progress(q, a, "{\"gen_tok_s\":12.5}", &err), ST_OK);
    f->now += 3000;
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    assert_int_equal(queue_run_list_live(q, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 2);
    assert_int_equal(runs[0].id, a);
    assert_int_equal(runs[0].job_id, job);
    assert_string_equal(runs[0].worker_id, "w");
    assert_string_equal(runs[0].progress_json, "{\"gen_tok_s\":12.5}");
    assert_int_equal(runs[0].started_ms, f->now - 8000);
    assert_int_equal(runs[0].heartbeat_ms, f->now - 3000);
    assert_int_equal(runs[0].age_ms, 3000);
    assert_int_equal(runs[1].id, b);
    assert_int_equal(runs[1].job_id, 0);
    assert_null(runs[1].progress_json);
    assert_int_equal(runs[1].age_ms, 8000);
    queue_run_info_free(runs, n);
    assert_int_equal(queue_run_end(q, b, "drained", NULL, NULL, &err), ST_OK);
    assert_int_equal(queue_run_progress(q, b, "{}", &err), ST_ERR_CONFLICT);
    assert_int_equal(queue_run_progress(q, 999, "{}", &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_run_progress(q, a, NULL, &err), ST_OK); /* cleared */
    assert_int_equal(queue_run_list_live(q, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 1);
    assert_null(runs[0].progress_json);
    assert_int_equal(runs[0].age_ms, 0);
    queue_run_info_free(runs, n);
    queue_close(q);
}

/* A run that stalls past its own lease does not sweep its own items at its next claim; another
 * run's claim does. */
static void test_own_leases_not_swept(void **state)
{
    struct fixture *f = *state;
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 4);
    int64_t a = start_run(q, job), b = start_run(q, job);
    size_t n = 0;
    struct queue_claimed *ca = claim(q, job, a, 2, 1000, &n);
    assert_int_equal(n, 2);
    f->now += 5000; /* a's leases expired; a claims again before its heartbeat */
    struct queue_claimed *c2 = claim(q, job, a, 10, 1000, &n);
    assert_int_equal(n, 2); /* the two still queued, not its own two again */
    for (size_t i = 0; i < n; i++)
        assert_true(c2[i].id != ca[0].id && c2[i].id != ca[1].id);
    assert_int_equal(item_int(f, ca[0].id, "lease_owner"), a);
    assert_int_equal(item_int(f, ca[0].id, "attempts"), 1);
    queue_claimed_free(c2, n);
    f->now += 5000; /* all four expired: b sweeps and claims them all */
    c2 = claim(q, job, b, 10, 1000, &n);
    assert_int_equal(n, 4);
    queue_claimed_free(c2, n);
    queue_claimed_free(ca, 2);
    queue_close(q);
}

/* retry --failed only re-queues items that can run: a line rejected at submit has no payload
 * and stays failed (it crashed the run and broke export when re-queued). */
static void test_retry_skips_submit_rejects(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 1);
    struct queue_item_spec bad = {.source = "in.jsonl", .line_no = 2, .error_code = "invalid_json",
                                  .error_msg = "garbage"};
    int64_t bad_id = 0;
    assert_int_equal(queue_item_add(q, job, &bad, &bad_id, &err), ST_OK);
    int64_t run = start_run(q, job);
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, 4, 60000, &n);
    assert_int_equal(n, 2);
    assert_int_equal(c[1].id, bad_id);
    assert_null(c[1].payload);
    int64_t errs = new_shard(q, run, job, QUEUE_SHARD_ERRORS, f);
    struct queue_done d[2] = {{.item_id = c[0].id, .error_code = "engine", .error_msg = "x"},
                              {.item_id = bad_id, .error_code = "invalid_json", .error_msg = "g"}};
    assert_int_equal(queue_commit_shard(q, run, errs, 10, 2, d, 2, NULL, &err), ST_OK);
    int64_t retried = 0;
    assert_int_equal(queue_job_retry_failed(q, job, &retried, &err), ST_OK);
    assert_int_equal(retried, 1);
    assert_int_equal(item_state(f, bad_id), QUEUE_ITEM_FAILED);
    assert_int_equal(item_state(f, c[0].id), QUEUE_ITEM_QUEUED);
    assert_int_equal(get_shard(q, job, errs).superseded, 1);
    queue_claimed_free(c, n);
    c = claim(q, job, run, 4, 60000, &n);
    assert_int_equal(n, 1);
    assert_non_null(c[0].payload);
    queue_claimed_free(c, n);
    queue_close(q);
}

/* Each committed item remembers the index of its record in the shard, also when a retried item
 * is written to the same shard a second time (export keeps only that one). */
static void test_shard_record_index(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 3);
    int64_t run = start_run(q, job);
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, 3, 60000, &n);
    int64_t errs = new_shard(q, run, job, QUEUE_SHARD_ERRORS, f);
    struct queue_done d[3];
    for (int i = 0; i < 3; i++)
        d[i] = (struct queue_done){.item_id = c[i].id, .error_code = "e", .error_msg = "m"};
    assert_int_equal(queue_commit_shard(q, run, errs, 10, 2, d, 2, NULL, &err), ST_OK);
    assert_int_equal(queue_commit_shard(q, run, errs, 20, 3, d + 2, 1, NULL, &err), ST_OK);
    assert_int_equal(item_int(f, c[0].id, "shard_record"), 0);
    assert_int_equal(item_int(f, c[1].id, "shard_record"), 1);
    assert_int_equal(item_int(f, c[2].id, "shard_record"), 2);
    int64_t retried = 0;
    assert_int_equal(queue_job_retry_failed(q, job, &retried, &err), ST_OK);
    assert_int_equal(retried, 3);
    assert_int_equal(item_int(f, c[1].id, "shard_record IS NULL"), 1);
    queue_claimed_free(c, n);
    c = claim(q, job, run, 1, 60000, &n);
    assert_int_equal(n, 1);
    d[0].item_id = c[0].id;
    assert_int_equal(queue_commit_shard(q, run, errs, 30, 4, d, 1, NULL, &err), ST_OK);
    assert_int_equal(item_int(f, c[0].id, "shard_record"), 3);
    queue_claimed_free(c, n);
    queue_close(q);
}

/* Same host, boot and namespace: a run whose process has exited is ended at once by
 * queue_reap_dead (leases back to queued, attempts kept, shard adoptable with any lease);
 * a live one, or one on another host, is left alone. */
static void test_reap_dead_runs(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 4);
    struct proc_identity self;
    proc_identity_self(&self);
    if (!self.boot_id[0] || !self.pid_ns[0] || !self.start_ticks)
        fail_msg("no /proc identity on this machine");
    /* a child that records itself as a run, claims two items, then exits */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct queue *cq = NULL;
        struct proc_identity me;
        proc_identity_self(&me);
        if (queue_open(&cq, f->path, NULL))
            _exit(1);
        struct queue_run_spec rs = {.job_id = job, .host = me.host, .pid = me.pid,
                                    .boot_id = me.boot_id, .pid_ns = me.pid_ns,
                                    .pstart = me.start_ticks};
        int64_t run = 0;
        struct queue_claimed *items = NULL;
        size_t k = 0;
        if (queue_run_start(cq, &rs, &run, NULL) ||
            queue_claim(cq, job, run, 2, 3600000, &items, &k, NULL) || k != 2)
            _exit(1);
        queue_claimed_free(items, k);
        queue_close(cq);
        _exit(0);
    }
    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    /* this process as a live run, and a run on another host with a dead-looking pid */
    struct queue_run_spec live = {.job_id = job, .host = self.host, .pid = self.pid,
                                  .boot_id = self.boot_id, .pid_ns = self.pid_ns,
                                  .pstart = self.start_ticks};
    struct queue_run_spec remote = {.job_id = job, .host = "elsewhere", .pid = pid,
                                    .boot_id = self.boot_id, .pid_ns = self.pid_ns,
                                    .pstart = 1};
    int64_t r_live = 0, r_remote = 0;
    assert_int_equal(queue_run_start(q, &live, &r_live, &err), ST_OK);
    assert_int_equal(queue_run_start(q, &remote, &r_remote, &err), ST_OK);
    /* the same pid with another start time is another process: dead too */
    struct queue_run_spec reused = live;
    reused.pstart = self.start_ticks + 1;
    int64_t r_reused = 0;
    assert_int_equal(queue_run_start(q, &reused, &r_reused, &err), ST_OK);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'leased'"), 2);
    int64_t reaped = 0;
    assert_int_equal(queue_reap_dead(q, &self, &reaped, &err), ST_OK);
    assert_int_equal(reaped, 2);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'leased'"), 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE attempts = 1"), 2);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM runs WHERE exit_reason = 'dead'"), 2);
    char sql[128];
    snprintf(sql, sizeof(sql), "SELECT ended IS NULL FROM runs WHERE id = %lld", (long long)r_live);
    assert_int_equal(sql_int(f->path, sql), 1);
    snprintf(sql, sizeof(sql), "SELECT ended IS NULL FROM runs WHERE id = %lld",
             (long long)r_remote);
    assert_int_equal(sql_int(f->path, sql), 1);
    /* nothing more to reap */
    assert_int_equal(queue_reap_dead(q, &self, &reaped, &err), ST_OK);
    assert_int_equal(reaped, 0);
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

/* ---- claiming ------------------------------------------------------------------------------ */

static void test_claim_order_limits(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 0);
    int64_t ids[10];
    for (int i = 0; i < 10; i++) {
        char cid[16];
        snprintf(cid, sizeof(cid), "p%d", i);
        struct queue_item_spec it = {.custom_id = cid, .payload = cid, .priority = i % 3};
        assert_int_equal(queue_item_add(q, job, &it, &ids[i], &err), ST_OK);
    }
    int64_t other = make_job(q, "other", 2);
    int64_t run = start_run(q, job);

    /* expected order: priority 2 (i = 2, 5, 8), 1 (1, 4, 7), 0 (0, 3, 6, 9) */
    const int order[10] = {2, 5, 8, 1, 4, 7, 0, 3, 6, 9};
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, 4, 60000, &n);
    assert_int_equal(n, 4);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(c[i].id, ids[order[i]]);
        assert_int_equal(c[i].job_id, job);
        assert_int_equal(c[i].attempts, 1);
        assert_int_equal(c[i].max_attempts, QUEUE_DEFAULT_MAX_ATTEMPTS);
        char cid[16];
        snprintf(cid, sizeof(cid), "p%d", order[i]);
        assert_string_equal(c[i].custom_id, cid);
        assert_string_equal(c[i].payload, cid);
        assert_int_equal(item_state(f, c[i].id), QUEUE_ITEM_LEASED);
        assert_int_equal(item_int(f, c[i].id, "lease_owner"), run);
        assert_int_equal(item_int(f, c[i].id, "lease_expiry"), f->now + 60000);
    }
    queue_claimed_free(c, n);
    struct queue_job j;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_RUNNING);
    queue_job_free(&j);
    assert_int_equal(queue_job_get(q, other, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_QUEUED);
    queue_job_free(&j);

    c = claim(q, job, run, 100, 60000, &n);
    assert_int_equal(n, 6);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(c[i].id, ids[order[4 + i]]);
    queue_claimed_free(c, n);
    c = claim(q, job, run, 100, 60000, &n);
    assert_int_equal(n, 0);
    assert_null(c);

    /* any job: only the other job's items are left */
    c = claim(q, 0, run, 100, 60000, &n);
    assert_int_equal(n, 2);
    assert_int_equal(c[0].job_id, other);
    assert_string_equal(c[0].custom_id, "c00000");
    assert_string_equal(c[1].custom_id, "c00001");
    queue_claimed_free(c, n);
    queue_claimed_free(NULL, 0);

    /* bad arguments, unknown and ended runs */
    assert_int_equal(queue_claim(q, job, run, 0, 1000, &c, &n, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_claim(q, job, run, 1, 0, &c, &n, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_claim(q, job, 777, 1, 1000, &c, &n, &err), ST_ERR_INVALID_ARG);
    int64_t requeued = -1;
    assert_int_equal(queue_run_end(q, run, "drained", "{\"items\":12}", &requeued, &err), ST_OK);
    assert_int_equal(requeued, 12);
    assert_int_equal(queue_claim(q, job, run, 1, 1000, &c, &n, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "ended"));
    assert_int_equal(queue_run_end(q, run, "again", NULL, NULL, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM runs WHERE exit_reason = 'drained' "
                                      "AND summary_json = '{\"items\":12}' AND ended IS NOT NULL"),
                     1);
    /* run_end kept the attempt: the items were not finished */
    assert_int_equal(item_int(f, ids[0], "attempts"), 1);
    assert_int_equal(item_state(f, ids[0]), QUEUE_ITEM_QUEUED);
    queue_close(q);
}

static void test_lease_expiry_reclaim(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 5);
    int64_t a = start_run(q, job), b = start_run(q, job);

    size_t na = 0, nb = 0;
    struct queue_claimed *ca = claim(q, job, a, 3, 1000, &na);
    assert_int_equal(na, 3);
    int64_t expiry = f->now + 1000;

    /* not expired yet: b gets the other two only */
    f->now += 999;
    struct queue_claimed *cb = claim(q, job, b, 10, 100000, &nb);
    assert_int_equal(nb, 2);
    queue_claimed_free(cb, nb);

    /* heartbeat before expiry keeps a's leases */
    int64_t held = 0;
    assert_int_equal(queue_lease_extend(q, a, 1000, &held, &err), ST_OK);
    assert_int_equal(held, 3);
    assert_int_equal(item_int(f, ca[0].id, "lease_expiry"), f->now + 1000);
    char sql[64];
    snprintf(sql, sizeof(sql), "SELECT heartbeat FROM runs WHERE id = %lld", (long long)a);
    assert_int_equal(sql_int(f->path, sql), f->now);
    expiry = f->now + 1000;
    f->now = expiry - 1;
    cb = claim(q, job, b, 10, 1000, &nb);
    assert_int_equal(nb, 0);

    /* expired (expiry <= now): b re-claims them, attempts counted */
    f->now = expiry;
    cb = claim(q, job, b, 10, 5000, &nb);
    assert_int_equal(nb, 3);
    for (size_t i = 0; i < nb; i++) {
        assert_int_equal(cb[i].id, ca[i].id);
        assert_int_equal(cb[i].attempts, 2);
        assert_int_equal(item_int(f, cb[i].id, "lease_owner"), b);
    }
    /* a's heartbeat now reports it holds nothing */
    assert_int_equal(queue_lease_extend(q, a, 1000, &held, &err), ST_OK);
    assert_int_equal(held, 0);

    /* a's late commit must not mark b's items: conflict, everything flagged, nothing changed */
    int64_t sa = new_shard(q, a, job, QUEUE_SHARD_RESULTS, f);
    struct queue_done d[3];
    bool lost[3] = {false, false, false};
    for (int i = 0; i < 3; i++)
        d[i] = (struct queue_done){.item_id = ca[i].id, .prompt_tokens = 5, .completion_tokens = 7};
    assert_int_equal(queue_commit_shard(q, a, sa, 300, 3, d, 3, lost, &err), ST_ERR_CONFLICT);
    assert_true(lost[0] && lost[1] && lost[2]);
    struct queue_shard sh = get_shard(q, job, sa);
    assert_int_equal(sh.committed_bytes, 0);
    assert_int_equal(sh.records, 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(item_state(f, ca[i].id), QUEUE_ITEM_LEASED);
        assert_int_equal(item_int(f, ca[i].id, "lease_owner"), b);
    }
    /* b commits them */
    int64_t sb = new_shard(q, b, job, QUEUE_SHARD_RESULTS, f);
    assert_int_equal(queue_commit_shard(q, b, sb, 300, 3, d, 3, lost, &err), ST_OK);
    assert_false(lost[0] || lost[1] || lost[2]);
    for (int i = 0; i < 3; i++)
        assert_int_equal(item_state(f, ca[i].id), QUEUE_ITEM_DONE);
    queue_claimed_free(ca, na);
    queue_claimed_free(cb, nb);

    /* an expired lease that nobody re-claimed is still the owner's to commit */
    int64_t job2 = make_job(q, "j2", 1);
    ca = claim(q, job2, a, 1, 100, &na);
    assert_int_equal(na, 1);
    f->now += 10000;
    int64_t sa2 = new_shard(q, a, job2, QUEUE_SHARD_RESULTS, f);
    d[0] = (struct queue_done){.item_id = ca[0].id};
    assert_int_equal(queue_commit_shard(q, a, sa2, 10, 1, d, 1, NULL, &err), ST_OK);
    assert_int_equal(item_state(f, ca[0].id), QUEUE_ITEM_DONE);
    queue_claimed_free(ca, na);

    /* the explicit sweep */
    int64_t job3 = make_job(q, "j3", 2);
    ca = claim(q, job3, a, 2, 100, &na);
    queue_claimed_free(ca, na);
    int64_t expired = -1;
    assert_int_equal(queue_lease_expire(q, &expired, &err), ST_OK);
    assert_int_equal(expired, 0);
    f->now += 100;
    assert_int_equal(queue_lease_expire(q, &expired, &err), ST_OK);
    assert_int_equal(expired, 2);
    assert_int_equal(queue_lease_extend(q, 4242, 100, NULL, &err), ST_ERR_INVALID_ARG);
    queue_close(q);
}

/* ---- the shard commit ---------------------------------------------------------------------- */

static void test_commit_all_or_nothing(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 6);
    int64_t other_job = make_job(q, "other", 1);
    int64_t run = start_run(q, job), run2 = start_run(q, job);
    size_t n = 0, n2 = 0;
    struct queue_claimed *c = claim(q, job, run, 5, 60000, &n);
    assert_int_equal(n, 5);
    struct queue_claimed *c2 = claim(q, other_job, run, 1, 60000, &n2);
    assert_int_equal(n2, 1);
    int64_t res = new_shard(q, run, job, QUEUE_SHARD_RESULTS, f);
    int64_t errs = new_shard(q, run, job, QUEUE_SHARD_ERRORS, f);
    int64_t res2 = new_shard(q, run2, job, QUEUE_SHARD_RESULTS, f);

    /* item 2 was released: the batch of three is refused as a whole */
    int64_t rel = c[2].id, released = 0;
    assert_int_equal(queue_release(q, run, &rel, 1, &released, &err), ST_OK);
    assert_int_equal(released, 1);
    struct queue_done d[4];
    for (int i = 0; i < 3; i++)
        d[i] = (struct queue_done){
            .item_id = c[i].id, .prompt_tokens = 10 + i, .completion_tokens = 20 + i};
    bool lost[4];
    assert_int_equal(queue_commit_shard(q, run, res, 120, 3, d, 3, lost, &err), ST_ERR_CONFLICT);
    assert_false(lost[0]);
    assert_false(lost[1]);
    assert_true(lost[2]);
    assert_non_null(strstr(err.msg, "nothing committed"));
    assert_int_equal(item_state(f, c[0].id), QUEUE_ITEM_LEASED);
    assert_int_equal(item_state(f, c[1].id), QUEUE_ITEM_LEASED);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE shard_id IS NOT NULL"), 0);
    struct queue_shard sh = get_shard(q, job, res);
    assert_int_equal(sh.committed_bytes, 0);

    /* caller mistakes: nothing changes either */
    assert_int_equal(queue_commit_shard(q, run, res, 80, 3, d, 2, lost, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_commit_shard(q, run, res2, 80, 2, d, 2, lost, &err), ST_ERR_CONFLICT);
    assert_int_equal(queue_commit_shard(q, run, 999, 80, 2, d, 2, lost, &err), ST_ERR_NOT_FOUND);
    assert_int_equal(queue_commit_shard(q, run, errs, 80, 2, d, 2, lost, &err),
                     ST_ERR_INVALID_ARG); /* results into an errors shard */
    struct queue_done dup[2] = {d[0], d[0]};
    assert_int_equal(queue_commit_shard(q, run, res, 80, 2, dup, 2, lost, &err),
                     ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "already"));
    struct queue_done foreign[2] = {d[0], {.item_id = c2[0].id}};
    assert_int_equal(queue_commit_shard(q, run, res, 80, 2, foreign, 2, lost, &err),
                     ST_ERR_INVALID_ARG);
    assert_false(lost[0] || lost[1]);
    assert_int_equal(item_state(f, c[0].id), QUEUE_ITEM_LEASED);

    /* the good commit */
    assert_int_equal(queue_commit_shard(q, run, res, 80, 2, d, 2, lost, &err), ST_OK);
    sh = get_shard(q, job, res);
    assert_int_equal(sh.committed_bytes, 80);
    assert_int_equal(sh.records, 2);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(item_state(f, c[i].id), QUEUE_ITEM_DONE);
        assert_int_equal(item_int(f, c[i].id, "shard_id"), res);
        assert_int_equal(item_int(f, c[i].id, "prompt_tokens"), 10 + i);
        assert_int_equal(item_int(f, c[i].id, "completion_tokens"), 20 + i);
        assert_int_equal(item_int(f, c[i].id, "finished"), f->now);
        assert_int_equal(item_int(f, c[i].id, "lease_owner"), run);
    }
    /* a done item cannot be committed again */
    assert_int_equal(queue_commit_shard(q, run, res, 90, 3, d, 1, lost, &err), ST_ERR_INVALID_ARG);
    assert_non_null(strstr(err.msg, "already"));
    /* the committed length never shrinks */
    assert_int_equal(queue_commit_shard(q, run, res, 79, 2, NULL, 0, NULL, &err),
                     ST_ERR_INVALID_ARG);
    assert_int_equal(queue_commit_shard(q, run, res, 85, 2, NULL, 0, NULL, &err), ST_OK);

    /* failures go to the errors shard; a failed record into results is refused */
    struct queue_done fl[2] = {
        {.item_id = c[3].id,
         .error_code = "context_length_exceeded",
         .error_msg = "too long",
         .prompt_tokens = 9000},
        {.item_id = c[4].id, .error_code = "context_length_exceeded", .error_msg = "too long"},
    };
    assert_int_equal(queue_commit_shard(q, run, res, 200, 4, fl, 2, lost, &err),
                     ST_ERR_INVALID_ARG);
    assert_int_equal(queue_commit_shard(q, run, errs, 200, 2, fl, 2, lost, &err), ST_OK);
    assert_int_equal(item_state(f, c[3].id), QUEUE_ITEM_FAILED);
    assert_int_equal(item_int(f, c[3].id, "shard_id"), errs);

    struct queue_counts cnt;
    assert_int_equal(queue_job_counts(q, job, &cnt, &err), ST_OK);
    assert_int_equal(cnt.items[QUEUE_ITEM_DONE], 2);
    assert_int_equal(cnt.items[QUEUE_ITEM_FAILED], 2);
    assert_int_equal(cnt.items[QUEUE_ITEM_QUEUED], 2); /* the released one and the sixth */
    assert_int_equal(cnt.prompt_tokens, 10 + 11 + 9000);
    assert_int_equal(cnt.completion_tokens, 20 + 21);
    assert_int_equal(cnt.n_error_codes, 1);
    assert_string_equal(cnt.errors[0].code, "context_length_exceeded");
    assert_int_equal(cnt.errors[0].count, 2);

    /* finishing the last two makes the job done */
    struct queue_job j;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_RUNNING);
    queue_job_free(&j);
    queue_claimed_free(c, n);
    c = claim(q, job, run, 10, 60000, &n);
    assert_int_equal(n, 2);
    assert_int_equal(c[0].id, rel);
    assert_int_equal(c[0].attempts, 1); /* release gave the attempt back */
    d[0] = (struct queue_done){.item_id = c[0].id};
    d[1] = (struct queue_done){.item_id = c[1].id};
    assert_int_equal(queue_commit_shard(q, run, res, 150, 4, d, 2, NULL, &err), ST_OK);
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_DONE);
    assert_int_equal(j.finished, f->now);
    queue_job_free(&j);

    /* close: sha256 validated, then the shard takes no more commits */
    assert_int_equal(queue_shard_close(q, run, res, "abc", &err), ST_ERR_INVALID_ARG);
    const char *sha = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    assert_int_equal(queue_shard_close(q, run2, res, sha, &err), ST_ERR_CONFLICT);
    assert_int_equal(queue_shard_close(q, run, res, sha, &err), ST_OK);
    assert_int_equal(queue_shard_close(q, run, res, sha, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_commit_shard(q, run, res, 150, 4, NULL, 0, NULL, &err),
                     ST_ERR_INVALID_ARG);
    sh = get_shard(q, job, res);
    assert_int_equal(sh.state, QUEUE_SHARD_CLOSED);
    assert_string_equal(sh.sha256, sha);
    queue_claimed_free(c, n);
    queue_claimed_free(c2, n2);
    queue_close(q);
}

/* Inside a user transaction a refused commit undoes only itself. */
static void test_commit_in_user_tx(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 3);
    int64_t run = start_run(q, job);
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, 3, 60000, &n);
    int64_t res = new_shard(q, run, job, QUEUE_SHARD_RESULTS, f);
    assert_int_equal(queue_tx_begin(q, &err), ST_OK);
    struct queue_done d[2] = {{.item_id = c[0].id}, {.item_id = c[1].id}};
    assert_int_equal(queue_commit_shard(q, run, res, 10, 1, d, 1, NULL, &err), ST_OK);
    assert_int_equal(queue_release(q, run, &c[1].id, 1, NULL, &err), ST_OK);
    assert_int_equal(queue_commit_shard(q, run, res, 20, 2, &d[1], 1, NULL, &err), ST_ERR_CONFLICT);
    assert_int_equal(queue_tx_commit(q, &err), ST_OK);
    assert_int_equal(item_state(f, c[0].id), QUEUE_ITEM_DONE);
    assert_int_equal(item_state(f, c[1].id), QUEUE_ITEM_QUEUED);
    struct queue_shard sh = get_shard(q, job, res);
    assert_int_equal(sh.committed_bytes, 10);
    assert_int_equal(sh.records, 1);
    queue_claimed_free(c, n);
    queue_close(q);
}

/* ---- release, cancel, retry ---------------------------------------------------------------- */

static void test_release(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 6);
    int64_t run = start_run(q, job), other = start_run(q, job);
    size_t n = 0, n2 = 0;
    struct queue_claimed *c = claim(q, job, run, 4, 60000, &n);
    struct queue_claimed *c2 = claim(q, job, other, 1, 60000, &n2);
    assert_int_equal(n, 4);
    int64_t ids[3] = {c[1].id, c[3].id, c2[0].id}; /* the last is not ours: skipped */
    int64_t released = 0;
    assert_int_equal(queue_release(q, run, ids, 3, &released, &err), ST_OK);
    assert_int_equal(released, 2);
    assert_int_equal(item_state(f, c[1].id), QUEUE_ITEM_QUEUED);
    assert_int_equal(item_int(f, c[1].id, "attempts"), 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'queued' AND "
                                      "(lease_owner IS NOT NULL OR lease_expiry IS NOT NULL)"),
                     0);
    assert_int_equal(item_state(f, c2[0].id), QUEUE_ITEM_LEASED);
    assert_int_equal(item_state(f, c[0].id), QUEUE_ITEM_LEASED);
    /* re-claim: the released ones come back first (lowest ids), first attempt again */
    struct queue_claimed *c3 = claim(q, job, run, 2, 60000, &n2);
    assert_int_equal(n2, 2);
    assert_int_equal(c3[0].id, c[1].id);
    assert_int_equal(c3[1].id, c[3].id);
    assert_int_equal(c3[0].attempts, 1);
    queue_claimed_free(c3, n2);
    /* release everything the run holds */
    assert_int_equal(queue_release(q, run, NULL, 0, &released, &err), ST_OK);
    assert_int_equal(released, 4);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'leased'"), 1);
    queue_claimed_free(c, n);
    queue_claimed_free(c2, 1);
    queue_close(q);
}

static void test_cancel(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 5);
    int64_t keep = make_job(q, "keep", 2);
    int64_t run = start_run(q, 0);
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, 3, 60000, &n);
    int64_t res = new_shard(q, run, job, QUEUE_SHARD_RESULTS, f);
    struct queue_done d[3] = {{.item_id = c[0].id}, {.item_id = c[1].id}, {.item_id = c[2].id}};
    assert_int_equal(queue_commit_shard(q, run, res, 10, 1, d, 1, NULL, &err), ST_OK);

    int64_t cancelled = 0;
    assert_int_equal(queue_job_cancel(q, job, &cancelled, &err), ST_OK);
    assert_int_equal(cancelled, 4); /* 2 leased + 2 queued; the done one stays done */
    struct queue_job j;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_CANCELLED);
    assert_int_equal(j.finished, f->now);
    queue_job_free(&j);
    assert_int_equal(item_state(f, c[0].id), QUEUE_ITEM_DONE);

    /* the worker finds out at its next commit (and its heartbeat shows the leases gone) */
    bool lost[2];
    assert_int_equal(queue_commit_shard(q, run, res, 30, 3, &d[1], 2, lost, &err), ST_ERR_CONFLICT);
    assert_true(lost[0] && lost[1]);
    int64_t held = -1;
    assert_int_equal(queue_lease_extend(q, run, 1000, &held, &err), ST_OK);
    assert_int_equal(held, 0);
    queue_claimed_free(c, n);

    /* nothing of the job is claimable; other jobs are untouched */
    c = claim(q, 0, run, 10, 60000, &n);
    assert_int_equal(n, 2);
    assert_int_equal(c[0].job_id, keep);
    queue_claimed_free(c, n);
    struct queue_counts cnt;
    assert_int_equal(queue_job_counts(q, job, &cnt, &err), ST_OK);
    assert_int_equal(cnt.items[QUEUE_ITEM_CANCELLED], 4);
    assert_int_equal(cnt.items[QUEUE_ITEM_DONE], 1);
    assert_int_equal(queue_job_counts(q, 0, &cnt, &err), ST_OK);
    assert_int_equal(cnt.total, 7);
    assert_int_equal(cnt.items[QUEUE_ITEM_LEASED], 2);

    /* again: nothing more; retry is refused */
    assert_int_equal(queue_job_cancel(q, job, &cancelled, &err), ST_OK);
    assert_int_equal(cancelled, 0);
    assert_int_equal(queue_job_retry_failed(q, job, NULL, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(queue_job_cancel(q, 999, NULL, &err), ST_ERR_NOT_FOUND);
    queue_close(q);
}

static void test_retry_failed(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 4);
    int64_t run = start_run(q, job);
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, 4, 60000, &n);
    int64_t res = new_shard(q, run, job, QUEUE_SHARD_RESULTS, f);
    int64_t errs = new_shard(q, run, job, QUEUE_SHARD_ERRORS, f);
    struct queue_done ok[2] = {{.item_id = c[0].id}, {.item_id = c[1].id}};
    struct queue_done bad[2] = {{.item_id = c[2].id, .error_code = "engine", .error_msg = "x"},
                                {.item_id = c[3].id, .error_code = "engine", .error_msg = "y"}};
    assert_int_equal(queue_commit_shard(q, run, res, 10, 2, ok, 2, NULL, &err), ST_OK);
    assert_int_equal(queue_commit_shard(q, run, errs, 10, 2, bad, 2, NULL, &err), ST_OK);
    struct queue_job j;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_DONE);
    queue_job_free(&j);

    int64_t retried = 0;
    assert_int_equal(queue_job_retry_failed(q, job, &retried, &err), ST_OK);
    assert_int_equal(retried, 2);
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_RUNNING);
    assert_int_equal(j.finished, 0);
    queue_job_free(&j);
    for (int i = 2; i < 4; i++) {
        assert_int_equal(item_state(f, c[i].id), QUEUE_ITEM_QUEUED);
        assert_int_equal(item_int(f, c[i].id, "attempts"), 0);
        assert_int_equal(item_int(f, c[i].id, "shard_id IS NULL AND error_code IS NULL"), 1);
    }
    struct queue_shard sh = get_shard(q, job, errs);
    assert_int_equal(sh.records, 2);
    assert_int_equal(sh.superseded, 2);
    assert_int_equal(get_shard(q, job, res).superseded, 0);
    queue_claimed_free(c, n);

    c = claim(q, job, run, 10, 60000, &n);
    assert_int_equal(n, 2);
    assert_int_equal(c[0].attempts, 1);
    ok[0].item_id = c[0].id;
    ok[1].item_id = c[1].id;
    assert_int_equal(queue_commit_shard(q, run, res, 20, 4, ok, 2, NULL, &err), ST_OK);
    struct queue_counts cnt;
    assert_int_equal(queue_job_counts(q, job, &cnt, &err), ST_OK);
    assert_int_equal(cnt.items[QUEUE_ITEM_DONE], 4);
    assert_int_equal(cnt.items[QUEUE_ITEM_FAILED], 0);
    assert_int_equal(cnt.n_error_codes, 0);
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_DONE);
    queue_job_free(&j);
    /* nothing failed: no change */
    assert_int_equal(queue_job_retry_failed(q, job, &retried, &err), ST_OK);
    assert_int_equal(retried, 0);
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_DONE);
    queue_job_free(&j);
    queue_claimed_free(c, n);
    queue_close(q);
}

/* ---- shards -------------------------------------------------------------------------------- */

static void test_shards(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 0);
    int64_t a = start_run(q, job), b = start_run(q, job), c = start_run(q, job);
    int64_t seq = -1, id = 0;
    assert_int_equal(queue_shard_next_seq(q, job, QUEUE_SHARD_RESULTS, &seq, &err), ST_OK);
    assert_int_equal(seq, 0);
    int64_t s0 = new_shard(q, a, job, QUEUE_SHARD_RESULTS, f);
    int64_t s1 = new_shard(q, a, job, QUEUE_SHARD_RESULTS, f);
    int64_t e0 = new_shard(q, b, job, QUEUE_SHARD_ERRORS, f);
    assert_int_equal(queue_shard_next_seq(q, job, QUEUE_SHARD_RESULTS, &seq, &err), ST_OK);
    assert_int_equal(seq, 2);
    assert_int_equal(queue_shard_next_seq(q, job, QUEUE_SHARD_ERRORS, &seq, &err), ST_OK);
    assert_int_equal(seq, 1);
    assert_int_equal(queue_shard_create(q, a, job, QUEUE_SHARD_RESULTS, 1, "/x/new", &id, &err),
                     ST_ERR_EXISTS);
    struct queue_shard sh = {0};
    struct queue_shard *list = NULL;
    size_t n = 0;
    assert_int_equal(queue_shard_list(q, job, &list, &n, &err), ST_OK);
    assert_int_equal(n, 3);
    assert_int_equal(list[0].id, s0);
    assert_int_equal(list[1].id, s1);
    assert_int_equal(list[2].id, e0);
    assert_int_equal(list[2].kind, QUEUE_SHARD_ERRORS);
    assert_int_equal(list[1].seq, 1);
    assert_int_equal(list[0].run_id, a);
    assert_int_equal(list[0].state, QUEUE_SHARD_OPEN);
    assert_string_equal(list[0].sha256, "");
    assert_non_null(strstr(list[1].path, "results-00001"));
    assert_int_equal(queue_shard_create(q, a, job, QUEUE_SHARD_RESULTS, 7, list[0].path, &id, &err),
                     ST_ERR_EXISTS);
    queue_shard_list_free(list, n);
    queue_shard_list_free(NULL, 0);
    assert_int_equal(queue_shard_create(q, a, 999, QUEUE_SHARD_RESULTS, 0, "/x/y", &id, &err),
                     ST_ERR_NOT_FOUND);

    /* adopt: only from a dead run, and only once */
    assert_int_equal(queue_shard_adopt(q, s0, b, 60000, &err), ST_ERR_CONFLICT);
    f->now += 30000;
    assert_int_equal(queue_lease_extend(q, b, 1000, NULL, &err), ST_OK); /* b stays alive */
    f->now += 40000;                                                     /* a: 70 s silent */
    assert_int_equal(queue_shard_adopt(q, s0, b, 60000, &err), ST_OK);
    assert_int_equal(queue_shard_adopt(q, s0, c, 60000, &err), ST_ERR_CONFLICT);
    assert_int_equal(queue_shard_adopt(q, 999, c, 60000, &err), ST_ERR_NOT_FOUND);
    sh = get_shard(q, job, s0);
    assert_int_equal(sh.run_id, b);
    /* a run that ended is dead at once */
    assert_int_equal(queue_lease_extend(q, a, 1000, NULL, &err), ST_OK);
    assert_int_equal(queue_run_end(q, a, "signal", NULL, NULL, &err), ST_OK);
    assert_int_equal(queue_shard_adopt(q, s1, c, 60000, &err), ST_OK);
    assert_int_equal(queue_shard_adopt(q, s1, a, 60000, &err), ST_ERR_INVALID_ARG); /* ended */
    queue_close(q);
}

/* ---- many processes ------------------------------------------------------------------------ */

#define CONC_ITEMS 4000
#define CONC_PROCS 4
#define CONC_CHUNK 7

/* One worker process: claim small chunks and commit them to its own shard until nothing is
 * left. Writes its claim count to fd; exit status 0 only if no call failed. */
static int conc_worker(const char *path, int64_t job, int fd)
{
    struct queue *q = NULL;
    struct err_detail err = {0};
    if (queue_open(&q, path, &err) != ST_OK) {
        fprintf(stderr, "worker open: %s\n", err.msg);
        return 1;
    }
    struct queue_run_spec rs = {.job_id = job, .worker_id = "conc", .pid = getpid()};
    int64_t run = 0, shard = 0, seq = 0, claims = 0;
    uint64_t bytes = 0, records = 0;
    enum status st = queue_run_start(q, &rs, &run, &err);
    if (st == ST_OK)
        st = queue_tx_begin(q, &err);
    if (st == ST_OK)
        st = queue_shard_next_seq(q, job, QUEUE_SHARD_RESULTS, &seq, &err);
    char spath[256];
    snprintf(spath, sizeof(spath), "%s.results-%05lld", path, (long long)seq);
    if (st == ST_OK)
        st = queue_shard_create(q, run, job, QUEUE_SHARD_RESULTS, seq, spath, &shard, &err);
    if (st == ST_OK)
        st = queue_tx_commit(q, &err);
    while (st == ST_OK) {
        struct queue_claimed *c = NULL;
        size_t n = 0;
        st = queue_claim(q, job, run, CONC_CHUNK, 600000, &c, &n, &err);
        if (st != ST_OK || n == 0)
            break;
        claims += (int64_t)n;
        struct queue_done d[CONC_CHUNK];
        for (size_t i = 0; i < n; i++)
            d[i] =
                (struct queue_done){.item_id = c[i].id, .prompt_tokens = 1, .completion_tokens = 2};
        bytes += 10 * n;
        records += n;
        st = queue_commit_shard(q, run, shard, bytes, records, d, n, NULL, &err);
        queue_claimed_free(c, n);
    }
    if (st == ST_OK)
        st = queue_run_end(q, run, "drained", NULL, NULL, &err);
    if (st != ST_OK)
        fprintf(stderr, "worker %d: %s (%s)\n", (int)getpid(), err.msg, status_str(st));
    queue_close(q);
    if (write(fd, &claims, sizeof(claims)) != (ssize_t)sizeof(claims))
        return 1;
    return st == ST_OK ? 0 : 1;
}

static void test_concurrent_workers(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "conc", CONC_ITEMS);
    queue_close(q);

    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pids[CONC_PROCS];
    for (int p = 0; p < CONC_PROCS; p++) {
        pids[p] = fork();
        assert_true(pids[p] >= 0);
        if (pids[p] == 0) {
            close(fds[0]);
            _exit(conc_worker(f->path, job, fds[1]));
        }
    }
    close(fds[1]);
    int64_t total_claims = 0, claims;
    int reports = 0;
    while (read(fds[0], &claims, sizeof(claims)) == (ssize_t)sizeof(claims)) {
        total_claims += claims;
        reports++;
    }
    close(fds[0]);
    for (int p = 0; p < CONC_PROCS; p++) {
        int ws = 0;
        assert_int_equal(waitpid(pids[p], &ws, 0), pids[p]);
        assert_true(WIFEXITED(ws));
        assert_int_equal(WEXITSTATUS(ws), 0);
    }
    assert_int_equal(reports, CONC_PROCS);
    assert_int_equal(total_claims, CONC_ITEMS); /* no item claimed twice */

    q = open_q(f);
    struct queue_counts c;
    assert_int_equal(queue_job_counts(q, job, &c, &err), ST_OK);
    assert_int_equal(c.items[QUEUE_ITEM_DONE], CONC_ITEMS);
    assert_int_equal(c.total, CONC_ITEMS);
    assert_int_equal(c.attempts, CONC_ITEMS);
    assert_int_equal(c.completion_tokens, 2 * CONC_ITEMS);
    /* every item is in exactly one shard and every shard counts exactly its items */
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE attempts <> 1 OR "
                                      "shard_id IS NULL"),
                     0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM shards s WHERE records <> (SELECT "
                                      "count(*) FROM items i WHERE i.shard_id = s.id) OR "
                                      "committed_bytes <> 10 * records"),
                     0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM shards"), CONC_PROCS);
    assert_int_equal(sql_int(f->path, "SELECT count(DISTINCT seq) FROM shards"), CONC_PROCS);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items i JOIN shards s ON "
                                      "i.shard_id = s.id WHERE i.lease_owner <> s.run_id"),
                     0);
    struct queue_job j;
    assert_int_equal(queue_job_get(q, job, &j, &err), ST_OK);
    assert_int_equal(j.state, QUEUE_JOB_DONE);
    queue_job_free(&j);
    queue_close(q);
}

/* Several processes creating the same new queue at once: each open must wait, not fail. */
static void test_concurrent_create(void **state)
{
    struct fixture *f = *state;
    pid_t pids[6];
    for (int p = 0; p < 6; p++) {
        pids[p] = fork();
        assert_true(pids[p] >= 0);
        if (pids[p] == 0) {
            struct queue *q = NULL;
            struct err_detail err = {0};
            char name[16];
            snprintf(name, sizeof(name), "job%d", p);
            struct queue_job_spec spec = {.name = name, .model_path = "m", .out_dir = "o"};
            int64_t id = 0;
            enum status st = queue_open(&q, f->path, &err);
            if (st == ST_OK)
                st = queue_job_create(q, &spec, &id, &err);
            if (st != ST_OK)
                fprintf(stderr, "process %d: %s\n", p, err.msg);
            queue_close(q);
            _exit(st == ST_OK ? 0 : 1);
        }
    }
    for (int p = 0; p < 6; p++) {
        int ws = 0;
        assert_int_equal(waitpid(pids[p], &ws, 0), pids[p]);
        assert_true(WIFEXITED(ws));
        assert_int_equal(WEXITSTATUS(ws), 0);
    }
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM jobs"), 6);
    assert_int_equal(sql_int(f->path, "PRAGMA user_version"), QUEUE_SCHEMA_VERSION);
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

    /* submit runs do not count as run time of any job */
    f->now += 5000;
    assert_int_equal(queue_run_heartbeat(q, srun, &err), ST_OK);
    int64_t first = 0, last = 0;
    assert_int_equal(queue_job_timing(q, ready_job, &first, &last, &err), ST_OK);
    assert_int_equal(first, 1000000);
    assert_int_equal(last, 1000000);

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
        cmocka_unit_test_setup_teardown(test_newer_version_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_item_add_duplicate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_claim_order_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lease_expiry_reclaim, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commit_all_or_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commit_in_user_tx, setup, teardown),
        cmocka_unit_test_setup_teardown(test_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retry_failed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shards, setup, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_create, setup, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_workers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v1_to_v2, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_v2_to_v3, setup, teardown),
        cmocka_unit_test_setup_teardown(test_run_progress, setup, teardown),
        cmocka_unit_test_setup_teardown(test_own_leases_not_swept, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retry_skips_submit_rejects, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_record_index, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reap_dead_runs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_not_ready_job_invisible, setup, teardown),
        cmocka_unit_test_setup_teardown(test_discard_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(test_jobs_gc, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
