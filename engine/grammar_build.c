/* Building byte grammars (engine/grammar.h): each alternative keeps its elements in its own
 * array, so the JSON pieces may make their rules while a caller's alternative is open;
 * engine_gb_finish (engine/grammar.c) flattens them by rule. */
#include "engine/grammar_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- building --------------------------------------------------------------------------- */

enum {
    J_WS,
    J_STRING,
    J_CHAR,
    J_NUMBER,
    J_INTEGER,
    J_VALUE,
    J_OBJECT,
    J_DIGITS,
    J_NAT,
    J_UNUM,
    J_UTF8
};

enum status engine_gb_new(struct engine_gb **out, struct err_detail *err)
{
    *out = calloc(1, sizeof(**out));
    if (!*out)
        return err_set(err, ST_ERR_NOMEM, "grammar: out of memory");
    (*out)->cur = -1;
    for (int i = 0; i < 11; i++)
        (*out)->json[i] = -1;
    return ST_OK;
}

void engine_gb_free(struct engine_gb *b)
{
    if (!b)
        return;
    for (int32_t i = 0; i < b->n_names; i++)
        free(b->names[i]);
    free(b->names);
    for (int32_t i = 0; i < b->n_alts; i++)
        free(b->alts[i].e);
    free(b->alts);
    free(b);
}

int32_t engine_gb_rule(struct engine_gb *b)
{
    if (b->n_rules >= ENGINE_GB_MAX_ALTS)
        b->too_big = 1; /* (ids still count on: finish refuses the grammar) */
    return b->n_rules++;
}

int engine_gb_full(const struct engine_gb *b)
{
    return b->too_big;
}

void engine_gb_name(struct engine_gb *b, int32_t rule, const char *name)
{
    if (rule < 0 || rule >= b->n_rules)
        return;
    if (rule >= b->n_names) {
        char **n = realloc(b->names, sizeof(char *) * (size_t)(rule + 1));
        if (!n)
            return; /* names only serve messages */
        for (int32_t i = b->n_names; i <= rule; i++)
            n[i] = NULL;
        b->names = n;
        b->n_names = rule + 1;
    }
    free(b->names[rule]);
    b->names[rule] = strdup(name);
}

void engine_gb_alt(struct engine_gb *b, int32_t rule)
{
    if (b->too_big || b->n_alts >= ENGINE_GB_MAX_ALTS) {
        b->too_big = 1;
        b->cur = -1;
        return;
    }
    if (b->n_alts == b->cap_alts) {
        int32_t cap = b->cap_alts ? 2 * b->cap_alts : 64;
        struct balt *a = realloc(b->alts, sizeof(*a) * (size_t)cap);
        if (!a) {
            b->oom = 1;
            b->cur = -1;
            return;
        }
        b->alts = a;
        b->cap_alts = cap;
    }
    b->alts[b->n_alts] = (struct balt){rule, NULL, 0, 0};
    b->cur = b->n_alts++;
}

static struct gelem *push_elem(struct engine_gb *b)
{
    if (b->too_big || b->n_elems >= ENGINE_GB_MAX_ELEMS) {
        b->too_big = 1;
        return NULL;
    }
    if (b->cur < 0) {
        b->oom = 1;
        return NULL;
    }
    b->n_elems++;
    struct balt *a = &b->alts[b->cur];
    if (a->n == a->cap) {
        int32_t cap = a->cap ? 2 * a->cap : 8;
        struct gelem *e = realloc(a->e, sizeof(*e) * (size_t)cap);
        if (!e) {
            b->oom = 1;
            return NULL;
        }
        a->e = e;
        a->cap = cap;
    }
    struct gelem *e = &a->e[a->n++];
    memset(e, 0, sizeof(*e));
    e->ref = -1;
    return e;
}

void engine_gb_range(struct engine_gb *b, unsigned lo, unsigned hi)
{
    struct gelem *e = push_elem(b);
    for (unsigned c = lo; e && c <= hi && c < 256; c++)
        e->set[c >> 5] |= 1u << (c & 31);
}

void engine_gb_set(struct engine_gb *b, const uint32_t set[8])
{
    struct gelem *e = push_elem(b);
    if (e)
        memcpy(e->set, set, sizeof(e->set));
}

void engine_gb_chars(struct engine_gb *b, const char *chars)
{
    struct gelem *e = push_elem(b);
    for (; e && *chars; chars++)
        e->set[(unsigned char)*chars >> 5] |= 1u << ((unsigned char)*chars & 31);
}

void engine_gb_lit(struct engine_gb *b, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        engine_gb_range(b, (unsigned char)s[i], (unsigned char)s[i]);
}

void engine_gb_ref(struct engine_gb *b, int32_t rule)
{
    struct gelem *e = push_elem(b);
    if (e)
        e->ref = rule;
}

/* ---- the JSON pieces ---- */

/* Shared rule `which`: return it when made; else make its id (r) and keep the caller's open
 * alternative (saved_) for SHARED_END to restore. */
#define SHARED_BEGIN(b, which)                                                                     \
    if ((b)->json[which] >= 0)                                                                     \
        return (b)->json[which];                                                                   \
    const int32_t saved_ = (b)->cur, r = (b)->json[which] = engine_gb_rule(b)
#define SHARED_END(b)                                                                              \
    (b)->cur = saved_;                                                                             \
    return r

int32_t engine_gb_json_ws(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_WS);
    /* "" | " " | "\n" then up to 20 of [ \t] */
    int32_t tail[21];
    for (int i = 0; i <= 20; i++)
        tail[i] = engine_gb_rule(b);
    for (int i = 0; i <= 20; i++) {
        engine_gb_alt(b, tail[i]);
        if (i < 20) {
            engine_gb_alt(b, tail[i]);
            static const uint32_t sp_tab[8] = {1u << 9, 1u << 0}; /* '\t', ' ' */
            engine_gb_set(b, sp_tab);
            engine_gb_ref(b, tail[i + 1]);
        }
    }
    engine_gb_alt(b, r);
    engine_gb_alt(b, r);
    engine_gb_lit(b, " ", 1);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "\n", 1);
    engine_gb_ref(b, tail[0]);
    SHARED_END(b);
}

int32_t engine_gb_json_string_char(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_CHAR);
    static const uint32_t ascii[8] = {0, 0xfffffffbu, 0xefffffffu, 0xffffffffu};
    engine_gb_alt(b, r); /* 0x20..0x7f but '"' (0x22) and '\\' (0x5c) */
    engine_gb_set(b, ascii);
    engine_gb_alt(b, r); /* escapes */
    engine_gb_lit(b, "\\", 1);
    static const uint32_t esc[8] = {0, 1u << 2 | 1u << 15, 1u << 28, /* " / \ */
                                    1u << 2 | 1u << 6 | 1u << 14 | 1u << 18 | 1u << 20};
    engine_gb_set(b, esc); /* b f n r t */
    /* \uXXXX: one character, so a surrogate pair (\uD8xx-\uDBxx then \uDCxx-\uDFxx) is one
     * (it counts once toward minLength/maxLength) and a lone surrogate is no character */
    static const char hex[] = "0123456789abcdefABCDEF";
    engine_gb_alt(b, r); /* U+0000..U+CFFF, U+E000..U+FFFF */
    engine_gb_lit(b, "\\u", 2);
    engine_gb_chars(b, "0123456789abcefABCEF");
    for (int i = 0; i < 3; i++)
        engine_gb_chars(b, hex);
    engine_gb_alt(b, r); /* U+D000..U+D7FF */
    engine_gb_lit(b, "\\u", 2);
    engine_gb_chars(b, "dD");
    engine_gb_chars(b, "01234567");
    engine_gb_chars(b, hex);
    engine_gb_chars(b, hex);
    engine_gb_alt(b, r); /* a surrogate pair: \\uD800-\\uDBFF then \\uDC00-\\uDFFF */
    for (int half = 0; half < 2; half++) {
        engine_gb_lit(b, "\\u", 2);
        engine_gb_chars(b, "dD");
        engine_gb_chars(b, half ? "cdefCDEF" : "89abAB");
        engine_gb_chars(b, hex);
        engine_gb_chars(b, hex);
    }
    engine_gb_alt(b, r);
    engine_gb_ref(b, engine_gb_utf8_multibyte(b));
    SHARED_END(b);
}

int32_t engine_gb_utf8_multibyte(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_UTF8);
    /* UTF-8, well formed (RFC 3629): per form, the lead byte range then the continuation
     * ranges (0 marks the end) */
    static const unsigned char forms[9][4][2] = {
        {{0xc2, 0xdf}, {0x80, 0xbf}},
        {{0xe0, 0xe0}, {0xa0, 0xbf}, {0x80, 0xbf}},
        {{0xe1, 0xec}, {0x80, 0xbf}, {0x80, 0xbf}},
        {{0xed, 0xed}, {0x80, 0x9f}, {0x80, 0xbf}},
        {{0xee, 0xef}, {0x80, 0xbf}, {0x80, 0xbf}},
        {{0xf0, 0xf0}, {0x90, 0xbf}, {0x80, 0xbf}, {0x80, 0xbf}},
        {{0xf1, 0xf3}, {0x80, 0xbf}, {0x80, 0xbf}, {0x80, 0xbf}},
        {{0xf4, 0xf4}, {0x80, 0x8f}, {0x80, 0xbf}, {0x80, 0xbf}},
    };
    for (int f = 0; forms[f][0][0]; f++) {
        engine_gb_alt(b, r);
        for (int k = 0; k < 4 && forms[f][k][0]; k++)
            engine_gb_range(b, forms[f][k][0], forms[f][k][1]);
    }
    SHARED_END(b);
}

int32_t engine_gb_json_string(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_STRING);
    int32_t ch = engine_gb_json_string_char(b), body = engine_gb_rule(b);
    engine_gb_alt(b, body); /* body ::= "" | char body */
    engine_gb_alt(b, body);
    engine_gb_ref(b, ch);
    engine_gb_ref(b, body);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "\"", 1);
    engine_gb_ref(b, body);
    engine_gb_lit(b, "\"", 1);
    SHARED_END(b);
}

int32_t engine_gb_json_digits(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_DIGITS);
    /* digits ::= [0-9] | [0-9] digits (one or more) */
    engine_gb_alt(b, r);
    engine_gb_range(b, '0', '9');
    engine_gb_alt(b, r);
    engine_gb_range(b, '0', '9');
    engine_gb_ref(b, r);
    SHARED_END(b);
}

/* "0" | [1-9] [0-9]*: a natural number without leading zeros */
static int32_t nat_rule(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_NAT);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "0", 1);
    engine_gb_alt(b, r);
    engine_gb_range(b, '1', '9');
    engine_gb_alt(b, r);
    engine_gb_range(b, '1', '9');
    engine_gb_ref(b, engine_gb_json_digits(b));
    SHARED_END(b);
}

int32_t engine_gb_json_integer(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_INTEGER);
    /* "-"? nat */
    int32_t nat = nat_rule(b);
    engine_gb_alt(b, r);
    engine_gb_ref(b, nat);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "-", 1);
    engine_gb_ref(b, nat);
    SHARED_END(b);
}

int32_t engine_gb_json_unsigned_number(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_UNUM);
    /* nat ("." digits)? ([eE] [+-]? digits)? */
    int32_t nat = nat_rule(b), digs = engine_gb_json_digits(b);
    int32_t frac = engine_gb_rule(b), exp = engine_gb_rule(b);
    engine_gb_alt(b, frac);
    engine_gb_alt(b, frac);
    engine_gb_lit(b, ".", 1);
    engine_gb_ref(b, digs);
    engine_gb_alt(b, exp);
    for (int sign = 0; sign < 2; sign++) {
        engine_gb_alt(b, exp);
        static const uint32_t e_set[8] = {0, 0, 1u << 5, 1u << 5}; /* E e */
        engine_gb_set(b, e_set);
        if (sign) {
            static const uint32_t pm[8] = {0, 1u << 11 | 1u << 13}; /* + - */
            engine_gb_set(b, pm);
        }
        engine_gb_ref(b, digs);
    }
    engine_gb_alt(b, r);
    engine_gb_ref(b, nat);
    engine_gb_ref(b, frac);
    engine_gb_ref(b, exp);
    SHARED_END(b);
}

int32_t engine_gb_json_number(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_NUMBER);
    int32_t u = engine_gb_json_unsigned_number(b);
    engine_gb_alt(b, r);
    engine_gb_ref(b, u);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "-", 1);
    engine_gb_ref(b, u);
    SHARED_END(b);
}

/* "[" ws (item (ws "," ws item)*)? ws "]" or "{" ... "}" with members string ws ":" ws value */
static void json_container(struct engine_gb *b, int32_t r, int object, int32_t value)
{
    const int32_t saved = b->cur;
    int32_t ws = engine_gb_json_ws(b), str = engine_gb_json_string(b);
    int32_t item = engine_gb_rule(b), more = engine_gb_rule(b);
    engine_gb_alt(b, item);
    if (object) {
        engine_gb_ref(b, str);
        engine_gb_ref(b, ws);
        engine_gb_lit(b, ":", 1);
        engine_gb_ref(b, ws);
    }
    engine_gb_ref(b, value);
    engine_gb_alt(b, more); /* more ::= "" | ws "," ws item more */
    engine_gb_alt(b, more);
    engine_gb_ref(b, ws);
    engine_gb_lit(b, ",", 1);
    engine_gb_ref(b, ws);
    engine_gb_ref(b, item);
    engine_gb_ref(b, more);
    engine_gb_alt(b, r);
    engine_gb_lit(b, object ? "{" : "[", 1);
    engine_gb_ref(b, ws);
    engine_gb_lit(b, object ? "}" : "]", 1);
    engine_gb_alt(b, r);
    engine_gb_lit(b, object ? "{" : "[", 1);
    engine_gb_ref(b, ws);
    engine_gb_ref(b, item);
    engine_gb_ref(b, more);
    engine_gb_ref(b, ws);
    engine_gb_lit(b, object ? "}" : "]", 1);
    b->cur = saved;
}

int32_t engine_gb_json_container(struct engine_gb *b, int object, int32_t value)
{
    int32_t r = engine_gb_rule(b);
    json_container(b, r, object, value);
    return r;
}

int32_t engine_gb_json_value(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_VALUE);
    int32_t obj = engine_gb_json_object(b), arr = engine_gb_rule(b);
    json_container(b, arr, 0, r);
    static const char *const lits[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        engine_gb_alt(b, r);
        engine_gb_lit(b, lits[i], strlen(lits[i]));
    }
    engine_gb_alt(b, r);
    engine_gb_ref(b, engine_gb_json_string(b));
    engine_gb_alt(b, r);
    engine_gb_ref(b, engine_gb_json_number(b));
    engine_gb_alt(b, r);
    engine_gb_ref(b, obj);
    engine_gb_alt(b, r);
    engine_gb_ref(b, arr);
    SHARED_END(b);
}

int32_t engine_gb_json_object(struct engine_gb *b)
{
    SHARED_BEGIN(b, J_OBJECT);
    json_container(b, r, 1, engine_gb_json_value(b));
    SHARED_END(b);
}
