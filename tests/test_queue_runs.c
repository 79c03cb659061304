/* Unit tests for queue/ runs and leases: claim order and limits; lease expiry with a fake
 * clock; runs' live progress; release, cancel, retry and counts; dead runs reaped and a
 * run's own leases never swept; four forked processes draining one queue with no item done
 * twice. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/test_queue_util.h"

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

/* Same host, boot and namespace: a run whose process has exited is ended at once by
 * queue_reap_dead (leases back to queued, attempts kept, shard adoptable with any lease; in an
 * exclusive file, runs of other hosts too);
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
    /* nothing more to reap; the other host's run keeps a lease it takes now */
    struct queue_claimed *items = NULL;
    size_t k = 0;
    assert_int_equal(queue_claim(q, job, r_remote, 1, 3600000, &items, &k, &err), ST_OK);
    assert_int_equal(k, 1);
    queue_claimed_free(items, k);
    assert_int_equal(queue_reap_dead(q, &self, &reaped, &err), ST_OK);
    assert_int_equal(reaped, 0);
    queue_close(q);
    /* an exclusive file (a part): whoever holds it has the only process using it, so a run on
     * another host that has not ended is dead too (a Slurm task requeued on another node) */
    struct queue_options xo = {.exclusive = true, .busy_timeout_ms = 50};
    assert_int_equal(queue_open_opts(&q, f->path, &xo, &err), ST_OK);
    assert_int_equal(queue_reap_dead(q, &self, &reaped, &err), ST_OK);
    assert_int_equal(reaped, 1);
    queue_close(q);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'leased'"), 0);
    snprintf(sql, sizeof(sql), "SELECT exit_reason = 'dead' FROM runs WHERE id = %lld",
             (long long)r_remote);
    assert_int_equal(sql_int(f->path, sql), 1);
    snprintf(sql, sizeof(sql), "SELECT ended IS NULL FROM runs WHERE id = %lld", (long long)r_live);
    assert_int_equal(sql_int(f->path, sql), 1);
}

/* A run of job on this host (*self: this process) whose process is gone: this process's
 * identity with another start time. */
static struct queue_run_spec gone_run_spec(int64_t job, struct proc_identity *self)
{
    proc_identity_self(self);
    if (!self->boot_id[0] || !self->pid_ns[0] || !self->start_ticks)
        fail_msg("no /proc identity on this machine");
    struct queue_run_spec gone = {.job_id = job,
                                  .host = self->host,
                                  .pid = self->pid,
                                  .boot_id = self->boot_id,
                                  .pid_ns = self->pid_ns,
                                  .pstart = self->start_ticks + 1};
    return gone;
}

/* queue_run_list_live marks a run of this host whose process is gone (status shows it dead
 * where ending it failed, as on a full disk), not this process's own run nor another host's. */
static void test_gone_runs_listed(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 2);
    struct proc_identity self;
    struct queue_run_spec gone = gone_run_spec(job, &self), mine = gone, remote = gone;
    mine.pstart = self.start_ticks;
    remote.host = "another-host";
    int64_t ids[3];
    assert_int_equal(queue_run_start(q, &gone, &ids[0], &err), ST_OK);
    assert_int_equal(queue_run_start(q, &mine, &ids[1], &err), ST_OK);
    assert_int_equal(queue_run_start(q, &remote, &ids[2], &err), ST_OK);
    struct queue_run_info *runs = NULL;
    size_t n = 0;
    assert_int_equal(queue_run_list_live(q, &runs, &n, &err), ST_OK);
    assert_int_equal(n, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(runs[i].id, ids[i]);
        assert_int_equal(runs[i].gone, i == 0);
    }
    queue_run_info_free(runs, n);
    queue_close(q);
}

/* A run that recorded its stop (queue_run_stopping) and then died (SIGKILL at the end of a
 * scheduler's KillWait, inside its --grace) costs its items no attempt: neither when a run on
 * its host finds it dead, nor when its leases expire (another host). A run that died without
 * stopping still does (the guard against requests that crash runs). */
static void test_stopping_run_dies(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 6);
    struct proc_identity self;
    /* runs of this host whose process is gone (another start time): one stopping, one not */
    struct queue_run_spec gone = gone_run_spec(job, &self);
    int64_t r_stop = 0, r_crash = 0, r_far = 0;
    assert_int_equal(queue_run_start(q, &gone, &r_stop, &err), ST_OK);
    assert_int_equal(queue_run_start(q, &gone, &r_crash, &err), ST_OK);
    /* and a run on another host, stopping, whose leases will expire */
    struct queue_run_spec far = gone;
    far.host = "elsewhere";
    assert_int_equal(queue_run_start(q, &far, &r_far, &err), ST_OK);
    assert_int_equal(claim_count(q, job, r_stop, 2, 3600000), 2);
    assert_int_equal(claim_count(q, job, r_crash, 2, 3600000), 2);
    assert_int_equal(claim_count(q, job, r_far, 2, 1000), 2);
    assert_int_equal(queue_run_stopping(q, r_stop, &err), ST_OK);
    assert_int_equal(queue_run_stopping(q, r_stop, &err), ST_OK); /* again: harmless */
    assert_int_equal(queue_run_stopping(q, r_far, &err), ST_OK);
    int64_t reaped = 0;
    assert_int_equal(queue_reap_dead(q, &self, &reaped, &err), ST_OK);
    assert_int_equal(reaped, 2);
    char sql[160];
    snprintf(sql, sizeof(sql),
             "SELECT count(*) FROM items WHERE state = 'queued' AND attempts = 0"
             " AND id IN (1, 2)");
    assert_int_equal(sql_int(f->path, sql), 2); /* the stopping run's: given back uncounted */
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'queued'"
                                      " AND attempts = 1 AND id IN (3, 4)"),
                     2); /* the crashed run's: counted */
    /* the far run's leases expire: a claim puts them back, uncounted */
    f->now += 2000;
    int64_t r_new = start_run(q, job);
    claim_count(q, job, r_new, 1, 1000);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE id IN (5, 6)"
                                      " AND attempts = 0 AND state = 'queued'") +
                         sql_int(f->path, "SELECT count(*) FROM items WHERE id IN (5, 6)"
                                          " AND attempts = 1 AND state = 'leased'"),
                     2);
    /* the stop is recorded once, when it began */
    snprintf(sql, sizeof(sql), "SELECT stopping IS NOT NULL FROM runs WHERE id = %lld",
             (long long)r_stop);
    assert_int_equal(sql_int(f->path, sql), 1);
    snprintf(sql, sizeof(sql), "SELECT stopping IS NULL FROM runs WHERE id = %lld",
             (long long)r_crash);
    assert_int_equal(sql_int(f->path, sql), 1);
    queue_close(q);
}

/* A run that dies holding items whose computation it never reached (queue_mark_started: the
 * claim marks them, handing them to the engine clears the mark, the engine's first step on
 * them sets it again) did not die of them: their attempts come back, whether a run on its host
 * finds it dead or its leases expire. Marked ones keep theirs. Before, a kill -9 counted an
 * attempt for every item a run held, so three crashes failed requests that never ran. */
static void test_unstarted_items_refunded(void **state)
{
    struct fixture *f = *state;
    struct err_detail err = {0};
    struct queue *q = open_q(f);
    int64_t job = make_job(q, "j", 10);
    struct proc_identity self;
    struct queue_run_spec gone = gone_run_spec(job, &self);
    int64_t r_crash = 0, r_far = 0;
    assert_int_equal(queue_run_start(q, &gone, &r_crash, &err), ST_OK);
    struct queue_run_spec far = gone;
    far.host = "elsewhere";
    assert_int_equal(queue_run_start(q, &far, &r_far, &err), ST_OK);
    assert_int_equal(claim_count(q, job, r_crash, 6, 3600000), 6);
    assert_int_equal(claim_count(q, job, r_far, 2, 1000), 2);
    /* items 1-5 handed to the engine (6 crashed its parser, say: still marked); 1 and 2 then
     * computed; a mark by a run that does not hold the item changes nothing */
    const int64_t handed[] = {1, 2, 3, 4, 5}, begun[] = {1, 2}, far_handed[] = {7, 8},
                  far_begun[] = {7};
    assert_int_equal(queue_mark_started(q, r_crash, handed, 5, 0, &err), ST_OK);
    assert_int_equal(queue_mark_started(q, r_crash, begun, 2, 1, &err), ST_OK);
    assert_int_equal(queue_mark_started(q, r_far, handed, 5, 1, &err), ST_OK);
    assert_int_equal(queue_mark_started(q, r_far, far_handed, 2, 0, &err), ST_OK);
    assert_int_equal(queue_mark_started(q, r_far, far_begun, 1, 1, &err), ST_OK);
    assert_int_equal(queue_mark_started(q, r_far, NULL, 0, 1, &err), ST_OK);
    int64_t reaped = 0;
    assert_int_equal(queue_reap_dead(q, &self, &reaped, &err), ST_OK);
    assert_int_equal(reaped, 1);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'queued'"
                                      " AND attempts = 1 AND started IS NULL AND id IN (1, 2, 6)"),
                     3);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE state = 'queued'"
                                      " AND attempts = 0 AND id IN (3, 4, 5)"),
                     3);
    /* the far run's leases expire: a claim (of one item, the lowest queued) puts them back */
    f->now += 2000;
    int64_t r_new = start_run(q, job);
    size_t n = 0;
    struct queue_claimed *c = claim(q, job, r_new, 1, 1000, &n);
    assert_int_equal(n, 1);
    assert_int_equal(c[0].id, 1);
    queue_claimed_free(c, n);
    assert_int_equal(sql_int(f->path, "SELECT attempts FROM items WHERE id = 7"), 1);
    assert_int_equal(sql_int(f->path, "SELECT attempts FROM items WHERE id = 8"), 0);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM items WHERE id IN (7, 8)"
                                      " AND state = 'queued' AND started IS NULL"),
                     2);
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
    int64_t *lids;
    size_t nl;
    assert_int_equal(queue_lease_list(q, a, &lids, &nl, &err), ST_OK); /* which ones: ascending */
    assert_int_equal(nl, 3);
    for (size_t i = 0; i < nl; i++)
        assert_int_equal(lids[i], ca[i].id);
    free(lids);
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
    /* a's heartbeat now reports it holds nothing, and the list is empty; b's lists all five */
    assert_int_equal(queue_lease_extend(q, a, 1000, &held, &err), ST_OK);
    assert_int_equal(held, 0);
    assert_int_equal(queue_lease_list(q, a, &lids, &nl, &err), ST_OK);
    assert_true(nl == 0 && lids == NULL);
    assert_int_equal(queue_lease_list(q, b, &lids, &nl, &err), ST_OK);
    assert_int_equal(nl, 5);
    for (size_t i = 1; i < nl; i++)
        assert_true(lids[i - 1] < lids[i]);
    free(lids);

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

/* Several processes creating the same new queue at once: each open must wait, not fail, and
 * none may see a half-made queue (a version and tables read from two different moments). The
 * window is small, so the race is run on many fresh files. */
static void test_concurrent_create(void **state)
{
    struct fixture *f = *state;
    enum { ROUNDS = 64, PROCS = 8 };
    for (int r = 0; r < ROUNDS; r++) {
        char path[160];
        snprintf(path, sizeof(path), "%s/create-%d.db", f->dir, r);
        pid_t pids[PROCS];
        for (int p = 0; p < PROCS; p++) {
            pids[p] = fork();
            assert_true(pids[p] >= 0);
            if (pids[p] == 0) {
                struct queue *q = NULL;
                struct err_detail err = {0};
                char name[16];
                snprintf(name, sizeof(name), "job%d", p);
                struct queue_job_spec spec = {.name = name, .model_path = "m", .out_dir = "o"};
                int64_t id = 0;
                enum status st = queue_open(&q, path, &err);
                if (st == ST_OK)
                    st = queue_job_create(q, &spec, &id, &err);
                if (st != ST_OK)
                    fprintf(stderr, "round %d, process %d: %s\n", r, p, err.msg);
                queue_close(q);
                _exit(st == ST_OK ? 0 : 1);
            }
        }
        int failed = 0;
        for (int p = 0; p < PROCS; p++) {
            int ws = 0;
            assert_int_equal(waitpid(pids[p], &ws, 0), pids[p]);
            failed += !WIFEXITED(ws) || WEXITSTATUS(ws) != 0;
        }
        assert_int_equal(failed, 0);
        assert_int_equal(sql_int(path, "SELECT count(*) FROM jobs"), PROCS);
        assert_int_equal(sql_int(path, "PRAGMA user_version"), QUEUE_SCHEMA_VERSION);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_claim_order_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lease_expiry_reclaim, setup, teardown),
        cmocka_unit_test_setup_teardown(test_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retry_failed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_create, setup, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_workers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_run_progress, setup, teardown),
        cmocka_unit_test_setup_teardown(test_own_leases_not_swept, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retry_skips_submit_rejects, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reap_dead_runs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gone_runs_listed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stopping_run_dies, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unstarted_items_refunded, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
