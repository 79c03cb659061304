/* Fixture and helpers shared by the queue/ tests (test_queue.c, test_queue_runs.c,
 * test_queue_shards.c): a temporary directory and fake clock per test, jobs, runs and
 * shards made in one call, and read-only looks at the file through sqlite3. */
#ifndef TESTS_TEST_QUEUE_UTIL_H
#define TESTS_TEST_QUEUE_UTIL_H

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

static inline int setup(void **state)
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

static inline int teardown(void **state)
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

static inline int64_t fake_clock(void *ctx)
{
    return *(int64_t *)ctx;
}

static inline struct queue *open_q(struct fixture *f)
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
static inline int64_t make_job(struct queue *q, const char *name, int n)
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

static inline int64_t start_run(struct queue *q, int64_t job)
{
    struct err_detail err = {0};
    struct queue_run_spec rs = {.job_id = job, .worker_id = "w", .host = "h", .pid = getpid()};
    int64_t run = 0;
    assert_int_equal(queue_run_start(q, &rs, &run, &err), ST_OK);
    assert_true(run > 0);
    return run;
}

static inline int64_t new_shard(struct queue *q, int64_t run, int64_t job,
                                enum queue_shard_kind kind, struct fixture *f)
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
static inline int64_t sql_int(const char *path, const char *sql)
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

static inline int64_t item_int(struct fixture *f, int64_t item, const char *col)
{
    char sql[128];
    snprintf(sql, sizeof(sql), "SELECT %s FROM items WHERE id = %lld", col, (long long)item);
    return sql_int(f->path, sql);
}

static inline enum queue_item_state item_state(struct fixture *f, int64_t item)
{
    char sql[160];
    snprintf(sql, sizeof(sql),
             "SELECT CASE state WHEN 'queued' THEN 0 WHEN 'leased' THEN 1 WHEN 'done' THEN 2 "
             "WHEN 'failed' THEN 3 WHEN 'cancelled' THEN 4 END FROM items WHERE id = %lld",
             (long long)item);
    return (enum queue_item_state)sql_int(f->path, sql);
}

static inline struct queue_claimed *claim(struct queue *q, int64_t job, int64_t run, int max,
                                          int64_t lease_ms, size_t *n)
{
    struct err_detail err = {0};
    struct queue_claimed *c = NULL;
    if (queue_claim(q, job, run, max, lease_ms, &c, n, &err) != ST_OK)
        fail_msg("claim: %s", err.msg);
    return c;
}

/* claim, the items dropped at once: how many were claimed. */
static inline size_t claim_count(struct queue *q, int64_t job, int64_t run, int max,
                                 int64_t lease_ms)
{
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, run, max, lease_ms, &n);
    queue_claimed_free(c, n);
    return n;
}

static inline struct queue_shard get_shard(struct queue *q, int64_t job, int64_t shard_id)
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

#endif
