/* Strict UTF-8 decoding (see common/utf8.h), written around Unicode Table 3-7. */
#include "common/utf8.h"

#include <assert.h>
#include <string.h>

/* One row of Unicode Table 3-7 (well-formed UTF-8 byte sequences): lead bytes lead_lo..lead_hi
 * start sequences of len bytes whose second byte lies in second_lo..second_hi; every later
 * byte is 0x80..0xBF. */
struct utf8_row {
    unsigned char lead_lo, lead_hi;     /* range of the first byte */
    unsigned char len;                  /* bytes in the sequence */
    unsigned char second_lo, second_hi; /* range of the second byte (unused when len is 1) */
};

static const struct utf8_row utf8_table[] = {
    {0x00, 0x7F, 1, 0x00, 0x00}, /* U+0000..U+007F */
    {0xC2, 0xDF, 2, 0x80, 0xBF}, /* U+0080..U+07FF */
    {0xE0, 0xE0, 3, 0xA0, 0xBF}, /* U+0800..U+0FFF */
    {0xE1, 0xEC, 3, 0x80, 0xBF}, /* U+1000..U+CFFF */
    {0xED, 0xED, 3, 0x80, 0x9F}, /* U+D000..U+D7FF */
    {0xEE, 0xEF, 3, 0x80, 0xBF}, /* U+E000..U+FFFF */
    {0xF0, 0xF0, 4, 0x90, 0xBF}, /* U+10000..U+3FFFF */
    {0xF1, 0xF3, 4, 0x80, 0xBF}, /* U+40000..U+FFFFF */
    {0xF4, 0xF4, 4, 0x80, 0x8F}, /* U+100000..U+10FFFF */
};

/* The Table 3-7 row of lead byte b, or NULL when b starts no well-formed sequence. */
static const struct utf8_row *utf8_row_of(unsigned char b)
{
    for (size_t i = 0; i < sizeof(utf8_table) / sizeof(utf8_table[0]); i++)
        if (b >= utf8_table[i].lead_lo && b <= utf8_table[i].lead_hi)
            return &utf8_table[i];
    return NULL;
}

/* Length that b's bit pattern announces (0xxxxxxx 1, 110xxxxx 2, 1110xxxx 3, 11110xxx 4), or 0
 * for a continuation byte or 0xF8..0xFF. C0, C1 and F5..F7 announce a length too: they are
 * read as a whole sequence and then refused for its value. */
static size_t utf8_pattern_len(unsigned char b)
{
    if (b < 0x80)
        return 1;
    if (b < 0xC0)
        return 0;
    if (b < 0xE0)
        return 2;
    if (b < 0xF0)
        return 3;
    if (b < 0xF8)
        return 4;
    return 0;
}

/* Why a structurally complete sequence led by b is outside Table 3-7 (no row for b, or its
 * second byte out of the row's range): the value it encodes is too small for its length, a
 * surrogate, or above U+10FFFF. */
static enum utf8_err utf8_value_err(unsigned char b)
{
    if (b <= 0xE0 || b == 0xF0) /* C0, C1; E0 80..9F; F0 80..8F */
        return UTF8_OVERLONG;
    if (b == 0xED) /* ED A0..BF */
        return UTF8_SURROGATE;
    return UTF8_TOO_LARGE; /* F4 90..BF; F5..F7 */
}

static size_t utf8_fail(enum utf8_err *why, enum utf8_err e)
{
    if (why)
        *why = e;
    return 0;
}

size_t utf8_decode(const unsigned char *p, size_t n, uint32_t *cp, enum utf8_err *why)
{
    assert(n >= 1);
    unsigned char b0 = p[0];
    if (b0 < 0x80) {
        if (cp)
            *cp = b0;
        return 1;
    }
    size_t len = utf8_pattern_len(b0);
    if (!len)
        return utf8_fail(why, UTF8_BAD_LEAD);
    for (size_t i = 1; i < len; i++) {
        if (i >= n)
            return utf8_fail(why, UTF8_TRUNCATED);
        if ((p[i] & 0xC0) != 0x80)
            return utf8_fail(why, UTF8_BAD_CONT);
    }
    const struct utf8_row *r = utf8_row_of(b0);
    if (!r || p[1] < r->second_lo || p[1] > r->second_hi)
        return utf8_fail(why, utf8_value_err(b0));
    uint32_t c = b0 & (0x7Fu >> len);
    for (size_t i = 1; i < len; i++)
        c = (c << 6) | (p[i] & 0x3Fu);
    if (cp)
        *cp = c;
    return len;
}

size_t utf8_bad_len(const unsigned char *p, size_t n)
{
    size_t k = 1;
    while (k < n && utf8_is_prefix(p, k + 1))
        k++;
    return k;
}

int utf8_is_prefix(const unsigned char *p, size_t n)
{
    assert(n >= 1);
    const struct utf8_row *r = utf8_row_of(p[0]);
    if (!r || n >= r->len)
        return 0;
    if (n >= 2 && (p[1] < r->second_lo || p[1] > r->second_hi))
        return 0;
    for (size_t i = 2; i < n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    return 1;
}

const char *utf8_err_str(enum utf8_err e)
{
    switch (e) {
    case UTF8_OK:
        return "ok";
    case UTF8_BAD_LEAD:
        return "unexpected byte where a character must start";
    case UTF8_TRUNCATED:
        return "truncated character";
    case UTF8_BAD_CONT:
        return "missing continuation byte";
    case UTF8_OVERLONG:
        return "overlong encoding";
    case UTF8_SURROGATE:
        return "encoded surrogate";
    case UTF8_TOO_LARGE:
        return "code point above U+10FFFF";
    }
    return "invalid UTF-8";
}

void utf8_escape_bad(const char *s, char *out, size_t cap)
{
    static const char hex[] = "0123456789ABCDEF";
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s), o = 0;
    if (!cap)
        return;
    for (size_t i = 0; i < n;) {
        size_t len = utf8_decode(p + i, n - i, NULL, NULL);
        if (len) {
            if (o + len >= cap)
                break;
            memcpy(out + o, p + i, len);
            o += len;
            i += len;
            continue;
        }
        if (o + 3 >= cap)
            break;
        out[o++] = '%';
        out[o++] = hex[p[i] >> 4];
        out[o++] = hex[p[i] & 15];
        i++;
    }
    out[o] = 0;
}
