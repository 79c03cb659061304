/* Unit tests for queue/ shards: the all-or-nothing shard commit and its exactly-once rule,
 * commits inside a caller's transaction, shard listing and the shard record index. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/test_queue_util.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_commit_all_or_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commit_in_user_tx, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shards, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_record_index, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
