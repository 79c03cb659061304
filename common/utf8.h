/* Strict UTF-8: the one decoder every module uses (request lines, output records, the
 * tokenizer). Well-formed means Unicode Table 3-7: shortest form only, no surrogates, nothing
 * above U+10FFFF. Also tells whether a cut-off sequence could still be completed, for streams. */
#ifndef COMMON_UTF8_H
#define COMMON_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Why a byte sequence is not well-formed UTF-8. */
enum utf8_err {
    UTF8_OK = 0,    /* well-formed */
    UTF8_BAD_LEAD,  /* continuation byte or 0xF8..0xFF where a character must start */
    UTF8_TRUNCATED, /* the data ends inside a character */
    UTF8_BAD_CONT,  /* a continuation byte is missing */
    UTF8_OVERLONG,  /* encoded in more bytes than needed (0xC0, 0xC1, 0xE0 0x80.. etc.) */
    UTF8_SURROGATE, /* U+D800..U+DFFF */
    UTF8_TOO_LARGE, /* above U+10FFFF */
};

/* Decode the character starting at p (n >= 1 bytes readable). Returns its length 1..4 and
 * stores the code point in *cp, or returns 0 and stores the reason in *why. cp and why may be
 * NULL. The reason is the first problem met reading left to right: the lead byte, then each
 * continuation byte in turn (UTF8_TRUNCATED when the data ends first), and only then the value
 * (overlong, surrogate, too large). */
size_t utf8_decode(const unsigned char *p, size_t n, uint32_t *cp, enum utf8_err *why);

/* 1 when p[0..n) (n >= 1) is a proper prefix of a well-formed sequence, that is more bytes
 * could complete it (0xE2 0x82 can; 0xE0 0x80 and 0xC0 cannot); else 0. */
int utf8_is_prefix(const unsigned char *p, size_t n);

/* Where p[0..n) (n >= 1) does not start a well-formed character: how many bytes one U+FFFD
 * replaces, its maximal subpart (Unicode 3.9, "U+FFFD Substitution of Maximal Subparts"): the
 * longest prefix that more bytes could have completed, at least 1 ("\xE2\x82A" -> 2, then
 * 'A'; "\xED\xA0\x80" -> 1 each). Python's bytes.decode(errors="replace") and Rust's
 * from_utf8_lossy (Hugging Face tokenizers' decode) replace the same way. */
size_t utf8_bad_len(const unsigned char *p, size_t n);

/* s as well-formed UTF-8 in out (cap bytes, always NUL-terminated, cut at a character): each
 * byte of a sequence that is not well-formed written as "%XX" (upper-case hex), the rest as it
 * is; distinct inputs stay distinct apart from a literal "%XX". For names from outside (files,
 * archive members) that go into JSON, whose writers would turn such bytes into U+FFFD. */
void utf8_escape_bad(const char *s, char *out, size_t cap);
/* Short description of a decode error ("overlong encoding"); never NULL. */
const char *utf8_err_str(enum utf8_err e);

#endif
