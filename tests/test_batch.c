/* Unit tests for batch/: the shard commit protocol step by step against a real queue file and
 * real shard files in a temporary directory, with no model (records are fed to the writer
 * directly): records wait in the buffer until a commit writes their frame and marks their
 * items done in one transaction; items the queue no longer gives us are dropped from the shard;
 * shards rotate at their record limit; a fault between the shard write and the queue commit
 * (QUERN_FAULT=queue.commit:N:fail in a child process) leaves the items claimable and the shard
 * cut back to its committed length by recovery, with no duplicate once the work is redone;
 * recovery of a dead run's shard with a torn tail, and of one still locked by its writer; the
 * manifest after a commit, and batch_manifest_current; the progress JSON round trip; and one
 * whole run of three requests through the engine (the default model; skipped without it). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "batch/batch.h"
#include "common/sha256.h"
#include "io/shard.h"
#include "queue/queue.h"
#include "tests/test_util.h"

#define LEASE_MS 300000

/* ---- fixture: a temporary directory with a queue, one job, its items claimed by a run ---- */

struct fixture {
    char dir[64];         /* mkdtemp directory */
    char db[128];         /* dir/queue.db */
    char job_dir[4096];   /* dir/out/j (batch_job_dir) */
    struct queue *q;      /* connection */
    struct queue_job job; /* the job "j" */
    int64_t run_id;       /* the run that claimed the items */
    int64_t items[8];     /* item ids, custom_id "c<i>" */
    size_t n_items;       /* count */
};

static void rm_rf(const char *path)
{
    struct stat sb;
    if (lstat(path, &sb))
        return;
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            char p[4200];
            snprintf(p, sizeof(p), "%s/%s", path, e->d_name);
            rm_rf(p);
        }
        if (d)
            closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static void check(enum status st, const struct err_detail *err, const char *what)
{
    if (st != ST_OK)
        fail_msg("%s: %s (status %d)", what, err->msg, (int)st);
}

static int64_t start_run(struct queue *q)
{
    struct proc_identity self;
    proc_identity_self(&self);
    struct queue_run_spec rs = {0};
    rs.host = self.host;
    rs.boot_id = self.boot_id;
    rs.pid_ns = self.pid_ns;
    rs.pid = self.pid;
    rs.pstart = self.start_ticks;
    int64_t id = 0;
    struct err_detail err = {0};
    check(queue_run_start(q, &rs, &id, &err), &err, "queue_run_start");
    return id;
}

/* Claim everything queued for run_id; returns how many. */
static size_t claim_all(struct queue *q, int64_t job_id, int64_t run_id)
{
    struct queue_claimed *c = NULL;
    size_t n = 0;
    struct err_detail err = {0};
    check(queue_claim(q, job_id, run_id, 100, LEASE_MS, &c, &n, &err), &err, "queue_claim");
    queue_claimed_free(c, n);
    return n;
}

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    snprintf(f->dir, sizeof(f->dir), "/tmp/quern-test-batch-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    snprintf(f->db, sizeof(f->db), "%s/queue.db", f->dir);
    struct err_detail err = {0};
    check(queue_open(&f->q, f->db, &err), &err, "queue_open");
    /* a stand-in model file: the manifest hashes it */
    char model[160], out[160];
    snprintf(model, sizeof(model), "%s/model.gguf", f->dir);
    FILE *m = fopen(model, "wb");
    assert_non_null(m);
    fputs("not really a model", m);
    fclose(m);
    snprintf(out, sizeof(out), "%s/out", f->dir);
    struct queue_job_spec js = {"j", model, NULL, "{\"temperature\":0}", out, 7, 0};
    int64_t job_id;
    check(queue_job_create(f->q, &js, &job_id, &err), &err, "queue_job_create");
    f->n_items = 6;
    for (size_t i = 0; i < f->n_items; i++) {
        char cid[32];
        snprintf(cid, sizeof(cid), "c%zu", i);
        struct queue_item_spec it = {0};
        it.custom_id = cid;
        it.payload = "{\"prompt\":\"x\"}";
        check(queue_item_add(f->q, job_id, &it, &f->items[i], &err), &err, "queue_item_add");
    }
    check(queue_job_get(f->q, job_id, &f->job, &err), &err, "queue_job_get");
    check(batch_job_dir(f->q, &f->job, NULL, 1, f->job_dir, sizeof(f->job_dir), &err), &err,
          "batch_job_dir");
    f->run_id = start_run(f->q);
    assert_int_equal(claim_all(f->q, job_id, f->run_id), f->n_items);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    queue_job_free(&f->job);
    queue_close(f->q);
    rm_rf(f->dir);
    free(f);
    return 0;
}

static struct batch_out *open_writer(struct fixture *f, int64_t run_id, uint64_t shard_records)
{
    struct batch_out_spec spec = {f->q,         run_id, f->job.id, f->job_dir, (uint64_t)1 << 30,
                                  shard_records};
    struct batch_out *w = NULL;
    struct err_detail err = {0};
    check(batch_out_open(&w, &spec, &err), &err, "batch_out_open");
    return w;
}

/* The record of item i: {"custom_id":"c<i>"}. */
static char *record(size_t i)
{
    char buf[64];
    snprintf(buf, sizeof(buf), "{\"custom_id\":\"c%zu\"}", i);
    return strdup(buf);
}

static void add_result(struct fixture *f, struct batch_out *w, size_t i)
{
    struct err_detail err = {0};
    check(batch_out_hold(w, f->items[i], &err), &err, "batch_out_hold");
    check(batch_out_result(w, f->items[i], record(i), 10, 5, 20.0 + (double)i, 0, &err), &err, "batch_out_result");
}

/* Item i's error record ("bad": "no"), held then written. */
static void add_error(struct fixture *f, struct batch_out *w, size_t i)
{
    struct err_detail err = {0};
    check(batch_out_hold(w, f->items[i], &err), &err, "batch_out_hold");
    check(batch_out_error(w, f->items[i], record(i), "bad", "no", &err), &err, "batch_out_error");
}

static void item_counts(struct fixture *f, struct queue_counts *c)
{
    struct err_detail err = {0};
    check(queue_job_counts(f->q, f->job.id, c, &err), &err, "queue_job_counts");
}

/* The job's shards, by kind and seq. */
static void shards(struct fixture *f, struct queue_shard **sh, size_t *n)
{
    struct err_detail err = {0};
    check(queue_shard_list(f->q, f->job.id, sh, n, &err), &err, "queue_shard_list");
}

static int64_t file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) ? -1 : (int64_t)sb.st_size;
}

/* The lines of a shard's first limit bytes, concatenated with '\n' after each. */
struct lines {
    char buf[4096]; /* the text */
    size_t len;     /* bytes */
    int n;          /* lines */
};

static enum status collect(const char *line, size_t len, void *user)
{
    struct lines *l = user;
    if (l->len + len + 1 < sizeof(l->buf)) {
        memcpy(l->buf + l->len, line, len);
        l->len += len;
        l->buf[l->len++] = '\n';
        l->buf[l->len] = 0;
    }
    l->n++;
    return ST_OK;
}

static void read_lines(const char *path, uint64_t limit, struct lines *l)
{
    memset(l, 0, sizeof(*l));
    struct err_detail err = {0};
    check(io_shard_read(path, limit, collect, l, &err), &err, "io_shard_read");
}

/* ---- the commit protocol, step by step ---- */

/* An item scan callback: items c0..c2 done with the usage add_result gave, c3 failed
 * without latencies, the rest unfinished. */
static enum status check_usage(void *user, const struct queue_item_info *it)
{
    (void)user;
    int i = atoi(it->custom_id + 1);
    if (i < 3) {
        assert_int_equal(it->state, QUEUE_ITEM_DONE);
        assert_int_equal(it->prompt_tokens, 10);
        assert_int_equal(it->completion_tokens, 5);
        assert_true(it->ttft_ms == 20.0 + i);
        assert_true(it->tpot_ms == -1); /* 0 given: unknown */
        assert_int_equal(it->attempts, 1);
    } else {
        assert_true(it->ttft_ms == -1 && it->tpot_ms == -1);
    }
    return ST_OK;
}

static void test_commit_protocol(void **state)
{
    struct fixture *f = *state;
    struct batch_out *w = open_writer(f, f->run_id, 1000);
    struct err_detail err = {0};
    add_result(f, w, 0);
    add_result(f, w, 1);
    add_result(f, w, 2);
    check(batch_out_hold(w, f->items[3], &err), &err, "hold");
    char *line = strdup("{\"custom_id\":\"c3\",\"error\":{}}");
    check(batch_out_error(w, f->items[3], line, "invalid_request", "bad", &err), &err, "error");

    /* buffered: the shard row exists with nothing committed, the file is empty, items leased */
    struct batch_out_counts oc;
    batch_out_get_counts(w, &oc);
    assert_int_equal(oc.pending_results, 3);
    assert_int_equal(oc.pending_errors, 1);
    assert_int_equal(oc.held, 4);
    struct queue_shard *sh;
    size_t n;
    shards(f, &sh, &n);
    assert_int_equal(n, 2);
    assert_int_equal(sh[0].kind, QUEUE_SHARD_RESULTS);
    assert_int_equal(sh[0].state, QUEUE_SHARD_OPEN);
    assert_int_equal(sh[0].committed_bytes, 0);
    char res_path[4200], err_path[4200];
    snprintf(res_path, sizeof(res_path), "%s/results-00000.jsonl.zst", f->job_dir);
    snprintf(err_path, sizeof(err_path), "%s/errors-00000.jsonl.zst", f->job_dir);
    assert_string_equal(sh[0].path, res_path);
    assert_int_equal(file_size(res_path), 0);
    queue_shard_list_free(sh, n);
    struct queue_counts c;
    item_counts(f, &c);
    assert_int_equal(c.items[QUEUE_ITEM_LEASED], 6);

    /* the commit: one frame written, the row's length is the file's, the items are finished */
    check(batch_out_commit(w, &err), &err, "batch_out_commit");
    batch_out_get_counts(w, &oc);
    assert_int_equal(oc.pending_results + oc.pending_errors, 0);
    assert_int_equal(oc.held, 0);
    assert_int_equal(oc.done, 3);
    assert_int_equal(oc.failed, 1);
    item_counts(f, &c);
    assert_int_equal(c.items[QUEUE_ITEM_DONE], 3);
    assert_int_equal(c.items[QUEUE_ITEM_FAILED], 1);
    assert_int_equal(c.items[QUEUE_ITEM_LEASED], 2);
    assert_int_equal(c.completion_tokens, 15);
    shards(f, &sh, &n);
    assert_int_equal(sh[0].records, 3);
    assert_true(sh[0].committed_bytes > 0);
    assert_int_equal((int64_t)sh[0].committed_bytes, file_size(res_path));
    assert_int_equal(sh[1].records, 1);
    assert_int_equal((int64_t)sh[1].committed_bytes, file_size(err_path));
    queue_shard_list_free(sh, n);
    struct lines l;
    read_lines(res_path, IO_SHARD_ALL, &l);
    assert_int_equal(l.n, 3);
    assert_string_equal(l.buf, "{\"custom_id\":\"c0\"}\n{\"custom_id\":\"c1\"}\n"
                               "{\"custom_id\":\"c2\"}\n");
    /* each finished item keeps its usage and latency (none known: -1), for reports */
    check(queue_item_scan(f->q, f->job.id, check_usage, f, &err), &err, "queue_item_scan");

    /* releasing gives the held items back uncounted */
    check(batch_out_hold(w, f->items[4], &err), &err, "hold");
    int64_t released = 0;
    check(batch_out_release(w, &released, &err), &err, "release");
    assert_int_equal(released, 1);
    item_counts(f, &c);
    assert_int_equal(c.items[QUEUE_ITEM_QUEUED], 1);

    /* closing seals the shards with the sha256 of their bytes */
    check(batch_out_close(w, &err), &err, "batch_out_close");
    shards(f, &sh, &n);
    char sha[SHA256_HEX_LEN];
    check(sha256_file(res_path, SHA256_WHOLE_FILE, sha, &err), &err, "sha256");
    assert_int_equal(sh[0].state, QUEUE_SHARD_CLOSED);
    assert_string_equal(sh[0].sha256, sha);
    assert_int_equal(sh[1].state, QUEUE_SHARD_CLOSED);
    queue_shard_list_free(sh, n);
    batch_out_free(w);
}

/* Items the queue no longer gives us (here released behind the writer's back) are dropped
 * from the shard; the others are committed. */
static void test_commit_drops_lost_items(void **state)
{
    struct fixture *f = *state;
    struct batch_out *w = open_writer(f, f->run_id, 1000);
    struct err_detail err = {0};
    add_result(f, w, 0);
    add_result(f, w, 1);
    add_result(f, w, 2);
    check(queue_release(f->q, f->run_id, &f->items[1], 1, NULL, &err), &err, "queue_release");
    check(batch_out_commit(w, &err), &err, "batch_out_commit");
    struct batch_out_counts oc;
    batch_out_get_counts(w, &oc);
    assert_int_equal(oc.done, 2);
    assert_int_equal(oc.held, 0);
    assert_int_equal(oc.discarded, 1); /* (the run summary's records_discarded) */
    struct queue_shard *sh;
    size_t n;
    shards(f, &sh, &n);
    assert_int_equal(sh[0].records, 2);
    struct lines l;
    read_lines(sh[0].path, sh[0].committed_bytes, &l);
    assert_string_equal(l.buf, "{\"custom_id\":\"c0\"}\n{\"custom_id\":\"c2\"}\n");
    assert_int_equal((int64_t)sh[0].committed_bytes, file_size(sh[0].path));
    queue_shard_list_free(sh, n);
    batch_out_free(w);
}

/* A shard is sealed once it holds shard_records records; the next record starts seq 1. */
static void test_rotation(void **state)
{
    struct fixture *f = *state;
    struct batch_out *w = open_writer(f, f->run_id, 2);
    struct err_detail err = {0};
    add_result(f, w, 0);
    add_result(f, w, 1);
    check(batch_out_commit(w, &err), &err, "commit");
    add_result(f, w, 2);
    check(batch_out_commit(w, &err), &err, "commit");
    check(batch_out_close(w, &err), &err, "close");
    struct queue_shard *sh;
    size_t n;
    shards(f, &sh, &n);
    assert_int_equal(n, 2);
    assert_int_equal(sh[0].seq, 0);
    assert_int_equal(sh[0].records, 2);
    assert_int_equal(sh[0].state, QUEUE_SHARD_CLOSED);
    assert_int_equal(sh[1].seq, 1);
    assert_int_equal(sh[1].records, 1);
    assert_non_null(strstr(sh[1].path, "/results-00001.jsonl.zst"));
    queue_shard_list_free(sh, n);
    batch_out_free(w);
}

/* ---- a fault between the shard write and the queue commit ---- */

/* In a child (exec'd so that QUERN_FAULT is read afresh): commit items 0 and 1, then write
 * items 2 and 3 whose queue commit fails (the 3rd queue.commit: shard row, first commit,
 * second commit), and die without cleaning up. Exit 0 when all went as expected. */
static int fault_child(char **argv)
{
    struct queue *q = NULL;
    struct err_detail err = {0};
    if (queue_open(&q, argv[2], &err))
        return 10;
    struct batch_out_spec spec = {q,       atoll(argv[4]),    atoll(argv[5]),
                                  argv[3], (uint64_t)1 << 30, 1000};
    struct batch_out *w = NULL;
    if (batch_out_open(&w, &spec, &err))
        return 11;
    for (int i = 0; i < 4; i++) {
        int64_t item = atoll(argv[6 + i]);
        if (batch_out_hold(w, item, &err) ||
            batch_out_result(w, item, record((size_t)i), 1, 1, -1, -1, &err))
            return 12;
        if (i == 1 && batch_out_commit(w, &err))
            return 13;
    }
    if (batch_out_commit(w, &err) != ST_ERR_IO || !strstr(err.msg, "injected"))
        return 14;
    _exit(0); /* as if killed: nothing closed, nothing released */
}

static void test_fault_between_write_and_commit(void **state)
{
    struct fixture *f = *state;
    char run[32], job[32], it[4][32];
    snprintf(run, sizeof(run), "%lld", (long long)f->run_id);
    snprintf(job, sizeof(job), "%lld", (long long)f->job.id);
    for (int i = 0; i < 4; i++)
        snprintf(it[i], sizeof(it[i]), "%lld", (long long)f->items[i]);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        setenv("QUERN_FAULT", "queue.commit:3:fail", 1);
        execl("/proc/self/exe", "test_batch", "--fault-child", f->db, f->job_dir, run, job, it[0],
              it[1], it[2], it[3], (char *)NULL);
        _exit(127);
    }
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);

    /* the second frame is in the file but not counted: items 2 and 3 are still leased */
    struct queue_shard *sh;
    size_t n;
    shards(f, &sh, &n);
    assert_int_equal(n, 1);
    assert_int_equal(sh[0].state, QUEUE_SHARD_OPEN);
    assert_int_equal(sh[0].records, 2);
    uint64_t committed = sh[0].committed_bytes;
    char path[4200];
    snprintf(path, sizeof(path), "%s", sh[0].path);
    queue_shard_list_free(sh, n);
    assert_true(file_size(path) > (int64_t)committed);
    struct queue_counts c;
    item_counts(f, &c);
    assert_int_equal(c.items[QUEUE_ITEM_DONE], 2);
    assert_int_equal(c.items[QUEUE_ITEM_LEASED], 4);

    /* the run is found dead: its leases go back; the next run recovers the shard */
    struct err_detail err = {0};
    int64_t requeued = 0;
    check(queue_run_end(f->q, f->run_id, "dead", NULL, &requeued, &err), &err, "queue_run_end");
    assert_int_equal(requeued, 4);
    int64_t run2 = start_run(f->q);
    check(batch_recover_shards(f->q, f->job.id, run2, LEASE_MS, &err), &err, "recover");
    assert_int_equal(file_size(path), (int64_t)committed);
    shards(f, &sh, &n);
    assert_int_equal(sh[0].state, QUEUE_SHARD_CLOSED);
    char sha[SHA256_HEX_LEN];
    check(sha256_file(path, SHA256_WHOLE_FILE, sha, &err), &err, "sha256");
    assert_string_equal(sh[0].sha256, sha);
    queue_shard_list_free(sh, n);

    /* the rerun claims exactly the unfinished items and writes each once */
    assert_int_equal(claim_all(f->q, f->job.id, run2), 4);
    struct batch_out *w = open_writer(f, run2, 1000);
    for (size_t i = 2; i < f->n_items; i++)
        add_result(f, w, i);
    check(batch_out_commit(w, &err), &err, "commit");
    check(batch_out_close(w, &err), &err, "close");
    batch_out_free(w);
    item_counts(f, &c);
    assert_int_equal(c.items[QUEUE_ITEM_DONE], 6);
    shards(f, &sh, &n);
    assert_int_equal(n, 2);
    int seen[8] = {0};
    for (size_t s = 0; s < n; s++) {
        struct lines l;
        read_lines(sh[s].path, IO_SHARD_ALL, &l);
        assert_int_equal((uint64_t)l.n, sh[s].records);
        for (char *p = l.buf; (p = strstr(p, "\"custom_id\":\"c")) != NULL; p++) {
            int i = p[14] - '0';
            assert_true(i >= 0 && i < 8);
            seen[i]++;
        }
    }
    queue_shard_list_free(sh, n);
    for (size_t i = 0; i < f->n_items; i++)
        assert_int_equal(seen[i], 1);
}

/* ---- recovery of a dead run's shard ---- */

static void test_recover_dead_shard(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct batch_out *w = open_writer(f, f->run_id, 1000);
    add_result(f, w, 0);
    add_result(f, w, 1);
    check(batch_out_commit(w, &err), &err, "commit");
    struct queue_shard *sh;
    size_t n;
    shards(f, &sh, &n);
    char path[4200];
    snprintf(path, sizeof(path), "%s", sh[0].path);
    uint64_t committed = sh[0].committed_bytes;
    queue_shard_list_free(sh, n);

    /* while its writer holds the file, nobody recovers the shard, even past its run's end */
    int64_t run2 = start_run(f->q);
    check(queue_run_end(f->q, f->run_id, "dead", NULL, NULL, &err), &err, "queue_run_end");
    check(batch_recover_shards(f->q, f->job.id, run2, LEASE_MS, &err), &err, "recover");
    shards(f, &sh, &n);
    assert_int_equal(sh[0].state, QUEUE_SHARD_OPEN);
    queue_shard_list_free(sh, n);

    /* the writer dies leaving a torn tail: recovery cuts it and seals the shard */
    batch_out_free(w);
    FILE *t = fopen(path, "ab");
    assert_non_null(t);
    fputs("torn tail, never committed", t);
    fclose(t);
    assert_true(file_size(path) > (int64_t)committed);
    int64_t open = 0;
    check(batch_count_open_shards(f->q, f->job.id, &open, &err), &err, "count");
    assert_int_equal(open, 1);
    check(batch_recover_shards(f->q, f->job.id, run2, LEASE_MS, &err), &err, "recover");
    assert_int_equal(file_size(path), (int64_t)committed);
    check(batch_count_open_shards(f->q, f->job.id, &open, &err), &err, "count");
    assert_int_equal(open, 0);
    shards(f, &sh, &n);
    assert_int_equal(sh[0].state, QUEUE_SHARD_CLOSED);
    assert_int_equal(sh[0].run_id, run2);
    assert_int_equal(sh[0].records, 2);
    queue_shard_list_free(sh, n);
    uint64_t frames = 0, records = 0;
    check(io_shard_verify(path, IO_SHARD_ALL, &frames, &records, &err), &err, "verify");
    assert_int_equal(records, 2);
}

/* A dead run's shard with nothing committed is removed, not listed. */
static void test_recover_empty_shard(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct batch_out *w = open_writer(f, f->run_id, 1000);
    add_result(f, w, 0); /* starts the shard; never committed */
    char path[4200];
    snprintf(path, sizeof(path), "%s/results-00000.jsonl.zst", f->job_dir);
    assert_int_equal(file_size(path), 0);
    batch_out_free(w);
    check(queue_run_end(f->q, f->run_id, "dead", NULL, NULL, &err), &err, "queue_run_end");
    int64_t run2 = start_run(f->q);
    check(batch_recover_shards(f->q, f->job.id, run2, LEASE_MS, &err), &err, "recover");
    assert_int_equal(file_size(path), -1);
    struct queue_shard *sh;
    size_t n;
    shards(f, &sh, &n);
    assert_int_equal(sh[0].state, QUEUE_SHARD_CLOSED);
    assert_int_equal(sh[0].committed_bytes, 0);
    queue_shard_list_free(sh, n);
}

/* ---- the manifest ---- */

/* The job's manifest.json, parsed (caller deletes). */
static cJSON *read_manifest(struct fixture *f)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/manifest.json", f->job_dir);
    FILE *mf = fopen(path, "rb");
    assert_non_null(mf);
    char *text = calloc(1, 65536);
    size_t len = fread(text, 1, 65535, mf);
    fclose(mf);
    assert_true(len > 0);
    cJSON *m = cJSON_Parse(text);
    free(text);
    assert_non_null(m);
    return m;
}

static void test_manifest(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct batch_out *w = open_writer(f, f->run_id, 1000);
    for (size_t i = 0; i < 5; i++)
        add_result(f, w, i);
    add_error(f, w, 5);
    check(batch_out_commit(w, &err), &err, "commit");
    check(batch_out_close(w, &err), &err, "close");
    batch_out_free(w);
    assert_false(batch_manifest_current(f->q, &f->job, f->job_dir));
    check(batch_manifest_write(f->q, &f->job, f->job_dir, &err), &err, "manifest");
    assert_true(batch_manifest_current(f->q, &f->job, f->job_dir));

    cJSON *m = read_manifest(f);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(m, "complete")));
    char jid[32];
    snprintf(jid, sizeof(jid), "%lld", (long long)f->job.id);
    assert_string_equal(cJSON_GetObjectItem(m, "job_id")->valuestring, jid);
    const cJSON *arr = cJSON_GetObjectItem(m, "shards");
    assert_int_equal(cJSON_GetArraySize(arr), 2);
    static const char *const names[2] = {"results-00000.jsonl.zst", "errors-00000.jsonl.zst"};
    static const char *const kinds[2] = {"results", "errors"};
    static const double records[2] = {5, 1};
    for (int i = 0; i < 2; i++) {
        const cJSON *e = cJSON_GetArrayItem(arr, i);
        assert_string_equal(cJSON_GetObjectItem(e, "file")->valuestring, names[i]);
        assert_string_equal(cJSON_GetObjectItem(e, "kind")->valuestring, kinds[i]);
        assert_true(cJSON_GetObjectItem(e, "records")->valuedouble == records[i]);
        char sp[4200], sha[SHA256_HEX_LEN];
        snprintf(sp, sizeof(sp), "%s/%s", f->job_dir, names[i]);
        assert_true(cJSON_GetObjectItem(e, "bytes")->valuedouble == (double)file_size(sp));
        check(sha256_file(sp, SHA256_WHOLE_FILE, sha, &err), &err, "sha256");
        assert_string_equal(cJSON_GetObjectItem(e, "sha256")->valuestring, sha);
    }
    const cJSON *model = cJSON_GetObjectItem(m, "model");
    char sha[SHA256_HEX_LEN];
    check(sha256_file(f->job.model_path, SHA256_WHOLE_FILE, sha, &err), &err, "sha256");
    assert_string_equal(cJSON_GetObjectItem(model, "sha256")->valuestring, sha);
    cJSON_Delete(m);

    /* one written before provenance (no "runs") is not current: it gets rewritten */
    m = read_manifest(f);
    cJSON_DeleteItemFromObject(m, "runs");
    char *old = cJSON_Print(m);
    cJSON_Delete(m);
    char path[4200];
    snprintf(path, sizeof(path), "%s/manifest.json", f->job_dir);
    FILE *mf = fopen(path, "wb");
    assert_non_null(mf);
    fputs(old, mf);
    fclose(mf);
    free(old);
    assert_false(batch_manifest_current(f->q, &f->job, f->job_dir));

    /* an incomplete manifest is not current; written again, the queue (every item done)
     * makes it complete */
    check(batch_manifest_write(f->q, &f->job, f->job_dir, &err), &err, "manifest");
    assert_true(batch_manifest_current(f->q, &f->job, f->job_dir));
    m = read_manifest(f);
    cJSON_ReplaceItemInObject(m, "complete", cJSON_CreateFalse());
    old = cJSON_Print(m);
    cJSON_Delete(m);
    mf = fopen(path, "wb");
    assert_non_null(mf);
    fputs(old, mf);
    fclose(mf);
    free(old);
    assert_false(batch_manifest_current(f->q, &f->job, f->job_dir));
}

/* Provenance: each listed shard names the runs that wrote its records and how many, and the
 * manifest lists those runs once, with their host and engine (null where none was recorded). A
 * run whose engine is not a JSON object is listed with a null engine, not refused. */
static void test_manifest_writers(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    const char *eng2 = "{\"quern\":\"x\",\"device\":\"cpu avx2\",\"matmul\":\"q8\","
                       "\"kv_dtype\":\"f16\"}";
    /* run 1 (no engine recorded) writes items 0-2, then ends: its other leases go back */
    struct batch_out *w = open_writer(f, f->run_id, 1000);
    for (size_t i = 0; i < 3; i++)
        add_result(f, w, i);
    check(batch_out_commit(w, &err), &err, "commit");
    check(batch_out_close(w, &err), &err, "close");
    batch_out_free(w);
    check(queue_run_end(f->q, f->run_id, "drained", NULL, NULL, &err), &err, "end");
    /* run 2 (engine recorded) writes items 3-4 and an error for 5 */
    int64_t run2 = start_run(f->q);
    check(queue_run_set_engine(f->q, run2, eng2, &err), &err, "set engine");
    assert_int_equal(claim_all(f->q, f->job.id, run2), 3);
    w = open_writer(f, run2, 1000);
    add_result(f, w, 3);
    add_result(f, w, 4);
    add_error(f, w, 5);
    check(batch_out_commit(w, &err), &err, "commit");
    check(batch_out_close(w, &err), &err, "close");
    batch_out_free(w);
    check(batch_manifest_write(f->q, &f->job, f->job_dir, &err), &err, "manifest");
    cJSON *m = read_manifest(f);
    static const char *const names[3] = {"results-00000.jsonl.zst", "results-00001.jsonl.zst",
                                         "errors-00000.jsonl.zst"};
    const int64_t writer[3] = {f->run_id, run2, run2};
    static const double records[3] = {3, 2, 1};
    const cJSON *arr = cJSON_GetObjectItem(m, "shards");
    assert_int_equal(cJSON_GetArraySize(arr), 3);
    for (int i = 0; i < 3; i++) {
        const cJSON *e = cJSON_GetArrayItem(arr, i);
        assert_string_equal(cJSON_GetObjectItem(e, "file")->valuestring, names[i]);
        const cJSON *runs = cJSON_GetObjectItem(e, "runs");
        assert_int_equal(cJSON_GetArraySize(runs), 1);
        const cJSON *r = cJSON_GetArrayItem(runs, 0);
        assert_true(cJSON_GetObjectItem(r, "run")->valuedouble == (double)writer[i]);
        assert_true(cJSON_GetObjectItem(r, "records")->valuedouble == records[i]);
    }
    const cJSON *runs = cJSON_GetObjectItem(m, "runs");
    assert_int_equal(cJSON_GetArraySize(runs), 2);
    const cJSON *r1 = cJSON_GetArrayItem(runs, 0), *r2 = cJSON_GetArrayItem(runs, 1);
    struct proc_identity self;
    proc_identity_self(&self);
    assert_true(cJSON_GetObjectItem(r1, "run")->valuedouble == (double)f->run_id);
    assert_string_equal(cJSON_GetObjectItem(r1, "host")->valuestring, self.host);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(r1, "engine")));
    assert_true(cJSON_GetObjectItem(r2, "run")->valuedouble == (double)run2);
    cJSON *want = cJSON_Parse(eng2);
    assert_true(cJSON_Compare(cJSON_GetObjectItem(r2, "engine"), want, 1));
    cJSON_Delete(want);
    cJSON_Delete(m);

    /* an engine that is not an object: listed as unknown */
    check(queue_run_set_engine(f->q, run2, "[1", &err), &err, "set engine");
    check(batch_manifest_write(f->q, &f->job, f->job_dir, &err), &err, "manifest");
    m = read_manifest(f);
    r2 = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "runs"), 1);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(r2, "engine")));
    cJSON_Delete(m);
    assert_int_equal(queue_run_set_engine(f->q, 999, eng2, &err), ST_ERR_INVALID_ARG);
}

/* The output directory belongs to one job of one database: another job is refused it. */
static void test_outdir_marker(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    check(batch_outdir_claim(f->q, &f->job, f->job_dir, &err), &err, "claim own");
    struct queue_job other = f->job;
    other.id = f->job.id + 1;
    assert_int_equal(batch_outdir_claim(f->q, &other, f->job_dir, &err), ST_ERR_EXISTS);
    assert_non_null(strstr(err.msg, "belongs to job 'j'"));
}

/* ---- progress numbers ---- */

static void test_progress_json(void **state)
{
    (void)state;
    struct batch_progress p = {0}, back;
    p.job_id = 3;
    snprintf(p.job, sizeof(p.job), "night");
    p.total = 100;
    p.done = 40;
    p.failed = 10;
    p.mean_out = 50;
    p.gen_tok_s = 100;
    p.inflight_tokens = 500;
    p.running = 10;
    batch_progress_eta(&p);
    assert_int_equal(batch_progress_left(&p), 50);
    /* 40 queued x 50, and the 10 running need 10 x 50 - 500 = 0: one token each at least */
    assert_true(p.eta_s > 20.09 && p.eta_s < 20.11);
    /* the first items to finish were short, those running already longer: their lengths so far
     * raise the mean ((40 x 50 + 1500) / 50 = 70): 40 x 70 + (700 - 1500 -> 10) */
    struct batch_progress q = p;
    q.inflight_tokens = 1500;
    batch_progress_eta(&q);
    assert_true(q.eta_s > 28.09 && q.eta_s < 28.11);
    /* fewer finished than running (5 short ones of 300, 256 running, already 10 tokens each):
     * unknown, not 0 s (before: 295 x 3 - 2560 < 0 made it 0) */
    struct batch_progress e = {.total = 300,
                               .done = 5,
                               .mean_out = 3,
                               .gen_tok_s = 100,
                               .inflight_tokens = 2560,
                               .running = 256};
    batch_progress_eta(&e);
    assert_true(e.eta_s == -1);
    e.done = 256; /* the tail: 44 left, all running, longer than the mean: still > 0 */
    e.total = 300;
    e.running = 44;
    e.inflight_tokens = 44 * 20;
    batch_progress_eta(&e);
    assert_true(e.eta_s > 0.43 && e.eta_s < 0.45); /* 44 tokens at 100 tok/s */
    /* n = 4: the tail's 5 requests run 20 sequences, each request 200 tokens in all (mean_out
     * counts its four choices) and 100 so far: 5 x 100 tokens left, not 20 x 200 - 500 */
    struct batch_progress n4 = {.total = 100,
                                .done = 95,
                                .mean_out = 200,
                                .gen_tok_s = 100,
                                .inflight_tokens = 500,
                                .running = 20,
                                .in_flight = 5};
    batch_progress_eta(&n4);
    assert_true(n4.eta_s > 4.99 && n4.eta_s < 5.01);
    char *js = batch_progress_to_json(&n4);
    assert_non_null(js);
    assert_true(batch_progress_from_json(js, &back));
    free(js);
    assert_true(back.in_flight == 5 && back.running == 20);
    js = batch_progress_to_json(&p);
    assert_non_null(js);
    assert_true(batch_progress_from_json(js, &back));
    free(js);
    assert_string_equal(back.job, "night");
    assert_int_equal(back.done, 40);
    assert_true(back.eta_s == p.eta_s);
    assert_false(batch_progress_from_json("[1]", &back));
    struct batch_rate r;
    batch_rate_reset(&r);
    batch_rate_add(&r, 0, 0);
    batch_rate_add(&r, 2, 100);
    assert_true(batch_rate_get(&r) == 50);
}

/* ---- a whole run through the engine (needs the model) ---- */

struct shown {
    int live, final;            /* calls of each kind */
    struct batch_progress last; /* the FINAL numbers */
};

static void on_show(void *user, const struct batch_progress *p, enum batch_show what)
{
    struct shown *s = user;
    if (what == BATCH_SHOW_FINAL) {
        s->final++;
        s->last = *p;
    } else {
        s->live++;
    }
}

/* Three requests (one with a bad line) through batch_run_*: the run drains, two results and
 * one error record are committed, the manifest is complete, the stats count them. */
static void test_run_drains(void **state)
{
    (void)state;
    char model[4096];
    if (!realpath(test_model_path(), model)) {
        skip(); /* no model here */
        return;
    }
    char dir[64], db[128], out[128];
    snprintf(dir, sizeof(dir), "/tmp/quern-test-batch-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(db, sizeof(db), "%s/queue.db", dir);
    snprintf(out, sizeof(out), "%s/out", dir);
    struct queue *q = NULL;
    struct err_detail err = {0};
    check(queue_open(&q, db, &err), &err, "queue_open");
    struct queue_job_spec js = {"run", model, NULL, "{}", out, 1, 0};
    int64_t job_id;
    check(queue_job_create(q, &js, &job_id, &err), &err, "queue_job_create");
    static const char *const payloads[3] = {
        "{\"custom_id\":\"a\",\"prompt\":\"The sky is\",\"max_tokens\":4,\"temperature\":0}",
        "{\"custom_id\":\"b\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
        "\"max_tokens\":3,\"temperature\":0}",
        "{\"custom_id\":\"c\",\"prompt\":\"x\",\"max_tokens\":99999999}",
    };
    for (int i = 0; i < 3; i++) {
        struct queue_item_spec it = {0};
        it.custom_id = (const char *[]){"a", "b", "c"}[i];
        it.payload = payloads[i];
        check(queue_item_add(q, job_id, &it, NULL, &err), &err, "queue_item_add");
    }
    queue_close(q);

    struct shown shown = {0};
    struct batch_opts o = {0};
    o.db = db;
    o.claim = 64;
    o.flush_records = 256;
    o.flush_secs = 5;
    o.shard_records = 100000;
    o.shard_bytes = (size_t)1 << 30;
    o.lease = 300;
    o.grace = 30;
    o.backend = (struct kern_backend_opts){.n_threads = 2, .act = KERN_ACT_F32, .tp = 1};
    engine_params_default(&o.engine);
    o.engine.max_seqs = 4;
    o.engine.kv_mem = (size_t)64 << 20;
    o.show_period = 1000;
    o.show = on_show;
    o.show_user = &shown;
    struct batch_run *r = NULL;
    check(batch_run_open(&r, &o, &err), &err, "batch_run_open");
    assert_int_equal(batch_run_jobs(r, &err), BATCH_END_DRAINED);
    const struct batch_stats *st = batch_run_stats(r);
    assert_int_equal(st->items_done, 2);
    assert_int_equal(st->items_failed, 1);
    assert_int_equal(st->n_lat, 2);
    assert_true(st->completion_tokens >= 2 && st->completion_tokens <= 7);
    check(batch_run_end(r, "drained", NULL, &err), &err, "batch_run_end");
    batch_run_free(r);
    assert_int_equal(shown.final, 1);
    assert_int_equal(shown.last.done, 2);
    assert_int_equal(shown.last.failed, 1);

    check(queue_open(&q, db, &err), &err, "queue_open");
    struct queue_job job;
    check(queue_job_get(q, job_id, &job, &err), &err, "queue_job_get");
    assert_int_equal(job.state, QUEUE_JOB_DONE);
    char job_dir[4096];
    check(batch_job_dir(q, &job, NULL, 0, job_dir, sizeof(job_dir), &err), &err, "job dir");
    assert_true(batch_manifest_current(q, &job, job_dir));
    struct queue_shard *sh;
    size_t n;
    check(queue_shard_list(q, job_id, &sh, &n, &err), &err, "queue_shard_list");
    assert_int_equal(n, 2);
    struct lines l;
    read_lines(sh[1].path, IO_SHARD_ALL, &l);
    assert_non_null(strstr(l.buf, "\"custom_id\":\"c\""));
    read_lines(sh[0].path, IO_SHARD_ALL, &l);
    assert_int_equal(l.n, 2);
    queue_shard_list_free(sh, n);
    queue_job_free(&job);
    queue_close(q);
    rm_rf(dir);
}

int main(int argc, char **argv)
{
    if (argc == 10 && !strcmp(argv[1], "--fault-child"))
        return fault_child(argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_commit_protocol, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commit_drops_lost_items, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rotation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fault_between_write_and_commit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_recover_dead_shard, setup, teardown),
        cmocka_unit_test_setup_teardown(test_recover_empty_shard, setup, teardown),
        cmocka_unit_test_setup_teardown(test_manifest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_manifest_writers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_outdir_marker, setup, teardown),
        cmocka_unit_test(test_progress_json),
        cmocka_unit_test(test_run_drains),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
