/* Unit tests for the KV block manager on its own (engine_kv_init, no model): reference
 * counts, LRU eviction order, prefix matching, the leak check, and random operations (forks
 * of another sequence's prefix among them) that keep every invariant. */
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
    assert_int_equal(kv->pool[0].ref[engine_kv_table(kv, 1)[0]], 2);
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
    assert_int_equal(kv->pool[0].n_lru, 2);
    assert_int_equal(kv->pool[0].n_free, 2);
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
    assert_int_equal(kv->pool[0].n_lru, 2);
    assert_int_equal(kv->pool[0].n_free, 3);
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
    assert_int_equal(kv->pool[0].n_lru, 3);
    assert_int_equal(kv->pool[0].n_free, 2);
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
    kv->pool[0].ref[engine_kv_table(kv, 0)[0]] = 2; /* corrupt a count */
    assert_int_equal(engine_kv_check(kv, 0, &err), ST_ERR_INTERNAL);
    kv->pool[0].ref[engine_kv_table(kv, 0)[0]] = 1;
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
        int t = (int)((r >> 50) % 6);
        if (op == 0 && len[s] == 0 && t != s && len[t] >= 2 && (r >> 56) % 2) {
            /* fork a prefix of another sequence (n > 1 choices) */
            int32_t n = 1 + (int32_t)((r >> 20) % (uint64_t)len[t]);
            if (engine_kv_fork(kv, s, t, n)) {
                assert_int_equal(engine_kv_seq_blocks(kv, s), (n + 1) / 2);
                for (int32_t b = 0; b < n / 2; b++) /* whole blocks shared */
                    assert_int_equal(engine_kv_table(kv, s)[b], engine_kv_table(kv, t)[b]);
                if (n % 2)
                    assert_int_not_equal(engine_kv_table(kv, s)[n / 2],
                                         engine_kv_table(kv, t)[n / 2]);
                memcpy(toks[s], toks[t], sizeof(int32_t) * (size_t)n);
                len[s] = n;
            } else {
                assert_int_equal(engine_kv_seq_blocks(kv, s), 0);
            }
        } else if (op == 0 && len[s] == 0) { /* start: prompt from a small alphabet -> shared
                                               * prefixes */
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
            if (kv->pool[0].ref[engine_kv_table(kv, s)[(keep) / 2]] == 1 || keep % 2 == 0) {
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
    assert_true(kv->stats.forked_blocks > 100 && kv->stats.copied_blocks > 100);
    engine_kv_free(kv);
}

/* The sliding-window pool: a sequence holds one block of each pool per logical block; blocks
 * of pool 1 out of the window are given back by engine_kv_slide (and stay cached); the
 * available count is the smaller pool's; a prefix is attached only as far as pool 1 still has
 * the blocks of its window, falling back to a shorter prefix when the last one was evicted. */
static void test_kv_window_pool(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    /* 2 layers (layer 0 sliding, window 6), 4-token blocks, 16 main blocks, 6 window blocks */
    assert_int_equal(engine_kv_init(&kv, 2, 1, 2, KERN_KV_F16, 4, 16, 3, 1, &err), ST_OK);
    const uint8_t local[2] = {1, 0};
    assert_int_equal(engine_kv_set_window(kv, local, 6, 17, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(engine_kv_set_window(kv, local, 6, 6, &err), ST_OK);
    assert_int_equal(engine_kv_n_pools(kv), 2);
    assert_int_equal(engine_kv_layer_pool(kv, 0), 1);
    assert_int_equal(engine_kv_layer_pool(kv, 1), 0);
    int32_t a[32];
    for (int i = 0; i < 32; i++)
        a[i] = 100 + i;
    /* 20 tokens: 5 logical blocks; the window pool has 1 left, so that is what is available */
    assert_int_equal(engine_kv_reserve(kv, 0, 20, &err), ST_OK);
    assert_int_equal(engine_kv_available(kv), 1);
    assert_int_equal(engine_kv_reserve(kv, 1, 8, &err), ST_ERR_RANGE);
    engine_kv_prefix_commit(kv, 0, a, 20);
    /* positions >= 20 attend to 15.. at the earliest: blocks 0-2 (tokens 0-11) go back */
    engine_kv_slide(kv, 0, 20);
    assert_int_equal(engine_kv_seq_held(kv, 0, 1), 2);
    assert_int_equal(engine_kv_seq_held(kv, 0, 0), 5);
    assert_int_equal(engine_kv_table_pool(kv, 0, 1)[2], -1);
    assert_true(engine_kv_table_pool(kv, 0, 1)[3] >= 0);
    assert_int_equal(engine_kv_available(kv), 4);
    check_ok(kv, 0);
    /* sliding again to the same point, or back, changes nothing */
    engine_kv_slide(kv, 0, 20);
    engine_kv_slide(kv, 0, 3);
    assert_int_equal(engine_kv_seq_held(kv, 0, 1), 2);
    /* on to 28 tokens; rolling back to 22 keeps the window's blocks */
    assert_int_equal(engine_kv_reserve(kv, 0, 28, &err), ST_OK);
    engine_kv_truncate(kv, 0, 22);
    assert_int_equal(engine_kv_seq_blocks(kv, 0), 6);
    assert_int_equal(engine_kv_seq_held(kv, 0, 1), 3);
    engine_kv_prefix_commit(kv, 0, a, 22); /* registers block 4 in both pools */
    check_ok(kv, 0);
    /* a prompt sharing 24 tokens: 5 whole blocks are cached in the main pool, and the window of
     * position 20 (tokens 15..) starts in block 3, which the window pool still holds */
    assert_int_equal(engine_kv_prefix_attach(kv, 1, a, 28, 27), 20);
    assert_int_equal(engine_kv_seq_held(kv, 1, 1), 2);
    assert_int_equal(kv->pool[1].ref[engine_kv_table_pool(kv, 1, 1)[3]], 2);
    assert_int_equal(engine_kv_table_pool(kv, 1, 1)[2], -1);
    check_ok(kv, 0);
    engine_kv_release(kv, 1);
    engine_kv_release(kv, 0);
    check_ok(kv, 1);
    /* everything seq 0 committed is cached in the window pool: blocks 1, 2 (slid out; 0 was
     * evicted by the reserve to 28), then 4 and 3 (released last block first) */
    assert_int_equal(kv->pool[1].n_lru, 4);
    /* evicting 1, 2 and 4 leaves no window for any prefix length: nothing is attached */
    assert_int_equal(engine_kv_reserve(kv, 2, 20, &err), ST_OK);
    assert_int_equal(kv->pool[1].n_lru, 1);
    assert_int_equal(engine_kv_prefix_attach(kv, 1, a, 28, 27), 0);
    check_ok(kv, 0);
    engine_kv_release(kv, 1);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    /* a shorter prefix when only the last block's window is gone: 8 tokens (nothing slides:
     * position 8 attends to 3..), released as 1 then 0; evicting block 1 leaves the window of
     * position 4 (block 0), so the attach falls back from 8 tokens to 4 */
    engine_kv_prefix_clear(kv);
    assert_int_equal(engine_kv_reserve(kv, 0, 8, &err), ST_OK);
    engine_kv_prefix_commit(kv, 0, a, 8);
    engine_kv_slide(kv, 0, 8);
    assert_int_equal(engine_kv_seq_held(kv, 0, 1), 2);
    engine_kv_release(kv, 0);
    assert_int_equal(engine_kv_reserve(kv, 2, 20, &err), ST_OK); /* 4 free + 1 cached */
    assert_int_equal(engine_kv_prefix_attach(kv, 1, a, 12, 11), 4);
    assert_int_equal(engine_kv_seq_held(kv, 1, 1), 1);
    check_ok(kv, 0);
    engine_kv_release(kv, 1);
    engine_kv_release(kv, 2);
    check_ok(kv, 1);
    engine_kv_free(kv);
}

/* Random operations with a window pool keep the invariants, and a sequence slid to its length
 * holds at most a window's blocks plus a partial one in that pool. */
static void test_kv_window_random_ops(void **state)
{
    (void)state;
    struct engine_kv *kv;
    struct err_detail err = {0};
    const int W = 5, B = 2;
    assert_int_equal(engine_kv_init(&kv, 3, 1, 1, KERN_KV_F16, B, 64, 6, 1, &err), ST_OK);
    const uint8_t local[3] = {1, 1, 0};
    assert_int_equal(engine_kv_set_window(kv, local, W, 24, &err), ST_OK);
    uint64_t r = 777;
    int32_t toks[6][64];
    int32_t len[6] = {0};
    int forks = 0, refused = 0;
    for (int it = 0; it < 20000; it++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        int s = (int)((r >> 33) % 6), op = (int)((r >> 40) % 4);
        int t = (int)((r >> 50) % 6);
        if (op == 0 && len[s] == 0 && t != s && len[t] >= 2 && (r >> 56) % 2) {
            /* fork: only as far back as t still holds the window's blocks */
            int32_t n = 1 + (int32_t)((r >> 20) % (uint64_t)len[t]);
            if (engine_kv_fork(kv, s, t, n)) {
                memcpy(toks[s], toks[t], sizeof(int32_t) * (size_t)n);
                len[s] = n;
                forks++;
            } else {
                assert_int_equal(engine_kv_seq_blocks(kv, s), 0);
                refused++;
            }
        } else if (op == 0 && len[s] == 0) {
            int n = 1 + (int)((r >> 20) % 40);
            for (int i = 0; i < n; i++)
                toks[s][i] = (int32_t)((r >> (i % 30)) % 2);
            int32_t got = engine_kv_prefix_attach(kv, s, toks[s], n, n - 1);
            engine_kv_slide(kv, s, got);
            /* prefill in chunks of up to 7, sliding after each */
            int ok = 1;
            for (int32_t at = got; at < n && ok;) {
                int32_t c = n - at < 7 ? n - at : 7;
                ok = engine_kv_reserve(kv, s, at + c, NULL) == ST_OK;
                if (ok) {
                    at += c;
                    engine_kv_prefix_commit(kv, s, toks[s], at);
                    engine_kv_slide(kv, s, at);
                }
            }
            if (ok)
                len[s] = n;
            else
                engine_kv_release(kv, s);
        } else if (op == 1 && len[s] > 0 && len[s] < 64) {
            if (engine_kv_reserve(kv, s, len[s] + 1, NULL) == ST_OK) {
                toks[s][len[s]] = (int32_t)(r % 3);
                len[s]++;
                engine_kv_prefix_commit(kv, s, toks[s], len[s]);
                engine_kv_slide(kv, s, len[s] - 1); /* the newest token's own step is next */
            }
        } else if (op == 2 && len[s] > 0) {
            engine_kv_release(kv, s);
            len[s] = 0;
        } else if (op == 3 && len[s] > 2) { /* speculate 3 tokens, keep 0..3 of them */
            if (engine_kv_reserve(kv, s, len[s] + 3, NULL) == ST_OK) {
                int32_t keep = len[s] + (int32_t)((r >> 50) % 4);
                engine_kv_truncate(kv, s, keep);
                for (int32_t i = len[s]; i < keep; i++)
                    toks[s][i] = 2;
                len[s] = keep;
                engine_kv_prefix_commit(kv, s, toks[s], len[s]);
                engine_kv_slide(kv, s, len[s] - 1);
            }
        }
        if (len[s] > 0) {
            int32_t held = engine_kv_seq_held(kv, s, 1);
            assert_true(held <= (W - 1 + B - 1) / B + 2);
        }
        if (it % 97 == 0)
            check_ok(kv, 0);
    }
    for (int s = 0; s < 6; s++)
        engine_kv_release(kv, s);
    check_ok(kv, 1);
    assert_true(kv->stats.hit_blocks > 100);
    assert_true(forks > 50 && refused > 50); /* both ways of a fork in the window's pool */
    assert_true(kv->stats.copied_blocks > 25);
    engine_kv_free(kv);
}

int main(void)
{
    const struct CMUnitTest kv_tests[] = {
        cmocka_unit_test(test_kv_refcount_and_lru),   cmocka_unit_test(test_kv_lru_order),
        cmocka_unit_test(test_kv_check_detects_leak), cmocka_unit_test(test_kv_random_ops),
        cmocka_unit_test(test_kv_window_pool),        cmocka_unit_test(test_kv_window_random_ops),
    };
    return cmocka_run_group_tests_name("kv", kv_tests, NULL, NULL);
}
