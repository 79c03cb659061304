/* JSON Schema -> byte grammar (jobs/schema.h). One rule per schema object compiled; $refs are
 * compiled once each (their rule made before their body, so recursion works). */
#include "jobs/schema.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobs/json.h"

#define MAX_DEPTH  64   /* schema objects nested (not counting $refs, which are rules) */
#define MAX_ITEMS  1024 /* largest minItems / maxItems */
#define MAX_LENGTH 4096 /* largest minLength / maxLength */
#define MAX_REFS   256  /* distinct $ref targets */
#define EXACT_INT  9007199254740992.0 /* 2^53 */

struct sc {
    struct engine_gb *b;
    const cJSON *root;
    struct err_detail *err;
    enum status st; /* first failure */
    char path[512]; /* where we are, for messages */
    const char *ref_name[MAX_REFS];
    int32_t ref_rule[MAX_REFS];
    int n_refs;
    int depth;
};

static int32_t fail(struct sc *c, enum status st, const char *fmt, const char *a, const char *b)
{
    if (!c->st) {
        char msg[256];
        snprintf(msg, sizeof(msg), fmt, a ? a : "", b ? b : "");
        if (c->path[0])
            c->st = err_set(c->err, st, "%s: %s", c->path, msg);
        else /* (the caller names the schema: "...json_schema.schema: keyword ...") */
            c->st = err_set(c->err, st, "%s", msg);
    }
    return -1;
}

/* Append ".name" (or "[i]" when name is NULL) to the path; returns the old length. */
static size_t path_push(struct sc *c, const char *name, int idx)
{
    size_t n = strlen(c->path);
    if (name)
        snprintf(c->path + n, sizeof(c->path) - n, "%s%s", n ? "." : "", name);
    else
        snprintf(c->path + n, sizeof(c->path) - n, "[%d]", idx);
    return n;
}

static int32_t compile(struct sc *c, const cJSON *s);

/* ---- literals and numbers ----------------------------------------------------------------- */

/* 1 when every number in v reads back exactly from its text (job_json_put_double): finite, and
 * integral ones below 2^53 in magnitude (9007199254740993 parses as 2^53: the value the user
 * wrote is already lost, and a validator with exact integers would want it). */
static int exact_numbers(const cJSON *v)
{
    if (cJSON_IsNumber(v))
        return isfinite(v->valuedouble) &&
               (v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) < EXACT_INT);
    const cJSON *it;
    cJSON_ArrayForEach(it, v)
    {
        if (!exact_numbers(it))
            return 0;
    }
    return 1;
}

/* A rule matching exactly the compact JSON text of v (numbers in their shortest exact form). */
static int32_t literal(struct sc *c, const cJSON *v)
{
    if (!exact_numbers(v))
        return fail(c, ST_ERR_UNSUPPORTED,
                    "an enum or const number that is not finite, or an integer beyond +-2^53, is "
                    "not supported%s%s",
                    NULL, NULL);
    struct job_json j = {0};
    job_json_put_value(&j, v);
    char *t = job_json_take(&j);
    if (!t)
        return fail(c, ST_ERR_NOMEM, "out of memory%s%s", NULL, NULL);
    int32_t r = engine_gb_rule(c->b);
    engine_gb_alt(c->b, r);
    engine_gb_lit(c->b, t, strlen(t));
    free(t);
    return r;
}

/* Append to the open alternative the digits of every number of n digits between lo and hi
 * (strings of equal length n, lo <= hi) as alternatives of a new rule; returns it. */
static int32_t same_len(struct engine_gb *b, const char *lo, const char *hi, size_t n)
{
    int32_t r = engine_gb_rule(b);
    if (n == 0) {
        engine_gb_alt(b, r);
        return r;
    }
    if (lo[0] == hi[0]) {
        int32_t rest = same_len(b, lo + 1, hi + 1, n - 1);
        engine_gb_alt(b, r);
        engine_gb_range(b, (unsigned char)lo[0], (unsigned char)lo[0]);
        engine_gb_ref(b, rest);
        return r;
    }
    char nines[24], zeros[24];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    int lo_all0 = !memcmp(lo + 1, zeros, n - 1), hi_all9 = !memcmp(hi + 1, nines, n - 1);
    unsigned mid_lo = (unsigned char)lo[0] + (lo_all0 ? 0 : 1);
    unsigned mid_hi = (unsigned char)hi[0] - (hi_all9 ? 0 : 1);
    if (!lo_all0) {
        int32_t rest = same_len(b, lo + 1, nines, n - 1);
        engine_gb_alt(b, r);
        engine_gb_range(b, (unsigned char)lo[0], (unsigned char)lo[0]);
        engine_gb_ref(b, rest);
    }
    if (mid_lo <= mid_hi) {
        engine_gb_alt(b, r);
        engine_gb_range(b, mid_lo, mid_hi);
        for (size_t i = 1; i < n; i++)
            engine_gb_range(b, '0', '9');
    }
    if (!hi_all9) {
        int32_t rest = same_len(b, zeros, hi + 1, n - 1);
        engine_gb_alt(b, r);
        engine_gb_range(b, (unsigned char)hi[0], (unsigned char)hi[0]);
        engine_gb_ref(b, rest);
    }
    return r;
}

/* Alternatives of r: every non-negative integer in [lo, hi], no leading zeros. */
static void nonneg_range(struct engine_gb *b, int32_t r, long long lo, long long hi)
{
    long long p = 1;
    for (int d = 1; d <= 19 && lo <= hi; d++, p *= 10) {
        long long dlo = d == 1 ? 0 : p, dhi = d == 19 ? (long long)9e18 : p * 10 - 1;
        long long a = lo > dlo ? lo : dlo, z = hi < dhi ? hi : dhi;
        if (a <= z) {
            char sa[24], sz[24];
            snprintf(sa, sizeof(sa), "%lld", a);
            snprintf(sz, sizeof(sz), "%lld", z);
            int32_t x = same_len(b, sa, sz, strlen(sa));
            engine_gb_alt(b, r);
            engine_gb_ref(b, x);
        }
        if (d == 19)
            break;
    }
}

/* A bound keyword as an exact integer (*has 0 when absent). */
static int int_bound(struct sc *c, const cJSON *s, const char *key, int up, int excl,
                     long long *out, int *has)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    *has = 0;
    if (!v)
        return 1;
    if (!cJSON_IsNumber(v))
        return fail(c, ST_ERR_INVALID_ARG, "'%s' must be a number%s", key, NULL) + 2;
    double d = v->valuedouble;
    if (!(fabs(d) < EXACT_INT)) /* (2^53 + 1 parses as 2^53: the bound is lost) */
        return fail(c, ST_ERR_UNSUPPORTED, "'%s' at or beyond +-2^53 is not supported%s", key,
                    NULL) +
               2;
    const double x = up ? floor(d) : ceil(d);
    *out = (long long)x; /* exact below 2^53; the step past an exclusive bound in integers */
    if (excl && x == d)
        *out += up ? -1 : 1;
    *has = 1;
    return 1;
}

static int32_t integer_rule(struct sc *c, const cJSON *s)
{
    long long lo = 0, hi = 0, t;
    int has_lo = 0, has_hi = 0, h;
    if (!int_bound(c, s, "minimum", 0, 0, &lo, &has_lo) ||
        !int_bound(c, s, "maximum", 1, 0, &hi, &has_hi) ||
        !int_bound(c, s, "exclusiveMinimum", 0, 1, &t, &h))
        return -1;
    if (h && (!has_lo || t > lo))
        lo = t, has_lo = 1;
    if (!int_bound(c, s, "exclusiveMaximum", 1, 1, &t, &h))
        return -1;
    if (h && (!has_hi || t < hi))
        hi = t, has_hi = 1;
    if (!has_lo && !has_hi)
        return engine_gb_json_integer(c->b);
    if (has_lo && has_hi && lo > hi)
        return fail(c, ST_ERR_INVALID_ARG, "no integer lies within the bounds%s%s", NULL, NULL);
    const long long BIG = (long long)EXACT_INT;
    if (!has_lo)
        lo = -BIG;
    if (!has_hi)
        hi = BIG;
    int32_t r = engine_gb_rule(c->b);
    if (hi >= 0)
        nonneg_range(c->b, r, lo > 0 ? lo : 0, hi);
    if (lo < 0) { /* "-" then 1 .. -lo, limited by hi */
        int32_t neg = engine_gb_rule(c->b);
        nonneg_range(c->b, neg, hi < 0 ? -hi : 1, -lo);
        engine_gb_alt(c->b, r);
        engine_gb_lit(c->b, "-", 1);
        engine_gb_ref(c->b, neg);
    }
    /* unbounded sides: any number of digits beyond 2^53 is cut; JSON Schema allows them, but
     * a model writing 17-digit integers is not what a schema without bounds meant either */
    return r;
}

static int32_t number_rule(struct sc *c, const cJSON *s)
{
    static const char *const bounds[] = {"minimum", "maximum", "exclusiveMinimum",
                                         "exclusiveMaximum"};
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(s, "minimum");
    for (int i = 0; i < 4; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, bounds[i]);
        if (v && !(i == 0 && cJSON_IsNumber(v) && v->valuedouble == 0))
            return fail(c, ST_ERR_UNSUPPORTED,
                        "'%s' on a number is not supported (only minimum 0; integers take any "
                        "bounds)%s",
                        bounds[i], NULL);
    }
    if (!mn)
        return engine_gb_json_number(c->b);
    return engine_gb_json_unsigned_number(c->b); /* minimum 0: no sign */
}

/* ---- strings -------------------------------------------------------------------------------- */

static void digit2(struct engine_gb *b, unsigned a_lo, unsigned a_hi, unsigned b_lo, unsigned b_hi)
{
    engine_gb_range(b, a_lo, a_hi);
    engine_gb_range(b, b_lo, b_hi);
}

/* Alternatives of r: the two-digit multiples of 4 from 04 to 96. */
static void mult4(struct engine_gb *b, int32_t r)
{
    engine_gb_alt(b, r); /* 04 08 24 28 ... 88 */
    engine_gb_chars(b, "02468");
    engine_gb_chars(b, "48");
    engine_gb_alt(b, r); /* 20 40 60 80 */
    engine_gb_chars(b, "2468");
    engine_gb_lit(b, "0", 1);
    engine_gb_alt(b, r); /* 12 16 32 36 ... */
    engine_gb_chars(b, "13579");
    engine_gb_chars(b, "26");
}

/* "YYYY-MM-DD" with the day within its month (February 29 in leap years only), year
 * 0001-9999. */
static int32_t date_rule(struct engine_gb *b)
{
    int32_t md = engine_gb_rule(b), r = engine_gb_rule(b);
    static const char *const m31[] = {"01", "03", "05", "07", "08", "10", "12"};
    static const char *const m30[] = {"04", "06", "09", "11"};
    for (int k = 0; k < 11; k++) {
        const char *m = k < 7 ? m31[k] : m30[k - 7];
        engine_gb_alt(b, md); /* 01-09 */
        engine_gb_lit(b, m, 2);
        engine_gb_lit(b, "-0", 2);
        engine_gb_range(b, '1', '9');
        engine_gb_alt(b, md); /* 10-29 */
        engine_gb_lit(b, m, 2);
        engine_gb_lit(b, "-", 1);
        digit2(b, '1', '2', '0', '9');
        engine_gb_alt(b, md); /* 30, 31 */
        engine_gb_lit(b, m, 2);
        engine_gb_lit(b, "-3", 2);
        engine_gb_range(b, '0', k < 7 ? '1' : '0');
    }
    engine_gb_alt(b, md);
    engine_gb_lit(b, "02-0", 4);
    engine_gb_range(b, '1', '9');
    engine_gb_alt(b, md);
    engine_gb_lit(b, "02-1", 4);
    engine_gb_range(b, '0', '9');
    engine_gb_alt(b, md);
    engine_gb_lit(b, "02-2", 4);
    engine_gb_range(b, '0', '8');
    /* years 0001-9999 (Python's dates, and so jsonschema's format checks, have no year 0) */
    int32_t year = engine_gb_rule(b);
    for (int z = 0; z < 4; z++) {
        engine_gb_alt(b, year);
        for (int i = 0; i < z; i++)
            engine_gb_lit(b, "0", 1);
        engine_gb_range(b, '1', '9');
        for (int i = z + 1; i < 4; i++)
            engine_gb_range(b, '0', '9');
    }
    engine_gb_alt(b, r);
    engine_gb_ref(b, year);
    engine_gb_lit(b, "-", 1);
    engine_gb_ref(b, md);
    /* leap years: YY then a multiple of 4, or a multiple of 4 then 00 (0000 is no year) */
    int32_t m4 = engine_gb_rule(b), leap = engine_gb_rule(b);
    mult4(b, m4);
    engine_gb_alt(b, leap);
    digit2(b, '0', '9', '0', '9');
    engine_gb_ref(b, m4);
    engine_gb_alt(b, leap);
    engine_gb_ref(b, m4);
    engine_gb_lit(b, "00", 2);
    engine_gb_alt(b, r);
    engine_gb_ref(b, leap);
    engine_gb_lit(b, "-02-29", 6);
    return r;
}

/* "HH:MM:SS" (".digits")? then "Z" or "+HH:MM" / "-HH:MM" (RFC 3339 full-time). */
static int32_t time_rule(struct engine_gb *b)
{
    int32_t hh = engine_gb_rule(b), frac = engine_gb_rule(b), digs = engine_gb_json_digits(b);
    int32_t off = engine_gb_rule(b), r = engine_gb_rule(b);
    engine_gb_alt(b, hh);
    digit2(b, '0', '1', '0', '9');
    engine_gb_alt(b, hh);
    digit2(b, '2', '2', '0', '3');
    engine_gb_alt(b, frac);
    engine_gb_alt(b, frac);
    engine_gb_lit(b, ".", 1);
    engine_gb_ref(b, digs);
    engine_gb_alt(b, off);
    engine_gb_chars(b, "Zz"); /* (RFC 3339 allows the lower case) */
    engine_gb_alt(b, off);
    engine_gb_chars(b, "+-");
    engine_gb_ref(b, hh);
    engine_gb_lit(b, ":", 1);
    digit2(b, '0', '5', '0', '9');
    engine_gb_alt(b, r);
    engine_gb_ref(b, hh);
    engine_gb_lit(b, ":", 1);
    digit2(b, '0', '5', '0', '9');
    engine_gb_lit(b, ":", 1);
    digit2(b, '0', '5', '0', '9');
    engine_gb_ref(b, frac);
    engine_gb_ref(b, off);
    return r;
}

static int32_t string_rule(struct sc *c, const cJSON *s)
{
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(s, "minLength");
    const cJSON *mx = cJSON_GetObjectItemCaseSensitive(s, "maxLength");
    struct engine_gb *b = c->b;
    if (fmt) {
        if (!cJSON_IsString(fmt))
            return fail(c, ST_ERR_INVALID_ARG, "'format' must be a string%s%s", NULL, NULL);
        if (mn || mx)
            return fail(c, ST_ERR_UNSUPPORTED,
                        "'format' with minLength/maxLength is not "
                        "supported%s%s",
                        NULL, NULL);
        const char *f = fmt->valuestring;
        int32_t body;
        if (!strcmp(f, "date")) {
            body = date_rule(b);
        } else if (!strcmp(f, "time")) {
            body = time_rule(b);
        } else if (!strcmp(f, "date-time")) {
            int32_t d = date_rule(b), t = time_rule(b);
            body = engine_gb_rule(b);
            engine_gb_alt(b, body);
            engine_gb_ref(b, d);
            engine_gb_chars(b, "Tt");
            engine_gb_ref(b, t);
        } else if (!strcmp(f, "uuid")) {
            body = engine_gb_rule(b);
            engine_gb_alt(b, body);
            static const int groups[5] = {8, 4, 4, 4, 12};
            for (int g = 0; g < 5; g++) {
                if (g)
                    engine_gb_lit(b, "-", 1);
                for (int i = 0; i < groups[g]; i++)
                    engine_gb_chars(b, "0123456789abcdefABCDEF");
            }
        } else {
            return fail(c, ST_ERR_UNSUPPORTED,
                        "format '%s' is not supported (date, time, date-time, uuid)%s", f, NULL);
        }
        int32_t r = engine_gb_rule(b);
        engine_gb_alt(b, r);
        engine_gb_lit(b, "\"", 1);
        engine_gb_ref(b, body);
        engine_gb_lit(b, "\"", 1);
        return r;
    }
    if (!mn && !mx)
        return engine_gb_json_string(b);
    double lo = 0, hi = -1;
    if (mn &&
        (!cJSON_IsNumber(mn) || mn->valuedouble < 0 || mn->valuedouble != floor(mn->valuedouble)))
        return fail(c, ST_ERR_INVALID_ARG, "'minLength' must be a non-negative integer%s%s", NULL,
                    NULL);
    if (mx &&
        (!cJSON_IsNumber(mx) || mx->valuedouble < 0 || mx->valuedouble != floor(mx->valuedouble)))
        return fail(c, ST_ERR_INVALID_ARG, "'maxLength' must be a non-negative integer%s%s", NULL,
                    NULL);
    if (mn)
        lo = mn->valuedouble;
    if (mx)
        hi = mx->valuedouble;
    if (lo > MAX_LENGTH || hi > MAX_LENGTH)
        return fail(c, ST_ERR_UNSUPPORTED, "minLength/maxLength over 4096 are not supported%s%s",
                    NULL, NULL);
    if (mx && hi < lo)
        return fail(c, ST_ERR_INVALID_ARG, "maxLength is below minLength%s%s", NULL, NULL);
    /* chain: k characters written so far, k = 0 .. (max or min) */
    int n = (int)(mx ? hi : lo), n_lo = (int)lo;
    int32_t ch = engine_gb_json_string_char(b), first = -1, prev = -1;
    int32_t tail = mx ? -1 : engine_gb_rule(b); /* unbounded: "" | char tail */
    if (tail >= 0) {
        engine_gb_alt(b, tail);
        engine_gb_alt(b, tail);
        engine_gb_ref(b, ch);
        engine_gb_ref(b, tail);
    }
    for (int k = 0; k <= n; k++) {
        int32_t rk = engine_gb_rule(b);
        if (prev >= 0) { /* complete the previous rule: char then this one */
            engine_gb_alt(b, prev);
            engine_gb_ref(b, ch);
            engine_gb_ref(b, rk);
        } else {
            first = rk;
        }
        if (k == n && tail >= 0) {
            engine_gb_alt(b, rk);
            engine_gb_ref(b, tail);
        } else if (k >= n_lo) {
            engine_gb_alt(b, rk); /* may stop here */
        }
        prev = rk;
    }
    int32_t r = engine_gb_rule(b);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "\"", 1);
    engine_gb_ref(b, first);
    engine_gb_lit(b, "\"", 1);
    return r;
}

/* ---- arrays and objects ----------------------------------------------------------------- */

static int count_kw(struct sc *c, const cJSON *s, const char *key, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!v)
        return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble))
        return fail(c, ST_ERR_INVALID_ARG, "'%s' must be a non-negative integer%s", key, NULL);
    if (v->valuedouble > MAX_ITEMS)
        return fail(c, ST_ERR_UNSUPPORTED, "'%s' over 1024 is not supported%s", key, NULL);
    *out = v->valuedouble;
    return 1;
}

static int32_t array_rule(struct sc *c, const cJSON *s)
{
    struct engine_gb *b = c->b;
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    double lo = 0, hi = -1;
    if (count_kw(c, s, "minItems", &lo) < 0 || count_kw(c, s, "maxItems", &hi) < 0)
        return -1;
    int has_hi = hi >= 0;
    if (has_hi && hi < lo)
        return fail(c, ST_ERR_INVALID_ARG, "maxItems is below minItems%s%s", NULL, NULL);
    int32_t item;
    if (items) {
        size_t n = path_push(c, "items", 0);
        item = compile(c, items);
        c->path[n] = 0;
    } else {
        item = engine_gb_json_value(b);
    }
    if (item < 0)
        return -1;
    int32_t ws = engine_gb_json_ws(b), r = engine_gb_rule(b);
    int n_lo = (int)lo, n_hi = (int)hi;
    if (n_lo == 0) {
        engine_gb_alt(b, r);
        engine_gb_lit(b, "[", 1);
        engine_gb_ref(b, ws);
        engine_gb_lit(b, "]", 1);
    }
    if (has_hi && n_hi == 0)
        return r;
    /* L_k: after k items; more ::= ws "," ws item */
    int last = has_hi ? n_hi : (n_lo > 1 ? n_lo : 1);
    int32_t *L = malloc(sizeof(int32_t) * (size_t)(last + 1));
    if (!L)
        return fail(c, ST_ERR_NOMEM, "out of memory%s%s", NULL, NULL);
    for (int k = 1; k <= last; k++)
        L[k] = engine_gb_rule(b);
    for (int k = 1; k <= last; k++) {
        if (k >= n_lo)
            engine_gb_alt(b, L[k]);
        int32_t next = k < last ? L[k + 1] : (has_hi ? -1 : L[k]);
        if (next >= 0) {
            engine_gb_alt(b, L[k]);
            engine_gb_ref(b, ws);
            engine_gb_lit(b, ",", 1);
            engine_gb_ref(b, ws);
            engine_gb_ref(b, item);
            engine_gb_ref(b, next);
        }
    }
    engine_gb_alt(b, r);
    engine_gb_lit(b, "[", 1);
    engine_gb_ref(b, ws);
    engine_gb_ref(b, item);
    engine_gb_ref(b, L[1]);
    engine_gb_ref(b, ws);
    engine_gb_lit(b, "]", 1);
    free(L);
    return r;
}

static int in_required(const cJSON *req, const char *name)
{
    const cJSON *it;
    cJSON_ArrayForEach(it, req)
    {
        if (cJSON_IsString(it) && !strcmp(it->valuestring, name))
            return 1;
    }
    return 0;
}

static int32_t object_rule(struct sc *c, const cJSON *s)
{
    struct engine_gb *b = c->b;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props && !cJSON_IsObject(props))
        return fail(c, ST_ERR_INVALID_ARG, "'properties' must be an object%s%s", NULL, NULL);
    if (req && !cJSON_IsArray(req))
        return fail(c, ST_ERR_INVALID_ARG, "'required' must be an array%s%s", NULL, NULL);
    const cJSON *it;
    cJSON_ArrayForEach(it, req)
    {
        if (!cJSON_IsString(it))
            return fail(c, ST_ERR_INVALID_ARG, "'required' must hold strings%s%s", NULL, NULL);
        if (!props || !cJSON_GetObjectItemCaseSensitive(props, it->valuestring))
            return fail(c, ST_ERR_UNSUPPORTED, "required property '%s' is not in 'properties'%s",
                        it->valuestring, NULL);
    }
    int n = props ? cJSON_GetArraySize(props) : 0;
    int32_t ws = engine_gb_json_ws(b);
    if (n == 0) {
        if (addl && cJSON_IsFalse(addl)) {
            int32_t r = engine_gb_rule(b);
            engine_gb_alt(b, r);
            engine_gb_lit(b, "{", 1);
            engine_gb_ref(b, ws);
            engine_gb_lit(b, "}", 1);
            return r;
        }
        if (!addl || cJSON_IsTrue(addl))
            return engine_gb_json_object(b);
        /* a map: string keys, values of the additionalProperties schema */
        size_t pl = path_push(c, "additionalProperties", 0);
        int32_t val = compile(c, addl);
        c->path[pl] = 0;
        if (val < 0)
            return -1;
        return engine_gb_json_container(b, 1, val);
    }
    if (addl && !cJSON_IsBool(addl) && !cJSON_IsObject(addl))
        return fail(c, ST_ERR_INVALID_ARG,
                    "'additionalProperties' must be a boolean or a "
                    "schema%s%s",
                    NULL, NULL);
    /* kv_i, then F_i (none written yet) and R_i (some written) for i = 0..n */
    int32_t *kv = malloc(sizeof(int32_t) * (size_t)(3 * n + 2));
    if (!kv)
        return fail(c, ST_ERR_NOMEM, "out of memory%s%s", NULL, NULL);
    int32_t *F = kv + n, *R = kv + 2 * n + 1;
    int *opt = calloc((size_t)n + 1, sizeof(int));
    if (!opt) {
        free(kv);
        return fail(c, ST_ERR_NOMEM, "out of memory%s%s", NULL, NULL);
    }
    int i = 0;
    cJSON_ArrayForEach(it, props)
    {
        size_t pl = path_push(c, "properties", 0);
        path_push(c, it->string, 0);
        int32_t val = compile(c, it);
        c->path[pl] = 0;
        if (val < 0) {
            free(kv);
            free(opt);
            return -1;
        }
        struct job_json key = {0};
        job_json_put_str(&key, it->string, strlen(it->string));
        char *k = job_json_take(&key);
        if (!k) {
            free(kv);
            free(opt);
            return fail(c, ST_ERR_NOMEM, "out of memory%s%s", NULL, NULL);
        }
        kv[i] = engine_gb_rule(b);
        engine_gb_alt(b, kv[i]);
        engine_gb_lit(b, k, strlen(k));
        engine_gb_ref(b, ws);
        engine_gb_lit(b, ":", 1);
        engine_gb_ref(b, ws);
        engine_gb_ref(b, val);
        free(k);
        opt[i] = !in_required(req, it->string);
        i++;
    }
    for (i = 0; i <= n; i++) {
        F[i] = engine_gb_rule(b);
        R[i] = engine_gb_rule(b);
    }
    for (i = 0; i <= n; i++) {
        if (i == n) { /* the end: after a member, whitespace may come before the brace */
            engine_gb_alt(b, F[i]);
            engine_gb_alt(b, R[i]);
            engine_gb_ref(b, ws);
            continue;
        }
        engine_gb_alt(b, F[i]);
        engine_gb_ref(b, kv[i]);
        engine_gb_ref(b, R[i + 1]);
        engine_gb_alt(b, R[i]);
        engine_gb_ref(b, ws);
        engine_gb_lit(b, ",", 1);
        engine_gb_ref(b, ws);
        engine_gb_ref(b, kv[i]);
        engine_gb_ref(b, R[i + 1]);
        if (opt[i]) {
            engine_gb_alt(b, F[i]);
            engine_gb_ref(b, F[i + 1]);
            engine_gb_alt(b, R[i]);
            engine_gb_ref(b, R[i + 1]);
        }
    }
    int32_t r = engine_gb_rule(b);
    engine_gb_alt(b, r);
    engine_gb_lit(b, "{", 1);
    engine_gb_ref(b, ws);
    engine_gb_ref(b, F[0]);
    engine_gb_lit(b, "}", 1);
    free(kv);
    free(opt);
    return r;
}

/* ---- dispatch ------------------------------------------------------------------------------ */

/* Add rule x (a compiled subschema, -1 on failure) as an alternative of r; 0 on failure. */
static int add_alt(struct engine_gb *b, int32_t r, int32_t x)
{
    if (x < 0)
        return 0;
    engine_gb_alt(b, r);
    engine_gb_ref(b, x);
    return 1;
}

static int32_t type_rule(struct sc *c, const cJSON *s, const char *t)
{
    struct engine_gb *b = c->b;
    if (!strcmp(t, "object"))
        return object_rule(c, s);
    if (!strcmp(t, "array"))
        return array_rule(c, s);
    if (!strcmp(t, "string"))
        return string_rule(c, s);
    if (!strcmp(t, "integer"))
        return integer_rule(c, s);
    if (!strcmp(t, "number"))
        return number_rule(c, s);
    int32_t r = engine_gb_rule(b);
    if (!strcmp(t, "boolean")) {
        engine_gb_alt(b, r);
        engine_gb_lit(b, "true", 4);
        engine_gb_alt(b, r);
        engine_gb_lit(b, "false", 5);
    } else if (!strcmp(t, "null")) {
        engine_gb_alt(b, r);
        engine_gb_lit(b, "null", 4);
    } else {
        return fail(c, ST_ERR_INVALID_ARG, "unknown type '%s'%s", t, NULL);
    }
    return r;
}

/* Does JSON value v have JSON Schema type t? */
static int has_type(const cJSON *v, const char *t)
{
    if (!strcmp(t, "integer"))
        return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble);
    return (!strcmp(t, "number") && cJSON_IsNumber(v)) ||
           (!strcmp(t, "string") && cJSON_IsString(v)) ||
           (!strcmp(t, "boolean") && cJSON_IsBool(v)) || (!strcmp(t, "null") && cJSON_IsNull(v)) ||
           (!strcmp(t, "object") && cJSON_IsObject(v)) || (!strcmp(t, "array") && cJSON_IsArray(v));
}

/* The definition name of a "#/$defs/NAME" fragment's NAME (sizeof(out) bytes at most): its
 * %XX escapes decoded (a URI fragment), then its JSON-pointer escapes (~1 is '/', ~0 is '~').
 * 0 when it is not one name (a raw '/' after decoding: a deeper pointer), a stray '%' or '~',
 * or too long. */
static int ref_name(const char *s, char *out, size_t cap)
{
    char dec[256];
    size_t n = 0;
    for (; *s; s++) {
        int ch = (unsigned char)*s;
        if (ch == '%') {
            unsigned v;
            if (!isxdigit((unsigned char)s[1]) || !isxdigit((unsigned char)s[2]) ||
                sscanf(s + 1, "%2x", &v) != 1)
                return 0;
            ch = (int)v;
            s += 2;
        }
        if (n + 1 >= sizeof(dec) || ch == 0)
            return 0;
        dec[n++] = (char)ch;
    }
    dec[n] = 0;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = dec[i];
        if (ch == '/')
            return 0;
        if (ch == '~') {
            if (dec[i + 1] != '0' && dec[i + 1] != '1')
                return 0;
            ch = dec[++i] == '1' ? '/' : '~';
        }
        if (k + 1 >= cap)
            return 0;
        out[k++] = ch;
    }
    out[k] = 0;
    return 1;
}

static int32_t ref_rule(struct sc *c, const char *ref)
{
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->ref_name[i], ref))
            return c->ref_rule[i];
    const cJSON *target = NULL;
    if (!strcmp(ref, "#")) {
        target = c->root;
    } else if (!strncmp(ref, "#/$defs/", 8) || !strncmp(ref, "#/definitions/", 14)) {
        int defs = ref[2] == '$';
        char name[256];
        if (!ref_name(ref + (defs ? 8 : 14), name, sizeof(name)))
            return fail(c, ST_ERR_UNSUPPORTED,
                        "$ref '%s': only #/$defs/NAME and "
                        "#/definitions/NAME are supported%s",
                        ref, NULL);
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(c->root, defs ? "$defs" : "definitions");
        target = d ? cJSON_GetObjectItemCaseSensitive(d, name) : NULL;
    } else {
        return fail(c, ST_ERR_UNSUPPORTED,
                    "$ref '%s': only #, #/$defs/NAME and "
                    "#/definitions/NAME are supported%s",
                    ref, NULL);
    }
    if (!target)
        return fail(c, ST_ERR_INVALID_ARG, "$ref '%s' names no definition%s", ref, NULL);
    if (c->n_refs == MAX_REFS)
        return fail(c, ST_ERR_UNSUPPORTED, "more than 256 $ref targets%s%s", NULL, NULL);
    int32_t r = engine_gb_rule(c->b); /* made first: the body may refer to it */
    c->ref_name[c->n_refs] = ref;
    c->ref_rule[c->n_refs++] = r;
    char saved[sizeof(c->path)];
    memcpy(saved, c->path, sizeof(saved));
    snprintf(c->path, sizeof(c->path), "%s", ref);
    int depth = c->depth;
    c->depth = 0;
    int32_t body = compile(c, target);
    c->depth = depth;
    memcpy(c->path, saved, sizeof(saved));
    if (body < 0)
        return -1;
    engine_gb_alt(c->b, r);
    engine_gb_ref(c->b, body);
    return r;
}

static const char *const annotations[] = {
    "title",      "description", "default",   "examples", "$schema",     "$id", "$comment",
    "deprecated", "readOnly",    "writeOnly", "$defs",    "definitions", NULL};
static const char *const handled[] = {"type",
                                      "enum",
                                      "const",
                                      "anyOf",
                                      "$ref",
                                      "nullable",
                                      "properties",
                                      "required",
                                      "additionalProperties",
                                      "items",
                                      "minItems",
                                      "maxItems",
                                      "minLength",
                                      "maxLength",
                                      "format",
                                      "minimum",
                                      "maximum",
                                      "exclusiveMinimum",
                                      "exclusiveMaximum",
                                      NULL};

/* The type a handled keyword constrains ("object", "array", "string", "number"), or NULL for
 * the keywords that are not constraints of one type (type, nullable, enum, const, anyOf,
 * $ref). */
static const char *kind_of(const char *k)
{
    static const char *const kinds[][2] = {
        {"properties", "object"},
        {"required", "object"},
        {"additionalProperties", "object"},
        {"items", "array"},
        {"minItems", "array"},
        {"maxItems", "array"},
        {"minLength", "string"},
        {"maxLength", "string"},
        {"format", "string"},
        {"minimum", "number"},
        {"maximum", "number"},
        {"exclusiveMinimum", "number"},
        {"exclusiveMaximum", "number"},
    };
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        if (!strcmp(kinds[i][0], k))
            return kinds[i][1];
    return NULL;
}

static int listed(const char *const *list, const char *k)
{
    for (; *list; list++)
        if (!strcmp(*list, k))
            return 1;
    return 0;
}

static int32_t compile(struct sc *c, const cJSON *s)
{
    struct engine_gb *b = c->b;
    if (c->st)
        return -1;
    if (cJSON_IsTrue(s))
        return engine_gb_json_value(b);
    if (!cJSON_IsObject(s))
        return fail(c, ST_ERR_INVALID_ARG, "a schema must be an object or true%s%s", NULL, NULL);
    if (++c->depth > MAX_DEPTH) {
        c->depth--;
        return fail(c, ST_ERR_UNSUPPORTED, "schemas nested deeper than 64%s%s", NULL, NULL);
    }
    int32_t r = -1;
    const cJSON *k;
    cJSON_ArrayForEach(k, s)
    {
        if (!listed(annotations, k->string) && !listed(handled, k->string)) {
            r = fail(c, ST_ERR_UNSUPPORTED, "keyword '%s' is not supported%s", k->string, NULL);
            goto out;
        }
    }
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    const cJSON *nullable = cJSON_GetObjectItemCaseSensitive(s, "nullable");
    if (nullable && !cJSON_IsBool(nullable)) {
        r = fail(c, ST_ERR_INVALID_ARG, "'nullable' must be a boolean%s%s", NULL, NULL);
        goto out;
    }
    int nul = cJSON_IsTrue(nullable);
    if (s != c->root && cJSON_GetObjectItemCaseSensitive(s, "$id")) {
        /* a $ref inside would resolve against this resource, not the root as quern's do */
        r = fail(c, ST_ERR_UNSUPPORTED,
                 "'$id' below the root is not supported (a $ref resolves against the root)%s%s",
                 NULL, NULL);
        goto out;
    }
    static const char *const types[] = {"string", "number", "integer", "boolean",
                                        "object", "array",  "null",    NULL};
    const cJSON *tv = cJSON_IsArray(type) ? type->child : type;
    for (; tv; tv = cJSON_IsArray(type) ? tv->next : NULL)
        if (cJSON_IsString(tv) && !listed(types, tv->valuestring)) {
            /* (before enum's "no value has the schema's type") */
            r = fail(c, ST_ERR_INVALID_ARG, "unknown type '%s'%s", tv->valuestring, NULL);
            goto out;
        }
    if (nul && (en || cn)) { /* JSON Schema: null is valid only when listed; OpenAPI agrees */
        r = fail(c, ST_ERR_UNSUPPORTED,
                 "'nullable' next to %s is not supported (list null among the values)%s",
                 en ? "enum" : "const", NULL);
        goto out;
    }
    if (cJSON_GetObjectItemCaseSensitive(s, "format") && type) {
        /* formats are string formats here: int32 or float on a number would go unchecked */
        int str = cJSON_IsString(type) && !strcmp(type->valuestring, "string");
        const cJSON *tt;
        if (cJSON_IsArray(type))
            cJSON_ArrayForEach(tt, type) str |=
                cJSON_IsString(tt) && !strcmp(tt->valuestring, "string");
        if (!str) {
            r = fail(c, ST_ERR_UNSUPPORTED,
                     "'format' on a type other than string is not supported%s%s", NULL, NULL);
            goto out;
        }
    }
    if ((ref != NULL) + (en != NULL) + (cn != NULL) + (any != NULL) > 1) {
        r = fail(c, ST_ERR_UNSUPPORTED,
                 "more than one of $ref, enum, const and anyOf in one "
                 "schema is not supported%s%s",
                 NULL, NULL);
        goto out;
    }
    if (en || cn || any) { /* their neighbours would be ignored: refuse them, as for $ref */
        for (const char *const *h = handled; *h; h++)
            if (kind_of(*h) && cJSON_GetObjectItemCaseSensitive(s, *h)) {
                r = fail(c, ST_ERR_UNSUPPORTED, "'%s' next to %s is not supported", *h,
                         en   ? "enum"
                         : cn ? "const"
                              : "anyOf");
                goto out;
            }
    }
    if (ref) {
        if (!cJSON_IsString(ref)) {
            r = fail(c, ST_ERR_INVALID_ARG, "'$ref' must be a string%s%s", NULL, NULL);
            goto out;
        }
        for (const char *const *h = handled; *h; h++)
            if (strcmp(*h, "$ref") && cJSON_GetObjectItemCaseSensitive(s, *h)) {
                r = fail(c, ST_ERR_UNSUPPORTED, "'%s' next to $ref is not supported%s", *h, NULL);
                goto out;
            }
        r = ref_rule(c, ref->valuestring);
        goto out;
    }
    r = engine_gb_rule(b);
    if (nul) {
        engine_gb_alt(b, r);
        engine_gb_lit(b, "null", 4);
    }
    if (en || cn) {
        const cJSON *vals = en ? en : cn;
        if (en && (!cJSON_IsArray(en) || !en->child)) {
            r = fail(c, ST_ERR_INVALID_ARG, "'enum' must be a non-empty array%s%s", NULL, NULL);
            goto out;
        }
        int n = 0;
        const cJSON *v = en ? en->child : cn;
        for (; v; v = en ? v->next : NULL) {
            int ok = !type;
            if (cJSON_IsString(type))
                ok = has_type(v, type->valuestring);
            const cJSON *t;
            if (cJSON_IsArray(type))
                cJSON_ArrayForEach(t, type) ok |= cJSON_IsString(t) && has_type(v, t->valuestring);
            if (!ok)
                continue;
            if (!add_alt(b, r, literal(c, v)))
                goto out;
            n++;
        }
        (void)vals;
        if (!n && !nul)
            r = fail(c, ST_ERR_INVALID_ARG, "no value of '%s' has the schema's type%s",
                     en ? "enum" : "const", NULL);
        goto out;
    }
    if (any) {
        if (type) {
            r = fail(c, ST_ERR_UNSUPPORTED, "'type' next to anyOf is not supported%s%s", NULL,
                     NULL);
            goto out;
        }
        if (!cJSON_IsArray(any) || !any->child) {
            r = fail(c, ST_ERR_INVALID_ARG, "'anyOf' must be a non-empty array%s%s", NULL, NULL);
            goto out;
        }
        int i = 0;
        const cJSON *sub;
        cJSON_ArrayForEach(sub, any)
        {
            size_t pl = path_push(c, "anyOf", 0);
            path_push(c, NULL, i++);
            int32_t x = compile(c, sub);
            c->path[pl] = 0;
            if (!add_alt(b, r, x)) {
                r = -1;
                goto out;
            }
        }
        goto out;
    }
    if (!type) { /* untyped: the one type its keywords constrain (values of the other types
                  * would be valid too: never written, so never wrong), else any value */
        const char *t = NULL, *kw = NULL;
        for (const char *const *h = handled; *h; h++) {
            const char *kt = kind_of(*h);
            if (!kt || !cJSON_GetObjectItemCaseSensitive(s, *h))
                continue;
            if (!strcmp(kt, "number")) {
                r = fail(c, ST_ERR_UNSUPPORTED,
                         "'%s' without 'type' is not supported (give \"integer\" or "
                         "\"number\")%s",
                         *h, NULL);
                goto out;
            }
            if (t && strcmp(t, kt)) {
                r = fail(c, ST_ERR_UNSUPPORTED,
                         "'%s' and '%s' (keywords of two types) without 'type' are not supported",
                         kw, *h);
                goto out;
            }
            t = kt;
            kw = *h;
        }
        if (!add_alt(b, r, t ? type_rule(c, s, t) : engine_gb_json_value(b)))
            r = -1;
        goto out;
    }
    if (!cJSON_IsString(type) && !(cJSON_IsArray(type) && type->child)) {
        r = fail(c, ST_ERR_INVALID_ARG, "'type' must be a string or a non-empty array%s%s", NULL,
                 NULL);
        goto out;
    }
    const cJSON *t = cJSON_IsString(type) ? type : type->child;
    for (; t; t = cJSON_IsString(type) ? NULL : t->next) {
        if (!cJSON_IsString(t)) {
            r = fail(c, ST_ERR_INVALID_ARG, "'type' must hold strings%s%s", NULL, NULL);
            goto out;
        }
        if (!add_alt(b, r, type_rule(c, s, t->valuestring))) {
            r = -1;
            goto out;
        }
    }
out:
    c->depth--;
    return c->st ? -1 : r;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A key that appears twice in one object anywhere in v (NULL: none; *oom on a failure to
 * allocate). cJSON keeps both and reads the first, Python's json the last: the schema would
 * mean one thing to quern and another to the user's validator. */
static const char *dup_key(const cJSON *v, int *oom)
{
    const cJSON *it;
    int n = 0;
    cJSON_ArrayForEach(it, v)
    {
        const char *d = dup_key(it, oom);
        if (d || *oom)
            return d;
        n++;
    }
    if (!cJSON_IsObject(v) || n < 2)
        return NULL;
    const char **k = malloc(sizeof(char *) * (size_t)n);
    if (!k) {
        *oom = 1;
        return NULL;
    }
    n = 0;
    cJSON_ArrayForEach(it, v) k[n++] = it->string;
    qsort(k, (size_t)n, sizeof(char *), cmp_str);
    const char *d = NULL;
    for (int i = 1; i < n && !d; i++)
        if (!strcmp(k[i - 1], k[i]))
            d = k[i];
    free(k);
    return d;
}

enum status job_schema_grammar(enum job_format format, const cJSON *schema,
                               struct engine_grammar **out, struct err_detail *err)
{
    *out = NULL;
    int oom = 0;
    const char *dup = format == JOB_FORMAT_JSON_SCHEMA ? dup_key(schema, &oom) : NULL;
    if (oom)
        return err_set(err, ST_ERR_NOMEM, "schema: out of memory");
    if (dup)
        return err_set(err, ST_ERR_INVALID_ARG, "schema: key '%.200s' appears twice in one object",
                       dup);
    struct sc c = {0};
    enum status st = engine_gb_new(&c.b, err);
    if (st)
        return st;
    c.root = schema;
    c.err = err;
    int32_t root = engine_gb_rule(c.b);
    int32_t body =
        format == JOB_FORMAT_JSON_OBJECT ? engine_gb_json_object(c.b) : compile(&c, schema);
    if (body < 0) {
        engine_gb_free(c.b);
        return c.st ? c.st : err_set(err, ST_ERR_INTERNAL, "schema: no grammar");
    }
    engine_gb_alt(c.b, root);
    engine_gb_ref(c.b, body);
    return engine_gb_finish(c.b, out, err);
}

enum status job_schema_grammar_text(enum job_format format, const char *schema_json,
                                    struct engine_grammar **out, struct err_detail *err)
{
    if (format == JOB_FORMAT_GRAMMAR)
        return job_gbnf_grammar(schema_json, out, err);
    cJSON *s = NULL;
    if (format == JOB_FORMAT_JSON_SCHEMA && !(s = cJSON_Parse(schema_json)))
        return err_set(err, ST_ERR_FORMAT, "schema: not JSON");
    enum status st = job_schema_grammar(format, s, out, err);
    cJSON_Delete(s);
    return st;
}
