/* Byte grammars run as a lazily determinised pushdown automaton, and their token masks
 * (engine/grammar.h); the builder is engine/grammar_build.c. */
#include "engine/grammar_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the grammar and its automaton ------------------------------------------------------- */

static uint32_t mix32(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    return h ^ (h >> 16);
}

static uint32_t frame_hash(const struct frame *f)
{
    return mix32((uint32_t)f->alt * 0x9e3779b1u ^ mix32((uint32_t)f->idx + 0x85ebca6bu) ^
                 mix32((uint32_t)f->parent * 0xc2b2ae35u + 1u));
}

static int grow_hash(int32_t **tab, uint32_t *cap, int32_t n, uint32_t (*hash)(void *, int32_t),
                     void *ctx)
{
    if ((uint32_t)(n + 1) * 2 < *cap)
        return 0;
    uint32_t nc = *cap ? *cap * 2 : 1024;
    int32_t *t = calloc(nc, sizeof(int32_t));
    if (!t)
        return -1;
    for (int32_t i = 0; i < n; i++) {
        uint32_t h = hash(ctx, i) & (nc - 1);
        while (t[h])
            h = (h + 1) & (nc - 1);
        t[h] = i + 1;
    }
    free(*tab);
    *tab = t;
    *cap = nc;
    return 0;
}

static uint32_t frame_hash_at(void *ctx, int32_t i)
{
    return frame_hash(&((struct engine_grammar *)ctx)->frames[i]);
}

/* The id of frame (alt, idx, parent), made if new; -2 when out of memory. */
static int32_t frame_id(struct engine_grammar *g, int32_t alt, int32_t idx, int32_t parent)
{
    struct frame f = {alt, idx, parent};
    if (grow_hash(&g->fhash, &g->fhash_cap, g->n_frames, frame_hash_at, g))
        return -2;
    uint32_t h = frame_hash(&f) & (g->fhash_cap - 1);
    while (g->fhash[h]) {
        const struct frame *o = &g->frames[g->fhash[h] - 1];
        if (o->alt == alt && o->idx == idx && o->parent == parent)
            return g->fhash[h] - 1;
        h = (h + 1) & (g->fhash_cap - 1);
    }
    if (g->n_frames == g->cap_frames) {
        int32_t cap = g->cap_frames ? 2 * g->cap_frames : 256;
        struct frame *nf = realloc(g->frames, sizeof(*nf) * (size_t)cap);
        if (!nf)
            return -2;
        g->frames = nf;
        uint32_t *nv = realloc(g->visit, sizeof(*nv) * (size_t)cap);
        if (!nv)
            return -2;
        memset(nv + g->cap_frames, 0, sizeof(*nv) * (size_t)(cap - g->cap_frames));
        g->visit = nv;
        g->cap_frames = cap;
    }
    g->frames[g->n_frames] = f;
    g->fhash[h] = ++g->n_frames;
    return g->n_frames - 1;
}

static void tmp_push(struct engine_grammar *g, int32_t v)
{
    if (g->n_tmp >= ENGINE_GRAMMAR_MAX_STACKS) {
        g->too_many = 1;
        return;
    }
    if (g->n_tmp == g->cap_tmp) {
        size_t cap = g->cap_tmp ? 2 * g->cap_tmp : 64;
        int32_t *t = realloc(g->tmp, sizeof(int32_t) * cap);
        if (!t) {
            g->oom = 1;
            return;
        }
        g->tmp = t;
        g->cap_tmp = cap;
    }
    g->tmp[g->n_tmp++] = v;
}

static void expand(struct engine_grammar *g, int32_t f, int depth);

/* Continue with frame c (-1: the input may end here). */
static void cont(struct engine_grammar *g, int32_t c, int depth)
{
    if (c == -1)
        g->tmp_accept = 1;
    else
        expand(g, c, depth);
}

/* The frame after f's current element: the next element of its alternative, or its parent. */
static int32_t next_frame(struct engine_grammar *g, int32_t f)
{
    const struct frame fr = g->frames[f];
    if (fr.idx + 1 < g->alt_n[fr.alt])
        return frame_id(g, fr.alt, fr.idx + 1, fr.parent);
    return fr.parent;
}

/* Add to tmp every frame reachable from f without reading a byte that stands at a byte set. */
static void expand(struct engine_grammar *g, int32_t f, int depth)
{
    if (f < 0 || depth > 10000) {
        g->oom |= f == -2 || depth > 10000;
        return;
    }
    /* a frame's closure depends on the frame alone: once per closure is enough (without this,
     * chains of optional items re-expanded what follows them once per path: exponential) */
    if (g->visit[f] == g->epoch || g->too_many)
        return;
    g->visit[f] = g->epoch;
    g->n_expand++;
    if (++g->n_closure > ENGINE_GRAMMAR_MAX_EXPAND) {
        g->too_many = 1;
        return;
    }
    const struct frame fr = g->frames[f];
    const struct gelem *e = &g->elems[g->alt_first[fr.alt] + fr.idx];
    if (e->ref < 0) {
        tmp_push(g, f);
        return;
    }
    int32_t c = next_frame(g, f);
    if (c == -2) {
        g->oom = 1;
        return;
    }
    for (int32_t a = g->rule_alt[e->ref]; a < g->rule_alt[e->ref + 1]; a++) {
        if (g->alt_n[a] == 0)
            cont(g, c, depth + 1);
        else
            expand(g, frame_id(g, a, 0, c), depth + 1);
    }
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static uint32_t state_hash_of(const int32_t *f, int32_t n, int accept)
{
    uint32_t h = 0x12345u + (uint32_t)accept;
    for (int32_t i = 0; i < n; i++)
        h = mix32(h ^ ((uint32_t)f[i] + 0x9e3779b9u));
    return h;
}

static uint32_t state_hash_at(void *ctx, int32_t i)
{
    struct engine_grammar *g = ctx;
    const struct state *s = &g->states[i];
    return state_hash_of(g->state_frames + s->off, s->n, s->accept);
}

/* Intern the state in tmp (sorted, deduplicated here); its id, or DEAD when it is empty, out
 * of memory or over the state limit. */
static int32_t intern(struct engine_grammar *g)
{
    if (g->oom)
        return ENGINE_GRAMMAR_DEAD;
    g->oom = 1; /* until the state is found or made: a failure below is not "no state" */
    if (g->n_tmp) /* tmp may be NULL while empty: no library call gets it */
        qsort(g->tmp, g->n_tmp, sizeof(int32_t), cmp_i32);
    size_t n = 0;
    for (size_t i = 0; i < g->n_tmp; i++)
        if (!n || g->tmp[i] != g->tmp[n - 1])
            g->tmp[n++] = g->tmp[i];
    g->n_tmp = n;
    if (!n && !g->tmp_accept) {
        g->oom = 0;
        return ENGINE_GRAMMAR_DEAD;
    }
    if (grow_hash(&g->shash, &g->shash_cap, g->n_states, state_hash_at, g))
        return ENGINE_GRAMMAR_DEAD;
    uint32_t h = state_hash_of(g->tmp, (int32_t)n, g->tmp_accept) & (g->shash_cap - 1);
    while (g->shash[h]) {
        const struct state *s = &g->states[g->shash[h] - 1];
        if (s->n == (int32_t)n && s->accept == g->tmp_accept &&
            (!n || !memcmp(g->state_frames + s->off, g->tmp, sizeof(int32_t) * n))) {
            g->oom = 0;
            return g->shash[h] - 1;
        }
        h = (h + 1) & (g->shash_cap - 1);
    }
    if (g->n_states >= ENGINE_GRAMMAR_MAX_STATES)
        return ENGINE_GRAMMAR_DEAD;
    if (g->n_states == g->cap_states) {
        int32_t cap = g->cap_states ? 2 * g->cap_states : 256;
        struct state *ns = realloc(g->states, sizeof(*ns) * (size_t)cap);
        if (!ns)
            return ENGINE_GRAMMAR_DEAD;
        g->states = ns;
        g->cap_states = cap;
    }
    if (g->n_sf + n > g->cap_sf || !g->state_frames) { /* never NULL once a state exists */
        size_t cap = (g->n_sf + n) * 2 + 256;
        int32_t *nf = realloc(g->state_frames, sizeof(int32_t) * cap);
        if (!nf)
            return ENGINE_GRAMMAR_DEAD;
        g->state_frames = nf;
        g->cap_sf = cap;
    }
    if (n)
        memcpy(g->state_frames + g->n_sf, g->tmp, sizeof(int32_t) * n);
    g->states[g->n_states] =
        (struct state){.off = (int32_t)g->n_sf, .n = (int32_t)n, .accept = g->tmp_accept};
    g->n_sf += n;
    g->shash[h] = ++g->n_states;
    g->oom = 0;
    return g->n_states - 1;
}

int32_t engine_grammar_start(struct engine_grammar *g)
{
    return g->start;
}

int32_t engine_grammar_step(struct engine_grammar *g, int32_t s, unsigned char c)
{
    if (s < 0)
        return ENGINE_GRAMMAR_DEAD;
    struct state *st = &g->states[s];
    if (!st->trans) {
        if (!(st->trans = malloc(sizeof(int32_t) * 256 + sizeof(uint16_t) * 256)))
            return ENGINE_GRAMMAR_DEAD;
        for (int i = 0; i < 256; i++)
            st->trans[i] = -2;
    }
    if (st->trans[c] != -2)
        return st->trans[c];
    g->n_tmp = 0;
    g->tmp_accept = 0;
    g->oom = 0;
    g->too_many = 0;
    g->epoch++; /* a new closure */
    g->n_closure = 0;
    for (int32_t i = 0; i < st->n; i++) {
        int32_t f = g->state_frames[st->off + i];
        const struct frame fr = g->frames[f];
        const struct gelem *e = &g->elems[g->alt_first[fr.alt] + fr.idx];
        if (e->set[c >> 5] >> (c & 31) & 1) {
            int32_t nx = next_frame(g, f);
            if (nx == -2)
                g->oom = 1;
            else
                cont(g, nx, 0);
        }
    }
    int32_t r = g->too_many ? ENGINE_GRAMMAR_DEAD : intern(g);
    if (!g->oom) { /* a failure to allocate (or the state limit) is not remembered as "dead" */
        g->states[s].trans[c] = r;
        const uint32_t cost = g->n_closure;
        ((uint16_t *)(g->states[s].trans + 256))[c] = (uint16_t)(cost < 65535 ? cost : 65535);
    }
    g->oom = 0;
    return r;
}

uint32_t engine_grammar_step_cost(const struct engine_grammar *g, int32_t s, unsigned char c)
{
    const struct state *st = &g->states[s];
    if (!st->trans || st->trans[c] == -2) /* not remembered: the closure just computed */
        return g->n_closure < 65535 ? g->n_closure : 65535;
    return ((const uint16_t *)(st->trans + 256))[c];
}

int32_t engine_grammar_feed(struct engine_grammar *g, int32_t s, const char *p, size_t n)
{
    for (size_t i = 0; i < n && s >= 0; i++)
        s = engine_grammar_step(g, s, (unsigned char)p[i]);
    return s;
}

int engine_grammar_accepting(const struct engine_grammar *g, int32_t s)
{
    return s >= 0 && g->states[s].accept;
}

int engine_grammar_final(struct engine_grammar *g, int32_t s)
{
    return s >= 0 && g->states[s].n == 0;
}

uint64_t engine_grammar_expansions(const struct engine_grammar *g) { return g->n_expand; }

int32_t engine_grammar_n_states(const struct engine_grammar *g)
{
    return g->n_states;
}

void engine_grammar_ref(struct engine_grammar *g)
{
    g->refs++;
}

void engine_grammar_unref(struct engine_grammar *g)
{
    if (!g || --g->refs > 0)
        return;
    for (int32_t i = 0; i < g->n_states; i++) {
        free(g->states[i].trans);
        free(g->states[i].mask);
    }
    free(g->states);
    free(g->state_frames);
    free(g->shash);
    free(g->frames);
    free(g->visit);
    free(g->fhash);
    free(g->rule_alt);
    free(g->alt_first);
    free(g->alt_n);
    free(g->elems);
    free(g->tmp);
    free(g->dfs);
    free(g);
}

/* ---- finishing: checks, flattening ------------------------------------------------------- */

/* Left recursion: a rule that reaches itself through first elements that read nothing, found
 * from r (depth first); returns it, or -1. */
static int32_t left_cycle(const struct engine_grammar *g, const uint8_t *nullable, int32_t r,
                          uint8_t *mark)
{
    if (mark[r] == 1)
        return r;
    if (mark[r] == 2)
        return -1;
    mark[r] = 1;
    for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++)
        for (int32_t i = 0; i < g->alt_n[a]; i++) {
            const struct gelem *e = &g->elems[g->alt_first[a] + i];
            if (e->ref < 0)
                break;
            int32_t c = left_cycle(g, nullable, e->ref, mark);
            if (c >= 0)
                return c;
            if (!nullable[e->ref])
                break;
        }
    mark[r] = 2;
    return -1;
}

/* "'name'" when the builder named rule r, else its number. */
static const char *rule_name(const struct engine_gb *b, int32_t r, char buf[80])
{
    if (r < b->n_names && b->names[r])
        snprintf(buf, 80, "'%.60s'", b->names[r]);
    else
        snprintf(buf, 80, "%d", r);
    return buf;
}

enum status engine_gb_finish(struct engine_gb *b, struct engine_grammar **out,
                             struct err_detail *err)
{
    char nm[80];
    *out = NULL;
    enum status st = ST_OK;
    struct engine_grammar *g = NULL;
    uint8_t *nullable = NULL, *mark = NULL;
    if (b->too_big) {
        st = err_set(err, ST_ERR_INVALID_ARG,
                     "grammar: too large (more than %d alternatives or %d elements)",
                     ENGINE_GB_MAX_ALTS, ENGINE_GB_MAX_ELEMS);
        goto done;
    }
    if (b->oom || !b->n_rules) {
        st = err_set(err, b->oom ? ST_ERR_NOMEM : ST_ERR_INVALID_ARG,
                     b->oom ? "grammar: out of memory" : "grammar: no rules");
        goto done;
    }
    g = calloc(1, sizeof(*g));
    if (!g)
        goto oom;
    g->refs = 1;
    g->n_rules = b->n_rules;
    size_t n_el = 0;
    for (int32_t a = 0; a < b->n_alts; a++)
        n_el += (size_t)b->alts[a].n;
    g->rule_alt = calloc((size_t)b->n_rules + 1, sizeof(int32_t));
    g->alt_first = malloc(sizeof(int32_t) * ((size_t)b->n_alts + 1));
    g->alt_n = malloc(sizeof(int32_t) * ((size_t)b->n_alts + 1));
    g->elems = malloc(sizeof(struct gelem) * (n_el + 1));
    nullable = calloc((size_t)b->n_rules, 1);
    mark = calloc((size_t)b->n_rules, 1);
    if (!g->rule_alt || !g->alt_first || !g->alt_n || !g->elems || !nullable || !mark)
        goto oom;
    /* alternatives grouped by rule, in the order they were made */
    for (int32_t a = 0; a < b->n_alts; a++)
        g->rule_alt[b->alts[a].rule + 1]++;
    for (int32_t r = 0; r < b->n_rules; r++) {
        if (!g->rule_alt[r + 1]) {
            st = err_set(err, ST_ERR_INVALID_ARG, "rule %s has no alternative", rule_name(b, r, nm));
            goto done;
        }
        g->rule_alt[r + 1] += g->rule_alt[r];
    }
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)b->n_rules);
    if (!pos)
        goto oom;
    memcpy(pos, g->rule_alt, sizeof(int32_t) * (size_t)b->n_rules);
    size_t e = 0;
    int32_t *order = malloc(sizeof(int32_t) * ((size_t)b->n_alts + 1));
    if (!order) {
        free(pos);
        goto oom;
    }
    for (int32_t a = 0; a < b->n_alts; a++)
        order[pos[b->alts[a].rule]++] = a;
    free(pos);
    for (int32_t k = 0; k < b->n_alts; k++) {
        const struct balt *ba = &b->alts[order[k]];
        g->alt_first[k] = (int32_t)e;
        g->alt_n[k] = ba->n;
        for (int32_t i = 0; i < ba->n; i++) {
            if (ba->e[i].ref >= b->n_rules) {
                free(order);
                st = err_set(err, ST_ERR_INVALID_ARG, "reference to rule %d of %d",
                             ba->e[i].ref, b->n_rules);
                goto done;
            }
            g->elems[e++] = ba->e[i];
        }
    }
    free(order);
    /* nullable rules (fixpoint), then no left recursion */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t r = 0; r < g->n_rules; r++)
            for (int32_t a = g->rule_alt[r]; !nullable[r] && a < g->rule_alt[r + 1]; a++) {
                int32_t i = 0;
                while (i < g->alt_n[a] && g->elems[g->alt_first[a] + i].ref >= 0 &&
                       nullable[g->elems[g->alt_first[a] + i].ref])
                    i++;
                if (i == g->alt_n[a])
                    nullable[r] = changed = 1;
            }
    }
    for (int32_t r = 0; r < g->n_rules; r++)
        mark[r] = 0;
    for (int32_t r = 0, c; r < g->n_rules; r++)
        if ((c = left_cycle(g, nullable, r, mark)) >= 0) {
            r = c;
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "rule %s is left-recursive (reaches itself without reading)",
                         rule_name(b, r, nm));
            goto done;
        }
    g->epoch++; /* the start state's closure */
    /* the start state: every alternative of the root */
    g->tmp_accept = 0;
    for (int32_t a = g->rule_alt[0]; a < g->rule_alt[1]; a++) {
        if (g->alt_n[a] == 0)
            g->tmp_accept = 1;
        else
            expand(g, frame_id(g, a, 0, -1), 0);
    }
    if (g->too_many) { /* a start state cut short would accept less than the grammar says */
        st = err_set(err, ST_ERR_INVALID_ARG,
                     "the grammar is too ambiguous: its start alone needs more than %d parse "
                     "stacks or %d expansions",
                     ENGINE_GRAMMAR_MAX_STACKS, ENGINE_GRAMMAR_MAX_EXPAND);
        goto done;
    }
    g->start = intern(g);
    if (g->start < 0) {
        if (!g->oom) {
            st = err_set(err, ST_ERR_INVALID_ARG, "the grammar accepts nothing");
            goto done;
        }
        goto oom;
    }
    goto done;
oom:
    st = err_set(err, ST_ERR_NOMEM, "grammar: out of memory");
done:
    free(nullable);
    free(mark);
    engine_gb_free(b);
    if (st)
        engine_grammar_unref(g);
    else
        *out = g;
    return st;
}
