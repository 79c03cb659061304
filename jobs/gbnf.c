/* A request's `grammar` field: GBNF-style grammar text compiled to a byte grammar
 * (jobs/schema.h, job_gbnf_grammar). Recursive descent over the text, one engine rule per named
 * rule, group and repetition. */
#include "jobs/schema.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GBNF_MAX_RULES  1024 /* named rules */
#define GBNF_MAX_REPEAT 256  /* largest bound of {m,n} */
#define GBNF_MAX_DEPTH  64   /* nested groups */

struct gp {
    const char *src, *p; /* the text, the cursor */
    struct engine_gb *b;
    char *name[GBNF_MAX_RULES];
    int32_t rule[GBNF_MAX_RULES];
    int defined[GBNF_MAX_RULES];
    int line_of[GBNF_MAX_RULES]; /* where first referenced (for "undefined" errors) */
    int n;
    int depth;
    struct err_detail *err;
    enum status st;
};

static int line_no(const struct gp *g, const char *at)
{
    int n = 1;
    for (const char *q = g->src; q < at; q++)
        n += *q == '\n';
    return n;
}

static int gfail(struct gp *g, enum status st, const char *what)
{
    if (!g->st)
        g->st = err_set(g->err, st, "line %d: %s", line_no(g, g->p), what);
    return 0;
}

/* Skip spaces, tabs and comments; newlines too when nl (inside groups and after "::="). */
static void skip(struct gp *g, int nl)
{
    for (;;) {
        while (*g->p == ' ' || *g->p == '\t' || *g->p == '\r' || (nl && *g->p == '\n'))
            g->p++;
        if (*g->p != '#')
            return;
        while (*g->p && *g->p != '\n')
            g->p++;
    }
}

static int is_name(char c)
{
    return isalnum((unsigned char)c) || c == '-' || c == '_';
}

/* The rule id of name[0..len), made (undefined) if new; -1 on overflow. */
static int32_t rule_of(struct gp *g, const char *name, size_t len)
{
    for (int i = 0; i < g->n; i++)
        if (strlen(g->name[i]) == len && !memcmp(g->name[i], name, len))
            return i;
    if (g->n == GBNF_MAX_RULES || !(g->name[g->n] = strndup(name, len)))
        return -1;
    g->rule[g->n] = engine_gb_rule(g->b);
    engine_gb_name(g->b, g->rule[g->n], g->name[g->n]);
    g->line_of[g->n] = line_no(g, name);
    g->defined[g->n] = 0;
    return g->n++;
}

/* One character of a literal or class: an escape or one UTF-8 character (its bytes in out);
 * returns the byte count, 0 on error. */
static int read_char(struct gp *g, unsigned char out[4])
{
    const unsigned char *p = (const unsigned char *)g->p;
    if (!*p || *p == '\n')
        return gfail(g, ST_ERR_INVALID_ARG, "unterminated literal or class");
    if (*p != '\\') {
        int n = *p < 0x80 ? 1 : *p >= 0xf0 ? 4 : *p >= 0xe0 ? 3 : *p >= 0xc0 ? 2 : 0;
        for (int i = 1; i < n; i++)
            if ((p[i] & 0xc0) != 0x80)
                n = 0;
        if (!n)
            return gfail(g, ST_ERR_INVALID_ARG, "invalid UTF-8");
        memcpy(out, p, (size_t)n);
        g->p += n;
        return n;
    }
    p++;
    g->p += 2;
    unsigned cp;
    switch (*p) {
    case 'n':
        out[0] = '\n';
        return 1;
    case 't':
        out[0] = '\t';
        return 1;
    case 'r':
        out[0] = '\r';
        return 1;
    case '\\':
    case '"':
    case '[':
    case ']':
    case '-':
    case '^':
        out[0] = *p;
        return 1;
    case 'x':
    case 'u': {
        int digits = *p == 'x' ? 2 : 4;
        char hex[5] = {0};
        for (int i = 0; i < digits; i++) {
            if (!isxdigit((unsigned char)g->p[i]))
                return gfail(g, ST_ERR_INVALID_ARG, "bad \\x or \\u escape");
            hex[i] = g->p[i];
        }
        g->p += digits;
        cp = (unsigned)strtoul(hex, NULL, 16);
        if (*p == 'x') { /* a byte */
            out[0] = (unsigned char)cp;
            return 1;
        }
        if (cp >= 0xd800 && cp < 0xe000)
            return gfail(g, ST_ERR_INVALID_ARG, "\\u escape of a surrogate");
        if (cp < 0x80) {
            out[0] = (unsigned char)cp;
            return 1;
        }
        if (cp < 0x800) {
            out[0] = (unsigned char)(0xc0 | cp >> 6);
            out[1] = (unsigned char)(0x80 | (cp & 0x3f));
            return 2;
        }
        out[0] = (unsigned char)(0xe0 | cp >> 12);
        out[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
        out[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    default:
        return gfail(g, ST_ERR_INVALID_ARG, "unknown escape");
    }
}

/* Any one UTF-8 character whose first byte is allowed by lead[] (ASCII bytes as given; every
 * multi-byte character when multi). */
static int32_t char_rule(struct gp *g, const uint32_t ascii[4], int multi)
{
    int32_t r = engine_gb_rule(g->b);
    uint32_t set[8] = {ascii[0], ascii[1], ascii[2], ascii[3]};
    engine_gb_alt(g->b, r);
    engine_gb_set(g->b, set);
    if (multi) {
        engine_gb_alt(g->b, r);
        engine_gb_ref(g->b, engine_gb_utf8_multibyte(g->b));
    }
    return r;
}

static int32_t alternatives(struct gp *g, int top);

/* [abc a-z] or [^...]: ASCII ranges and single characters (non-ASCII ones listed singly). */
static int32_t char_class(struct gp *g)
{
    int neg = 0;
    g->p++;
    if (*g->p == '^') {
        neg = 1;
        g->p++;
    }
    uint32_t ascii[4] = {0};
    unsigned char multi[64][4];
    int mlen[64], n_multi = 0;
    while (*g->p != ']') {
        unsigned char a[4], z[4];
        int na = read_char(g, a);
        if (!na)
            return -1;
        if (*g->p == '-' && g->p[1] != ']') {
            g->p++;
            int nz = read_char(g, z);
            if (!nz)
                return -1;
            if (na != 1 || nz != 1 || a[0] > 0x7f || z[0] > 0x7f || z[0] < a[0])
                return gfail(g, ST_ERR_UNSUPPORTED, "class ranges must be ASCII, low to high") - 1;
            for (unsigned c = a[0]; c <= z[0]; c++)
                ascii[c >> 5] |= 1u << (c & 31);
        } else if (na == 1 && a[0] < 0x80) {
            ascii[a[0] >> 5] |= 1u << (a[0] & 31);
        } else {
            if (neg)
                return gfail(g, ST_ERR_UNSUPPORTED, "non-ASCII characters in [^...]") - 1;
            if (n_multi == 64)
                return gfail(g, ST_ERR_UNSUPPORTED,
                             "more than 64 non-ASCII characters in a "
                             "class") -
                       1;
            memcpy(multi[n_multi], a, 4);
            mlen[n_multi++] = na;
        }
    }
    g->p++;
    if (neg) /* every character but the listed ASCII ones */
        for (int w = 0; w < 4; w++)
            ascii[w] = ~ascii[w];
    int32_t r = char_rule(g, ascii, neg);
    for (int i = 0; i < n_multi; i++) {
        engine_gb_alt(g->b, r);
        engine_gb_lit(g->b, (const char *)multi[i], (size_t)mlen[i]);
    }
    return r;
}

/* One primary: "literal", [class], ., name, ( alternatives ). Its rule, -1 on error. */
static int32_t primary(struct gp *g)
{
    struct engine_gb *b = g->b;
    if (*g->p == '"') {
        g->p++;
        int32_t r = engine_gb_rule(b);
        engine_gb_alt(b, r);
        while (*g->p != '"') {
            unsigned char c[4];
            int n = read_char(g, c);
            if (!n)
                return -1;
            engine_gb_lit(b, (const char *)c, (size_t)n);
        }
        g->p++;
        return r;
    }
    if (*g->p == '[')
        return char_class(g);
    if (*g->p == '.') {
        g->p++;
        static const uint32_t all[4] = {0xfffffffeu, ~0u, ~0u, ~0u}; /* any but NUL */
        return char_rule(g, all, 1);
    }
    if (*g->p == '(') {
        if (++g->depth > GBNF_MAX_DEPTH)
            return gfail(g, ST_ERR_UNSUPPORTED, "groups nested deeper than 64") - 1;
        g->p++;
        int32_t r = alternatives(g, 0);
        g->depth--;
        if (r < 0)
            return -1;
        if (*g->p != ')')
            return gfail(g, ST_ERR_INVALID_ARG, "expected ')'") - 1;
        g->p++;
        return r;
    }
    if (is_name(*g->p)) {
        const char *s = g->p;
        while (is_name(*g->p))
            g->p++;
        int32_t i = rule_of(g, s, (size_t)(g->p - s));
        if (i < 0)
            return gfail(g, ST_ERR_UNSUPPORTED, "too many rules") - 1;
        return g->rule[i];
    }
    return gfail(g, ST_ERR_INVALID_ARG, "expected a literal, a class, '.', a name or '('") - 1;
}

/* x repeated lo..hi times (hi < 0: no limit) as a new rule. */
static int32_t repeat(struct gp *g, int32_t x, int lo, int hi)
{
    struct engine_gb *b = g->b;
    int32_t star = -1;
    if (hi < 0) { /* star ::= "" | x star */
        star = engine_gb_rule(b);
        engine_gb_alt(b, star);
        engine_gb_alt(b, star);
        engine_gb_ref(b, x);
        engine_gb_ref(b, star);
    }
    int n = hi < 0 ? lo : hi;
    int32_t next = star; /* built from the end: r_k = k items written */
    int32_t rk = -1;
    for (int k = n; k >= 0; k--) {
        rk = engine_gb_rule(b);
        if (k == n) {
            engine_gb_alt(b, rk);
            if (star >= 0)
                engine_gb_ref(b, star);
        } else {
            if (k >= lo)
                engine_gb_alt(b, rk);
            engine_gb_alt(b, rk);
            engine_gb_ref(b, x);
            engine_gb_ref(b, next);
        }
        next = rk;
    }
    return rk;
}

/* A sequence of primaries with postfix operators, up to "|", ")" or the end of the rule. */
static int sequence(struct gp *g, int32_t alt_rule, int top)
{
    int32_t items[256];
    int n = 0;
    for (;;) {
        skip(g, !top);
        if (top && *g->p == '\n') { /* a rule continues on the next line only after | */
            const char *q = g->p;
            while (*q == '\n' || *q == ' ' || *q == '\t' || *q == '\r')
                q++;
            if (*q != '|')
                break;
            g->p = q;
        }
        if (!*g->p || *g->p == '|' || *g->p == ')')
            break;
        if (n == 256)
            return gfail(g, ST_ERR_UNSUPPORTED, "more than 256 items in a sequence");
        if (engine_gb_full(g->b)) { /* (finish would refuse it: stop reading now) */
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "the grammar is too large (more than %d alternatives or %d elements, "
                     "repetitions counted out)",
                     ENGINE_GB_MAX_ALTS, ENGINE_GB_MAX_ELEMS);
            return gfail(g, ST_ERR_INVALID_ARG, msg);
        }
        int32_t x = primary(g);
        if (x < 0)
            return 0;
        for (;;) {
            if (*g->p == '*')
                x = repeat(g, x, 0, -1);
            else if (*g->p == '+')
                x = repeat(g, x, 1, -1);
            else if (*g->p == '?')
                x = repeat(g, x, 0, 1);
            else if (*g->p == '{') {
                char *end;
                long lo = strtol(g->p + 1, &end, 10), hi = lo;
                if (end == g->p + 1)
                    return gfail(g, ST_ERR_INVALID_ARG, "expected a number after '{'");
                if (*end == ',') {
                    const char *h = end + 1;
                    hi = *h == '}' ? -1 : strtol(h, &end, 10);
                    if (hi < 0 && *h != '}')
                        return gfail(g, ST_ERR_INVALID_ARG, "bad {m,n}");
                    if (*h == '}')
                        end = (char *)h;
                }
                if (*end != '}' || lo < 0 || lo > GBNF_MAX_REPEAT || hi > GBNF_MAX_REPEAT ||
                    (hi >= 0 && hi < lo))
                    return gfail(g, ST_ERR_INVALID_ARG, "bad {m,n} (0 <= m <= n <= 256)");
                g->p = end;
                x = repeat(g, x, (int)lo, (int)hi);
            } else {
                break;
            }
            g->p++;
        }
        items[n++] = x;
    }
    engine_gb_alt(g->b, alt_rule);
    for (int i = 0; i < n; i++)
        engine_gb_ref(g->b, items[i]);
    return 1;
}

static int32_t alternatives(struct gp *g, int top)
{
    int32_t r = engine_gb_rule(g->b);
    for (;;) {
        if (!sequence(g, r, top))
            return -1;
        if (*g->p != '|')
            return r;
        g->p++;
    }
}

enum status job_gbnf_grammar(const char *text, struct engine_grammar **out, struct err_detail *err)
{
    *out = NULL;
    struct gp g = {0};
    g.src = g.p = text;
    g.err = err;
    enum status st = engine_gb_new(&g.b, err);
    if (st)
        return st;
    int32_t top = engine_gb_rule(g.b); /* rule 0: root */
    for (;;) {
        skip(&g, 1);
        if (!*g.p)
            break;
        const char *s = g.p;
        while (is_name(*g.p))
            g.p++;
        if (g.p == s) {
            gfail(&g, ST_ERR_INVALID_ARG, "expected a rule name");
            break;
        }
        int32_t i = rule_of(&g, s, (size_t)(g.p - s));
        if (i < 0) {
            gfail(&g, ST_ERR_UNSUPPORTED, "too many rules");
            break;
        }
        if (g.defined[i]) {
            gfail(&g, ST_ERR_INVALID_ARG, "rule defined twice");
            break;
        }
        g.defined[i] = 1;
        skip(&g, 0);
        if (strncmp(g.p, "::=", 3) != 0) {
            gfail(&g, ST_ERR_INVALID_ARG, "expected '::='");
            break;
        }
        g.p += 3;
        skip(&g, 1);
        int32_t body = alternatives(&g, 1);
        if (body < 0)
            break;
        if (*g.p == ')') {
            gfail(&g, ST_ERR_INVALID_ARG, "unbalanced ')'");
            break;
        }
        engine_gb_alt(g.b, g.rule[i]);
        engine_gb_ref(g.b, body);
    }
    int root = -1;
    for (int i = 0; !g.st && i < g.n; i++) {
        if (!strcmp(g.name[i], "root"))
            root = i;
        if (!g.defined[i]) {
            char msg[160];
            snprintf(msg, sizeof(msg), "line %d: rule '%s' is used but not defined",
                     g.line_of[i], g.name[i]);
            g.st = err_set(err, ST_ERR_INVALID_ARG, "%s", msg);
        }
    }
    if (!g.st && root < 0)
        g.st = err_set(err, ST_ERR_INVALID_ARG, "no rule named 'root'");
    for (int i = 0; i < g.n; i++)
        free(g.name[i]);
    if (g.st) {
        engine_gb_free(g.b);
        return g.st;
    }
    engine_gb_alt(g.b, top);
    engine_gb_ref(g.b, g.rule[root]);
    return engine_gb_finish(g.b, out, err);
}
