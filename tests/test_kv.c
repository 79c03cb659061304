/* Unit tests for the KV block manager on its own (engine_kv_init, no model): reference
 * counts, LRU eviction order, prefix matching, the leak check, and random operations that
 * keep every invariant. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/test_engine_util.h"

static void test_kv_refcount_and_lru(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    /* 4 blocks of 4 tokens, 3 slots */
    assert_int_equal(engine_kv_init(&kv, 1, 1, 2, KERN_KV_F16, 4, 4, 3, 1, &err), ST_OK);
    int32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    assert_int_equal(engine_kv_reserve(kv, 0, 9, &err), ST_OK); /* 3 blocks */
    assert_int_equal(engine_kv_available(kv), 1);
    engine_kv_prefix_commit(kv, 0, a, 9); /* registers blocks 0 and 1 (full) */
    check_ok(kv, 0);
    /* slot 1 shares the two full blocks, never the partial third */
    assert_int_equal(engine_kv_prefix_attach(kv, 1, a, 12, 11), 8);
    assert_int_equal(kv->ref[engine_kv_table(kv, 1)[0]], 2);
    assert_int_equal(engine_kv_table(kv, 1)[1], engine_kv_table(kv, 0)[1]);
    check_ok(kv, 0);
    /* a different prefix shares nothing */
    int32_t b[8] = {1, 2, 3, 5, 5, 6, 7, 8};
    assert_int_equal(engine_kv_prefix_attach(kv, 2, b, 8, 8), 0);
    /* over-reserving fails and takes nothing */
    assert_int_equal(engine_kv_reserve(kv, 2, 8, &err), ST_ERR_RANGE);
    assert_int_equal(engine_kv_available(kv), 1);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 1);
    check_ok(kv, 1);
    /* the two registered blocks are cached-free; the unregistered one is plain free */
    assert_int_equal(kv->n_lru, 2);
    assert_int_equal(kv->n_free, 2);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, a, 12, 12), 8); /* cache hit after free */
    engine_kv_release(kv, 0);
    /* reserving all 4 blocks evicts both cached ones */
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK);
    assert_int_equal(kv->stats.evictions, 2);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, a, 12, 12), 0);
    check_ok(kv, 0);
    /* truncate returns blocks */
    engine_kv_truncate(kv, 2, 5);
    assert_int_equal(engine_kv_available(kv), 2);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

/* Cached free blocks are evicted least recently used first: of two released prompts the older
 * goes first; reattaching a prompt makes it the newest again; and a released chain loses its
 * last block before its first (the first blocks are the ones other prompts can share). Fails if
 * eviction takes the newest cached block, or if a hit does not refresh a block's age. */
static void test_kv_lru_order(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    /* 5 blocks of 4 tokens, 3 slots */
    assert_int_equal(engine_kv_init(&kv, 1, 1, 2, KERN_KV_F16, 4, 5, 3, 1, &err), ST_OK);
    const int32_t x[4] = {1, 2, 3, 4}, y[4] = {5, 6, 7, 8}, c[8] = {9, 10, 11, 12, 13, 14, 15, 16};
    /* cache one block of x, then one of y: LRU x (oldest), y */
    const int32_t *one[2] = {x, y};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(engine_kv_reserve(kv, 0, 4, &err), ST_OK);
        engine_kv_prefix_commit(kv, 0, one[i], 4);
        engine_kv_release(kv, 0);
    }
    assert_int_equal(kv->n_lru, 2);
    assert_int_equal(kv->n_free, 3);
    /* slot 2 takes the 3 plain free blocks and one cached: x must go, y stay */
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK);
    assert_int_equal(kv->stats.evictions, 1);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 4);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, x, 4, 4), 0);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    /* cache x again after y, then hit y: y was used last, so x is now the older one */
    assert_int_equal(engine_kv_reserve(kv, 0, 4, &err), ST_OK);
    engine_kv_prefix_commit(kv, 0, x, 4);
    engine_kv_release(kv, 0);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 4);
    engine_kv_release(kv, 0);
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK); /* 3 free + 1 cached */
    assert_int_equal(kv->stats.evictions, 2);
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 4);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, x, 4, 4), 0);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 2);
    /* a two-block chain c released after y: evicting one block takes y (older), the next takes
     * c's second block, and c's first block is still a hit */
    assert_int_equal(engine_kv_reserve(kv, 0, 8, &err), ST_OK);
    engine_kv_prefix_commit(kv, 0, c, 8);
    engine_kv_release(kv, 0);
    assert_int_equal(kv->n_lru, 3);
    assert_int_equal(kv->n_free, 2);
    assert_int_equal(engine_kv_reserve(kv, 2, 16, &err), ST_OK); /* 2 free + 2 cached */
    assert_int_equal(engine_kv_prefix_attach(kv, 0, y, 4, 4), 0);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, c, 8, 8), 4);
    engine_kv_release(kv, 0);
    engine_kv_release(kv, 1);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

static void test_kv_check_detects_leak(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    assert_int_equal(engine_kv_init(&kv, 1, 1, 2, KERN_KV_F16, 4, 4, 2, 1, &err), ST_OK);
    assert_int_equal(engine_kv_reserve(kv, 0, 4, &err), ST_OK);
    assert_int_equal(engine_kv_check(kv, 1, &err), ST_ERR_INTERNAL); /* still held */
    assert_non_null(strstr(err.msg, "leak"));
    kv->ref[engine_kv_table(kv, 0)[0]] = 2; /* corrupt a count */
    assert_int_equal(engine_kv_check(kv, 0, &err), ST_ERR_INTERNAL);
    kv->ref[engine_kv_table(kv, 0)[0]] = 1;
    engine_kv_release(kv, 0);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

/* Random operations keep the invariants (hash table deletions included). */
static void test_kv_random_ops(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    assert_int_equal(engine_kv_init(&kv, 1, 1, 1, KERN_KV_F16, 2, 32, 6, 1, &err), ST_OK);
    uint64_t r = 12345;
    int32_t toks[6][64];
    int32_t len[6] = {0};
    for (int it = 0; it < 20000; it++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        int s = (int)((r >> 33) % 6), op = (int)((r >> 40) % 4);
        if (op == 0 && len[s] == 0) { /* start: prompt from a small alphabet -> shared prefixes */
            int n = 1 + (int)((r >> 20) % 40);
            for (int i = 0; i < n; i++)
                toks[s][i] = (int32_t)((r >> (i % 30)) % 2);
            int32_t got = engine_kv_prefix_attach(kv, s, toks[s], n, n - 1);
            if (engine_kv_reserve(kv, s, n, NULL) == ST_OK) {
                len[s] = n;
                engine_kv_prefix_commit(kv, s, toks[s], n);
            } else {
                engine_kv_release(kv, s);
            }
            (void)got;
        } else if (op == 1 && len[s] > 0 && len[s] < 64) { /* decode one token */
            if (engine_kv_reserve(kv, s, len[s] + 1, NULL) == ST_OK) {
                toks[s][len[s]] = (int32_t)(r % 3);
                len[s]++;
                engine_kv_prefix_commit(kv, s, toks[s], len[s]);
            }
        } else if (op == 2 && len[s] > 0) {
            engine_kv_release(kv, s);
            len[s] = 0;
        } else if (op == 3 && len[s] > 2) { /* roll back the last token */
            int32_t keep = len[s] - 1;
            if (kv->ref[engine_kv_table(kv, s)[(keep) / 2]] == 1 || keep % 2 == 0) {
                engine_kv_truncate(kv, s, keep);
                len[s] = keep;
            }
        }
        if (it % 97 == 0)
            check_ok(kv, 0);
    }
    for (int s = 0; s < 6; s++)
        engine_kv_release(kv, s);
    check_ok(kv, 1);
    assert_true(kv->stats.hit_blocks > 100);
    engine_kv_free(kv);
}

int main(void)
{
    const struct CMUnitTest kv_tests[] = {
        cmocka_unit_test(test_kv_refcount_and_lru),
        cmocka_unit_test(test_kv_lru_order),
        cmocka_unit_test(test_kv_check_detects_leak),
        cmocka_unit_test(test_kv_random_ops),
    };
    return cmocka_run_group_tests_name("kv", kv_tests, NULL, NULL);
}
