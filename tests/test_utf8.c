/* Unit tests for common/utf8: both ends of every row of Unicode Table 3-7 and the bytes just
 * outside them, overlongs, surrogates, values above U+10FFFF, bad leads, missing and truncated
 * continuations with the exact error kind and text, prefix detection for streams, every scalar
 * value round-tripping, and all lead/second-byte pairs against an independent oracle. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/utf8.h"
#include "tests/test_util.h"

/* One decode case: bytes, how many are readable, expected length (0 = error) and result. */
struct dcase {
    const char *s;     /* the bytes */
    size_t n;          /* bytes readable */
    size_t len;        /* expected return: 1..4, or 0 for an error */
    uint32_t cp;       /* expected code point when len > 0 */
    enum utf8_err why; /* expected reason when len is 0 */
};

static void check_cases(const struct dcase *t, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        uint32_t cp = 0xFFFFFFFFu;
        enum utf8_err why = UTF8_OK;
        size_t k = utf8_decode((const unsigned char *)t[i].s, t[i].n, &cp, &why);
        if (k != t[i].len || (k && cp != t[i].cp) || (!k && why != t[i].why))
            fail_msg("case %zu: got len %zu cp U+%04X why %d (%s), want len %zu cp U+%04X why %d",
                     i, k, (unsigned)cp, (int)why, utf8_err_str(why), t[i].len, (unsigned)t[i].cp,
                     (int)t[i].why);
        /* the NULL-output form gives the same length */
        assert_int_equal(utf8_decode((const unsigned char *)t[i].s, t[i].n, NULL, NULL), k);
    }
}

#define CHECK(t) check_cases(t, sizeof(t) / sizeof(t[0]))

/* Table 3-7, row by row: the first and last well-formed sequence of each row. */
static void test_table_rows(void **state)
{
    (void)state;
    static const struct dcase t[] = {
        {"\x00", 1, 1, 0x0000, UTF8_OK},
        {"\x7f", 1, 1, 0x007F, UTF8_OK},
        {"\xc2\x80", 2, 2, 0x0080, UTF8_OK},
        {"\xdf\xbf", 2, 2, 0x07FF, UTF8_OK},
        {"\xe0\xa0\x80", 3, 3, 0x0800, UTF8_OK},
        {"\xe0\xbf\xbf", 3, 3, 0x0FFF, UTF8_OK},
        {"\xe1\x80\x80", 3, 3, 0x1000, UTF8_OK},
        {"\xec\xbf\xbf", 3, 3, 0xCFFF, UTF8_OK},
        {"\xed\x80\x80", 3, 3, 0xD000, UTF8_OK},
        {"\xed\x9f\xbf", 3, 3, 0xD7FF, UTF8_OK},
        {"\xee\x80\x80", 3, 3, 0xE000, UTF8_OK},
        {"\xef\xbf\xbf", 3, 3, 0xFFFF, UTF8_OK},
        {"\xf0\x90\x80\x80", 4, 4, 0x10000, UTF8_OK},
        {"\xf0\xbf\xbf\xbf", 4, 4, 0x3FFFF, UTF8_OK},
        {"\xf1\x80\x80\x80", 4, 4, 0x40000, UTF8_OK},
        {"\xf3\xbf\xbf\xbf", 4, 4, 0xFFFFF, UTF8_OK},
        {"\xf4\x80\x80\x80", 4, 4, 0x100000, UTF8_OK},
        {"\xf4\x8f\xbf\xbf", 4, 4, 0x10FFFF, UTF8_OK},
        /* more bytes readable than the character needs: only its own are used */
        {"A\x80", 2, 1, 'A', UTF8_OK},
        {"\xc3\xa9\xff", 3, 2, 0xE9, UTF8_OK},
        {"\xe2\x82\xac\x80", 4, 3, 0x20AC, UTF8_OK},
        /* the second byte one step outside each restricted range */
        {"\xe0\x9f\xbf", 3, 0, 0, UTF8_OVERLONG},
        {"\xed\xa0\x80", 3, 0, 0, UTF8_SURROGATE},
        {"\xf0\x8f\xbf\xbf", 4, 0, 0, UTF8_OVERLONG},
        {"\xf4\x90\x80\x80", 4, 0, 0, UTF8_TOO_LARGE},
        /* rows whose second byte is 80..BF: just below and above */
        {"\xc2\x7f", 2, 0, 0, UTF8_BAD_CONT},
        {"\xdf\xc0", 2, 0, 0, UTF8_BAD_CONT},
        {"\xe1\x7f\x80", 3, 0, 0, UTF8_BAD_CONT},
        {"\xec\xc0\x80", 3, 0, 0, UTF8_BAD_CONT},
        {"\xf1\x7f\x80\x80", 4, 0, 0, UTF8_BAD_CONT},
        {"\xf3\xc0\x80\x80", 4, 0, 0, UTF8_BAD_CONT},
        /* later bytes are 80..BF in every row */
        {"\xe0\xa0\x7f", 3, 0, 0, UTF8_BAD_CONT},
        {"\xe0\xa0\xc0", 3, 0, 0, UTF8_BAD_CONT},
        {"\xf4\x80\x80\x7f", 4, 0, 0, UTF8_BAD_CONT},
        {"\xf4\x80\xc0\x80", 4, 0, 0, UTF8_BAD_CONT},
    };
    CHECK(t);
}

static void test_overlong(void **state)
{
    (void)state;
    static const struct dcase t[] = {
        {"\xc0\x80", 2, 0, 0, UTF8_OVERLONG},         /* U+0000 in two bytes */
        {"\xc0\xaf", 2, 0, 0, UTF8_OVERLONG},         /* '/' */
        {"\xc1\xbf", 2, 0, 0, UTF8_OVERLONG},         /* U+007F */
        {"\xe0\x80\x80", 3, 0, 0, UTF8_OVERLONG},     /* U+0000 in three bytes */
        {"\xe0\x80\xaf", 3, 0, 0, UTF8_OVERLONG},     /* '/' */
        {"\xe0\x9f\xbf", 3, 0, 0, UTF8_OVERLONG},     /* U+07FF in three bytes */
        {"\xf0\x80\x80\x80", 4, 0, 0, UTF8_OVERLONG}, /* U+0000 in four bytes */
        {"\xf0\x80\x80\xaf", 4, 0, 0, UTF8_OVERLONG}, /* '/' */
        {"\xf0\x8f\xbf\xbf", 4, 0, 0, UTF8_OVERLONG}, /* U+FFFF in four bytes */
    };
    CHECK(t);
}

static void test_surrogate(void **state)
{
    (void)state;
    static const struct dcase t[] = {
        {"\xed\xa0\x80", 3, 0, 0, UTF8_SURROGATE}, /* U+D800 */
        {"\xed\xad\xbf", 3, 0, 0, UTF8_SURROGATE}, /* U+DB7F */
        {"\xed\xaf\xbf", 3, 0, 0, UTF8_SURROGATE}, /* U+DBFF */
        {"\xed\xb0\x80", 3, 0, 0, UTF8_SURROGATE}, /* U+DC00 */
        {"\xed\xbf\xbf", 3, 0, 0, UTF8_SURROGATE}, /* U+DFFF */
        /* a CESU-8 pair: the first half is refused */
        {"\xed\xa0\xbd\xed\xb8\x80", 6, 0, 0, UTF8_SURROGATE},
        /* the neighbours are fine */
        {"\xed\x9f\xbf", 3, 3, 0xD7FF, UTF8_OK},
        {"\xee\x80\x80", 3, 3, 0xE000, UTF8_OK},
    };
    CHECK(t);
}

static void test_too_large(void **state)
{
    (void)state;
    static const struct dcase t[] = {
        {"\xf4\x90\x80\x80", 4, 0, 0, UTF8_TOO_LARGE}, /* U+110000 */
        {"\xf4\xbf\xbf\xbf", 4, 0, 0, UTF8_TOO_LARGE}, /* U+13FFFF */
        {"\xf5\x80\x80\x80", 4, 0, 0, UTF8_TOO_LARGE}, /* U+140000 */
        {"\xf7\xbf\xbf\xbf", 4, 0, 0, UTF8_TOO_LARGE}, /* U+1FFFFF */
        /* five- and six-byte forms and FE/FF start nothing */
        {"\xf8\x88\x80\x80\x80", 5, 0, 0, UTF8_BAD_LEAD},
        {"\xfb\xbf\xbf\xbf\xbf", 5, 0, 0, UTF8_BAD_LEAD},
        {"\xfc\x84\x80\x80\x80\x80", 6, 0, 0, UTF8_BAD_LEAD},
        {"\xfd\xbf\xbf\xbf\xbf\xbf", 6, 0, 0, UTF8_BAD_LEAD},
        {"\xfe", 1, 0, 0, UTF8_BAD_LEAD},
        {"\xff", 1, 0, 0, UTF8_BAD_LEAD},
    };
    CHECK(t);
}

/* The reason is the first problem reading left to right: structure before value. */
static void test_truncated_and_bad_cont(void **state)
{
    (void)state;
    static const struct dcase t[] = {
        {"\xc2", 1, 0, 0, UTF8_TRUNCATED},
        {"\xe2", 1, 0, 0, UTF8_TRUNCATED},
        {"\xe2\x82", 2, 0, 0, UTF8_TRUNCATED},
        {"\xf0", 1, 0, 0, UTF8_TRUNCATED},
        {"\xf0\x9f", 2, 0, 0, UTF8_TRUNCATED},
        {"\xf0\x9f\x98", 3, 0, 0, UTF8_TRUNCATED},
        /* cut off before the value is known: truncated, though no completion could be valid */
        {"\xc0", 1, 0, 0, UTF8_TRUNCATED},
        {"\xe0\x80", 2, 0, 0, UTF8_TRUNCATED},
        {"\xed\xa0", 2, 0, 0, UTF8_TRUNCATED},
        {"\xf4\x90\x80", 3, 0, 0, UTF8_TRUNCATED},
        {"\xf5", 1, 0, 0, UTF8_TRUNCATED},
        /* a non-continuation byte inside the character */
        {"\xc3\x41", 2, 0, 0, UTF8_BAD_CONT},
        {"\xe2\x28\xa1", 3, 0, 0, UTF8_BAD_CONT},
        {"\xe2\x82\x28", 3, 0, 0, UTF8_BAD_CONT},
        {"\xe2\x41", 2, 0, 0, UTF8_BAD_CONT}, /* before the data ends */
        {"\xf0\x90\x80\x41", 4, 0, 0, UTF8_BAD_CONT},
        {"\xf0\x90\xc3\xa9", 4, 0, 0, UTF8_BAD_CONT},
        {"\xe0\x80\x41", 3, 0, 0, UTF8_BAD_CONT}, /* overlong second byte, but bad third first */
        {"\xc0\x41", 2, 0, 0, UTF8_BAD_CONT},
        /* continuation bytes where a character must start */
        {"\x80", 1, 0, 0, UTF8_BAD_LEAD},
        {"\xbf\x80", 2, 0, 0, UTF8_BAD_LEAD},
    };
    CHECK(t);
    for (unsigned b = 0x80; b <= 0xBF; b++) {
        unsigned char c = (unsigned char)b;
        enum utf8_err why = UTF8_OK;
        assert_int_equal(utf8_decode(&c, 1, NULL, &why), 0);
        assert_int_equal(why, UTF8_BAD_LEAD);
    }
}

/* The cases tests/test_jobs.c held for job_utf8_decode before it moved here. */
static void test_jobs_cases(void **state)
{
    (void)state;
    static const struct dcase t[] = {
        {"A", 1, 1, 'A', UTF8_OK},
        {"\xc3\xa9", 2, 2, 0xE9, UTF8_OK},
        {"\xf4\x8f\xbf\xbf", 4, 4, 0x10FFFF, UTF8_OK},
        {"\x80", 1, 0, 0, UTF8_BAD_LEAD},
        {"\xf8\x88\x80\x80\x80", 5, 0, 0, UTF8_BAD_LEAD},
        {"\xc1\xbf", 2, 0, 0, UTF8_OVERLONG},
        {"\xe0\x9f\xbf", 3, 0, 0, UTF8_OVERLONG},
        {"\xf0\x8f\xbf\xbf", 4, 0, 0, UTF8_OVERLONG},
        {"\xed\xbf\xbf", 3, 0, 0, UTF8_SURROGATE},
        {"\xf4\x90\x80\x80", 4, 0, 0, UTF8_TOO_LARGE},
        {"\xe2\x82", 2, 0, 0, UTF8_TRUNCATED},
        {"\xe2\x28\xa1", 3, 0, 0, UTF8_BAD_CONT},
    };
    CHECK(t);
}

/* Request-line error messages quote these texts: they must not change. */
static void test_err_str(void **state)
{
    (void)state;
    assert_string_equal(utf8_err_str(UTF8_OK), "ok");
    assert_string_equal(utf8_err_str(UTF8_BAD_LEAD),
                        "unexpected byte where a character must start");
    assert_string_equal(utf8_err_str(UTF8_TRUNCATED), "truncated character");
    assert_string_equal(utf8_err_str(UTF8_BAD_CONT), "missing continuation byte");
    assert_string_equal(utf8_err_str(UTF8_OVERLONG), "overlong encoding");
    assert_string_equal(utf8_err_str(UTF8_SURROGATE), "encoded surrogate");
    assert_string_equal(utf8_err_str(UTF8_TOO_LARGE), "code point above U+10FFFF");
    assert_string_equal(utf8_err_str((enum utf8_err)99), "invalid UTF-8");
}

static int prefix_of(const char *s, size_t n)
{
    return utf8_is_prefix((const unsigned char *)s, n);
}

static void test_prefix(void **state)
{
    (void)state;
    /* every proper prefix of a well-formed sequence, at each row's ends */
    static const char *const good[] = {
        "\xc2\x80",         "\xdf\xbf",         "\xe0\xa0\x80",     "\xe0\xbf\xbf",
        "\xe1\x80\x80",     "\xec\xbf\xbf",     "\xed\x80\x80",     "\xed\x9f\xbf",
        "\xee\x80\x80",     "\xef\xbf\xbf",     "\xf0\x90\x80\x80", "\xf0\xbf\xbf\xbf",
        "\xf1\x80\x80\x80", "\xf3\xbf\xbf\xbf", "\xf4\x80\x80\x80", "\xf4\x8f\xbf\xbf",
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        size_t len = strlen(good[i]);
        for (size_t n = 1; n < len; n++)
            assert_true(prefix_of(good[i], n));
        assert_false(prefix_of(good[i], len)); /* complete: not a proper prefix */
    }
    assert_false(prefix_of("A", 1));
    assert_false(prefix_of("\x80", 1));
    assert_false(prefix_of("\xbf", 1));
    assert_false(prefix_of("\xc0", 1));
    assert_false(prefix_of("\xc1", 1));
    assert_false(prefix_of("\xf5", 1));
    assert_false(prefix_of("\xf7", 1));
    assert_false(prefix_of("\xf8", 1));
    assert_false(prefix_of("\xff", 1));
    assert_false(prefix_of("\xe0\x80", 2)); /* overlong whatever follows */
    assert_false(prefix_of("\xe0\x9f", 2));
    assert_false(prefix_of("\xed\xa0", 2));     /* surrogate */
    assert_false(prefix_of("\xf0\x8f", 2));     /* overlong */
    assert_false(prefix_of("\xf4\x90", 2));     /* above U+10FFFF */
    assert_false(prefix_of("\xe2\x41", 2));     /* not a continuation */
    assert_false(prefix_of("\xf0\x90\x41", 3)); /* the third byte too */
    assert_false(prefix_of("\xf0\x90\xc2", 3));
}

/* ---- oracles ----------------------------------------------------------------------------- */

/* The decoder written the other way round: read the bit pattern, then refuse the value
 * (smaller than the length's minimum, surrogate, above U+10FFFF). */
static size_t oracle_decode(const unsigned char *p, size_t n, uint32_t *cp, enum utf8_err *why)
{
    unsigned char b0 = p[0];
    size_t need;
    uint32_t c, min;
    if (b0 < 0x80) {
        *cp = b0;
        return 1;
    }
    if (b0 >= 0xC0 && b0 < 0xE0)
        need = 2, c = b0 & 0x1F, min = 0x80;
    else if (b0 >= 0xE0 && b0 < 0xF0)
        need = 3, c = b0 & 0x0F, min = 0x800;
    else if (b0 >= 0xF0 && b0 < 0xF8)
        need = 4, c = b0 & 0x07, min = 0x10000;
    else {
        *why = UTF8_BAD_LEAD;
        return 0;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *why = UTF8_TRUNCATED;
            return 0;
        }
        if ((p[i] & 0xC0) != 0x80) {
            *why = UTF8_BAD_CONT;
            return 0;
        }
        c = (c << 6) | (p[i] & 0x3F);
    }
    if (c < min)
        *why = UTF8_OVERLONG;
    else if (c >= 0xD800 && c <= 0xDFFF)
        *why = UTF8_SURROGATE;
    else if (c > 0x10FFFF)
        *why = UTF8_TOO_LARGE;
    else {
        *cp = c;
        return need;
    }
    return 0;
}

/* Proper prefix by search: some continuation bytes complete p[0..n) into a valid character.
 * Only the second byte is ever restricted beyond 80..BF, so 0x80 stands in for the rest. */
static int oracle_prefix(const unsigned char *p, size_t n)
{
    unsigned char q[4];
    uint32_t cp;
    enum utf8_err why;
    if (n >= 4)
        return 0;
    memcpy(q, p, n);
    for (unsigned x = 0x80; x <= 0xBF; x++) {
        for (size_t i = n; i < 4; i++)
            q[i] = (unsigned char)(i == n ? x : 0x80);
        for (size_t m = n + 1; m <= 4; m++) {
            size_t k = oracle_decode(q, m, &cp, &why);
            if (k > n) /* a valid character longer than what we have */
                return 1;
            if (k || why != UTF8_TRUNCATED)
                break;
        }
    }
    return 0;
}

/* Every lead byte with every second byte, third and fourth bytes from the values where the
 * rules change, every readable length: same length, code point and reason as the oracle, and
 * prefix detection agrees with the search. */
static void test_against_oracle(void **state)
{
    (void)state;
    static const unsigned char later[] = {0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90,
                                          0x9F, 0xA0, 0xBF, 0xC0, 0xF4, 0xFF};
    const size_t nl = sizeof(later);
    size_t checked = 0;
    for (unsigned b0 = 0; b0 < 256; b0++) {
        for (unsigned b1 = 0; b1 < 256; b1++) {
            for (size_t i2 = 0; i2 < nl; i2++) {
                for (size_t i3 = 0; i3 < nl; i3++) {
                    unsigned char p[4] = {(unsigned char)b0, (unsigned char)b1, later[i2],
                                          later[i3]};
                    for (size_t n = 1; n <= 4; n++) {
                        uint32_t cp = 0, ocp = 0;
                        enum utf8_err why = UTF8_OK, owhy = UTF8_OK;
                        size_t k = utf8_decode(p, n, &cp, &why);
                        size_t ok = oracle_decode(p, n, &ocp, &owhy);
                        if (k != ok || (k && cp != ocp) || (!k && why != owhy))
                            fail_msg("%02X %02X %02X %02X n=%zu: len %zu/%zu cp %X/%X why %d/%d",
                                     p[0], p[1], p[2], p[3], n, k, ok, (unsigned)cp, (unsigned)ocp,
                                     (int)why, (int)owhy);
                        /* the prefix search only depends on the first n bytes: skip repeats */
                        if ((n < 3 && i2) || (n < 4 && i3))
                            continue;
                        if (utf8_is_prefix(p, n) != oracle_prefix(p, n))
                            fail_msg("%02X %02X %02X %02X n=%zu: is_prefix %d, oracle %d", p[0],
                                     p[1], p[2], p[3], n, utf8_is_prefix(p, n),
                                     oracle_prefix(p, n));
                        checked++;
                    }
                }
            }
        }
    }
    assert_true(checked > 256 * 256);
}

/* Every scalar value, encoded by hand, decodes back with the right length; each surrogate
 * encoded the same way is refused. */
static void test_every_scalar(void **state)
{
    (void)state;
    for (uint32_t c = 0; c <= 0x10FFFF; c++) {
        unsigned char b[4];
        size_t len;
        if (c < 0x80) {
            b[0] = (unsigned char)c;
            len = 1;
        } else if (c < 0x800) {
            b[0] = (unsigned char)(0xC0 | (c >> 6));
            b[1] = (unsigned char)(0x80 | (c & 0x3F));
            len = 2;
        } else if (c < 0x10000) {
            b[0] = (unsigned char)(0xE0 | (c >> 12));
            b[1] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
            b[2] = (unsigned char)(0x80 | (c & 0x3F));
            len = 3;
        } else {
            b[0] = (unsigned char)(0xF0 | (c >> 18));
            b[1] = (unsigned char)(0x80 | ((c >> 12) & 0x3F));
            b[2] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
            b[3] = (unsigned char)(0x80 | (c & 0x3F));
            len = 4;
        }
        uint32_t cp = 0;
        enum utf8_err why = UTF8_OK;
        size_t k = utf8_decode(b, len, &cp, &why);
        if (c >= 0xD800 && c <= 0xDFFF) {
            if (k != 0 || why != UTF8_SURROGATE)
                fail_msg("U+%04X: len %zu why %d", (unsigned)c, k, (int)why);
        } else if (k != len || cp != c) {
            fail_msg("U+%04X: len %zu cp U+%04X", (unsigned)c, k, (unsigned)cp);
        }
        for (size_t n = 1; n < len; n++)
            if (utf8_is_prefix(b, n) != !(c >= 0xD800 && c <= 0xDFFF && n >= 2))
                fail_msg("U+%04X: is_prefix(%zu) wrong", (unsigned)c, n);
    }
}

static size_t unhex(const char *h, size_t n, unsigned char *out)
{
    for (size_t i = 0; i + 1 < n; i += 2) {
        unsigned v;
        if (sscanf(h + i, "%2x", &v) != 1)
            fail_msg("bad hex in the fixture");
        out[i / 2] = (unsigned char)v;
    }
    return n / 2;
}

/* Decoding with one U+FFFD per maximal subpart (utf8_decode, else utf8_bad_len bytes) equals
 * Python's bytes.decode("utf-8", errors="replace") on 400 random mixes of well-formed, cut-off
 * and ill-formed sequences (tests/fixtures/utf8_lossy_ref.txt, tools/gen_utf8_lossy.py); and
 * utf8_bad_len on hand-picked cases. */
static void test_bad_len(void **state)
{
    (void)state;
    static const struct {
        const char *s;
        size_t n, want;
    } c[] = {
        {"\xe2\x82", 2, 2},
        {"\xe2\x82"
         "A",
         3, 2},
        {"\xf0\x9f\x98", 3, 3},
        {"\xf0\x9f\x98"
         "A",
         4, 3},
        {"\xed\xa0\x80", 3, 1},
        {"\xc0\xaf", 2, 1},
        {"\xf4\x90\x80\x80", 4, 1},
        {"\x80", 1, 1},
        {"\xff\xff", 2, 1},
        {"\xe0\x80", 2, 1},
        {"\xe0\xa0", 2, 2},
        {"\xf4\x8f\xbf", 3, 3},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++)
        if (utf8_bad_len((const unsigned char *)c[i].s, c[i].n) != c[i].want)
            fail_msg("case %zu: %zu, want %zu", i,
                     utf8_bad_len((const unsigned char *)c[i].s, c[i].n), c[i].want);
    size_t len;
    char *text = test_read_file("tests/fixtures/utf8_lossy_ref.txt", &len);
    assert_non_null(text);
    int cases = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#')
            continue;
        char *sp = strchr(line, ' ');
        assert_non_null(sp);
        unsigned char in[256], want[512], got[1024];
        size_t n = unhex(line, (size_t)(sp - line), in),
               n_want = unhex(sp + 1, strlen(sp + 1), want);
        size_t o = 0;
        for (size_t i = 0; i < n;) {
            size_t k = utf8_decode(in + i, n - i, NULL, NULL);
            if (k) {
                memcpy(got + o, in + i, k);
                o += k;
                i += k;
            } else {
                memcpy(got + o, "\xef\xbf\xbd", 3);
                o += 3;
                i += utf8_bad_len(in + i, n - i);
            }
        }
        if (o != n_want || memcmp(got, want, o))
            fail_msg("fixture line %s: decoded differently from Python", line);
        cases++;
    }
    free(text);
    assert_int_equal(cases, 400);
}

/* log_printable: users' text on a terminal (log lines, status) carries no control characters:
 * C0 (but tab), DEL and C1 (U+0080..U+009F in UTF-8) are escaped, everything else kept. */
static void test_log_printable(void **state)
{
    (void)state;
    char buf[256];
    assert_string_equal(log_printable("a\tb é ✓", buf, sizeof(buf)), "a\tb é ✓");
    assert_string_equal(log_printable("x\x1b]0;T\x07\x1b[2J\ny\r\x7f", buf, sizeof(buf)),
                        "x\\x1b]0;T\\x07\\x1b[2J\\x0ay\\x0d\\x7f");
    assert_string_equal(log_printable("\xc2\x9b"
                                      "2J \xc2\xa0",
                                      buf, sizeof(buf)),
                        "\\u009b2J \xc2\xa0");
    /* bytes of no character (a raw C1 byte is CSI to a Latin-1 terminal) are escaped too:
     * the output is always UTF-8 */
    assert_string_equal(log_printable("a\x9b"
                                      "2J\xff\xe2\x82",
                                      buf, sizeof(buf)),
                        "a\\x9b2J\\xff\\xe2\\x82");
    /* a small buffer: cut, terminated, never a half escape */
    char small[9];
    log_printable("\x1b\x1b\x1b", small, sizeof(small));
    assert_string_equal(small, "\\x1b");
    log_printable("abcdefghijkl", small, sizeof(small));
    assert_true(strlen(small) < sizeof(small));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_log_printable), cmocka_unit_test(test_table_rows),
        cmocka_unit_test(test_overlong),      cmocka_unit_test(test_surrogate),
        cmocka_unit_test(test_too_large),     cmocka_unit_test(test_truncated_and_bad_cont),
        cmocka_unit_test(test_jobs_cases),    cmocka_unit_test(test_err_str),
        cmocka_unit_test(test_prefix),        cmocka_unit_test(test_against_oracle),
        cmocka_unit_test(test_every_scalar),  cmocka_unit_test(test_bad_len),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
