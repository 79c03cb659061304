/* Unit tests for the stop-string matcher in engine/sampler: basic matches, overlapping stop
 * strings, and random chunkings of the text against a reference search. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"

/* ---- stop strings --------------------------------------------------------------------- */

/* Feeds text in the given chunk sizes; returns in out the concatenation of everything
 * emitted (plus the pending tail when no stop matched) and whether a stop matched. Checks at
 * every push that the bytes emitted so far stay within the first `limit` bytes (the text
 * before the stop string), so stop text is never exposed, not even transiently. */
static int feed(struct engine_stop *st, const char *text, const size_t *chunks, size_t n_chunks,
                size_t limit, char *out, size_t *out_len)
{
    size_t pos = 0, emitted = 0, pending = 0;
    int hit = 0;
    for (size_t c = 0; c < n_chunks && !hit; c++) {
        size_t e;
        hit = engine_stop_push(st, text + pos, chunks[c], &e);
        pending += chunks[c];
        assert_true(e <= pending);
        /* the emitted bytes are the start of the pending text */
        memcpy(out + emitted, text + emitted, e);
        emitted += e;
        pending -= e;
        assert_true(emitted <= limit);
        pos += chunks[c];
        if (!hit)
            assert_int_equal(engine_stop_pending(st), pending);
    }
    if (!hit) {
        size_t rest = engine_stop_pending(st);
        memcpy(out + emitted, text + emitted, rest);
        emitted += rest;
    }
    *out_len = emitted;
    return hit;
}

static struct engine_stop *new_stop(const char *const *stops, size_t n)
{
    struct engine_stop *st = NULL;
    struct err_detail err = {0};
    assert_int_equal(engine_stop_init(&st, stops, n, &err), ST_OK);
    return st;
}

static void test_stop_basic(void **state)
{
    const char *stops[] = {"END", "\n\n", "ab"};
    char out[64];
    size_t n;

    /* stop inside one push */
    struct engine_stop *st = new_stop(stops, 3);
    size_t e;
    assert_int_equal(engine_stop_push(st, "hello END world", 15, &e), 1);
    assert_int_equal(e, 6);
    assert_int_equal(engine_stop_matched(st), 0);
    assert_int_equal(engine_stop_push(st, "more", 4, &e), 1); /* finished stays finished */
    assert_int_equal(e, 0);
    engine_stop_free(st);

    /* spanning three pushes, with the held-back tail released late */
    st = new_stop(stops, 3);
    assert_int_equal(engine_stop_push(st, "xyE", 3, &e), 0);
    assert_int_equal(e, 2); /* "E" held */
    assert_int_equal(engine_stop_push(st, "N", 1, &e), 0);
    assert_int_equal(e, 0); /* "EN" held */
    assert_int_equal(engine_stop_push(st, "D!", 2, &e), 1);
    assert_int_equal(e, 0);
    engine_stop_free(st);

    /* a held prefix that turns out not to be a stop is released */
    st = new_stop(stops, 3);
    assert_int_equal(engine_stop_push(st, "EN", 2, &e), 0);
    assert_int_equal(e, 0);
    assert_int_equal(engine_stop_push(st, "Xz", 2, &e), 0);
    assert_int_equal(e, 4);
    assert_int_equal(engine_stop_pending(st), 0);
    engine_stop_free(st);

    /* overlapping prefix: "ab" in "aab" */
    st = new_stop(stops, 3);
    assert_int_equal(engine_stop_push(st, "a", 1, &e), 0);
    assert_int_equal(e, 0);
    assert_int_equal(engine_stop_push(st, "a", 1, &e), 0);
    assert_int_equal(e, 1); /* the first "a" can no longer start "ab" */
    assert_int_equal(engine_stop_push(st, "b", 1, &e), 1);
    assert_int_equal(e, 0); /* pending "a"+"b" is the stop: only the first "a" came out */
    engine_stop_free(st);

    /* no false match */
    st = new_stop(stops, 3);
    const char *text = "EN D E\nN\n a b ENDa\n";
    size_t ch[1] = {strlen(text) - 5}; /* stop before "ENDa" */
    assert_int_equal(feed(st, text, ch, 1, ch[0], out, &n), 0);
    assert_int_equal(n, ch[0]);
    assert_memory_equal(out, text, n);
    engine_stop_free(st);

    /* n == 0: never matches, never holds */
    st = new_stop(NULL, 0);
    assert_int_equal(engine_stop_push(st, "anything", 8, &e), 0);
    assert_int_equal(e, 8);
    engine_stop_free(st);

    /* invalid stops */
    struct err_detail err = {0};
    const char *empty[] = {"ok", ""};
    st = (struct engine_stop *)1;
    assert_int_equal(engine_stop_init(&st, empty, 2, &err), ST_ERR_INVALID_ARG);
    assert_null(st);
    char *big = malloc(ENGINE_STOP_MAX_LEN + 2);
    memset(big, 'x', ENGINE_STOP_MAX_LEN + 1);
    big[ENGINE_STOP_MAX_LEN + 1] = 0;
    const char *toolong[] = {big};
    assert_int_equal(engine_stop_init(&st, toolong, 1, &err), ST_ERR_INVALID_ARG);
    free(big);
    engine_stop_free(NULL);
}

/* Overlaps between stop strings: the first-ending occurrence wins, the longest on a tie. */
static void test_stop_overlaps(void **state)
{
    size_t e;
    const char *s1[] = {"abcd", "bc"};
    struct engine_stop *st = new_stop(s1, 2);
    assert_int_equal(engine_stop_push(st, "xabcd", 5, &e), 1);
    assert_int_equal(e, 2); /* "bc" ends first: emit "xa" */
    assert_int_equal(engine_stop_matched(st), 1);
    engine_stop_free(st);

    const char *s2[] = {"c", "abc"};
    st = new_stop(s2, 2);
    assert_int_equal(engine_stop_push(st, "xab", 3, &e), 0);
    assert_int_equal(e, 1);
    assert_int_equal(engine_stop_push(st, "c", 1, &e), 1);
    assert_int_equal(e, 0); /* both end at 'c'; the longer "abc" wins */
    assert_int_equal(engine_stop_matched(st), 1);
    engine_stop_free(st);

    const char *s3[] = {"aaab"};
    st = new_stop(s3, 1);
    assert_int_equal(engine_stop_push(st, "aaaa", 4, &e), 0);
    assert_int_equal(e, 1); /* "aaa" could still start "aaab" */
    assert_int_equal(engine_stop_push(st, "ab", 2, &e), 1);
    assert_int_equal(e, 1); /* pending "aaa"+"ab": stop starts at pending offset 1 */
    engine_stop_free(st);
}

/* Earliest-ending occurrence by brute force: returns the emitted length (text before the
 * match) or len when nothing matches. */
static size_t ref_stop(const char *text, size_t len, const char *const *stops, size_t n)
{
    for (size_t end = 1; end <= len; end++) {
        size_t best = 0;
        for (size_t k = 0; k < n; k++) {
            size_t l = strlen(stops[k]);
            if (l <= end && l > best && memcmp(text + end - l, stops[k], l) == 0)
                best = l;
        }
        if (best)
            return end - best;
    }
    return len;
}

/* Random texts over a tiny alphabet, random stop sets, random chunkings: the emitted text
 * equals the brute-force answer whatever the chunking, and never contains stop text. */
static void test_stop_random_chunking(void **state)
{
    struct engine_rng r;
    engine_rng_seed(&r, 99, "stop", 4);
    char text[256], out[256], stopbuf[4][8];
    const char *stops[4];
    size_t chunks[256];
    for (int trial = 0; trial < 3000; trial++) {
        size_t n_stops = 1 + engine_rng_next(&r) % 4;
        for (size_t k = 0; k < n_stops; k++) {
            size_t l = 1 + engine_rng_next(&r) % 6;
            for (size_t i = 0; i < l; i++)
                stopbuf[k][i] = (char)('a' + engine_rng_next(&r) % 3);
            stopbuf[k][l] = 0;
            stops[k] = stopbuf[k];
        }
        size_t len = engine_rng_next(&r) % 200;
        for (size_t i = 0; i < len; i++)
            text[i] = (char)('a' + engine_rng_next(&r) % 4);
        size_t want = ref_stop(text, len, stops, n_stops);
        for (int split = 0; split < 3; split++) {
            size_t nc = 0, pos = 0;
            while (pos < len) {
                size_t c = split == 0 ? 1 : 1 + engine_rng_next(&r) % (split == 1 ? 5 : 40);
                if (c > len - pos)
                    c = len - pos;
                if (engine_rng_next(&r) % 10 == 0)
                    chunks[nc++] = 0; /* empty pushes are harmless */
                chunks[nc++] = c;
                pos += c;
            }
            struct engine_stop *st = new_stop(stops, n_stops);
            size_t got;
            int hit = feed(st, text, chunks, nc, want, out, &got);
            assert_int_equal(hit, want < len);
            assert_int_equal(got, want);
            assert_memory_equal(out, text, got);
            engine_stop_free(st);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stop_basic),
        cmocka_unit_test(test_stop_overlaps),
        cmocka_unit_test(test_stop_random_chunking),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
