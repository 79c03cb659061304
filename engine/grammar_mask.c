/* The vocabulary as a byte trie, and the token masks of grammar states: one walk of the trie
 * through the automaton's transitions per state, cached with the state (engine/grammar.h). */
#include "engine/grammar_internal.h"

#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"

/* ---- vocabulary trie and masks ----------------------------------------------------------- */

struct trie_node {
    int32_t child;   /* first child, -1 none */
    int32_t sibling; /* next sibling, -1 none */
    int32_t tok;     /* first token ending here (index into tok_next chain), -1 none */
    unsigned char byte;
};

struct engine_vocab {
    struct trie_node *nodes;
    int32_t n_nodes, cap_nodes;
    int32_t *tok_next; /* per token: the next token ending at the same node, -1 */
    int32_t *eog;      /* end-of-generation ids */
    int32_t n_eog;
    int32_t n_logits;
};

static int32_t trie_child(struct engine_vocab *v, int32_t n, unsigned char c)
{
    int32_t *link = &v->nodes[n].child;
    while (*link >= 0 && v->nodes[*link].byte < c)
        link = &v->nodes[*link].sibling;
    if (*link >= 0 && v->nodes[*link].byte == c)
        return *link;
    if (v->n_nodes == v->cap_nodes) {
        int32_t cap = 2 * v->cap_nodes;
        struct trie_node *nn = realloc(v->nodes, sizeof(*nn) * (size_t)cap);
        if (!nn)
            return -1;
        link = (int32_t *)((char *)nn + ((char *)link - (char *)v->nodes));
        v->nodes = nn;
        v->cap_nodes = cap;
    }
    int32_t k = v->n_nodes++;
    v->nodes[k] = (struct trie_node){-1, *link, -1, c};
    *link = k;
    return k;
}

enum status engine_vocab_new(struct engine_vocab **out, const struct engine_tok *tok,
                             int32_t n_logits, struct err_detail *err)
{
    *out = NULL;
    struct engine_vocab *v = calloc(1, sizeof(*v));
    int32_t n_tok = engine_tok_n_vocab(tok);
    if (n_tok > n_logits)
        n_tok = n_logits;
    size_t cap = engine_tok_max_piece(tok) + 1;
    char *buf = malloc(cap);
    if (v) {
        v->n_logits = n_logits;
        v->cap_nodes = 1024;
        v->nodes = malloc(sizeof(*v->nodes) * (size_t)v->cap_nodes);
        v->tok_next = malloc(sizeof(int32_t) * (size_t)(n_tok + 1));
        v->eog = malloc(sizeof(int32_t) * (size_t)(n_tok + 1));
    }
    if (!v || !buf || !v->nodes || !v->tok_next || !v->eog)
        goto oom;
    v->nodes[0] = (struct trie_node){-1, -1, -1, 0};
    v->n_nodes = 1;
    for (int32_t id = 0; id < n_tok; id++) {
        v->tok_next[id] = -1;
        if (engine_tok_is_eog(tok, id)) {
            v->eog[v->n_eog++] = id;
            continue;
        }
        size_t n = engine_tok_piece(tok, id, 0, buf, cap);
        if (n == 0 || n > cap)
            continue; /* control tokens: no bytes, never allowed */
        int32_t node = 0;
        for (size_t i = 0; i < n && node >= 0; i++)
            node = trie_child(v, node, (unsigned char)buf[i]);
        if (node < 0)
            goto oom;
        v->tok_next[id] = v->nodes[node].tok;
        v->nodes[node].tok = id;
    }
    free(buf);
    *out = v;
    return ST_OK;
oom:
    free(buf);
    engine_vocab_free(v);
    return err_set(err, ST_ERR_NOMEM, "grammar vocabulary: out of memory");
}

void engine_vocab_free(struct engine_vocab *v)
{
    if (!v)
        return;
    free(v->nodes);
    free(v->tok_next);
    free(v->eog);
    free(v);
}

void engine_grammar_trim(struct engine_grammar *g)
{
    if (g->mask_bytes <= ENGINE_GRAMMAR_MASK_BYTES)
        return;
    for (int32_t i = 0; i < g->n_states; i++) {
        free(g->states[i].mask);
        g->states[i].mask = NULL;
    }
    g->mask_bytes = 0;
}

const uint32_t *engine_grammar_mask(struct engine_grammar *g, int32_t s,
                                    const struct engine_vocab *v)
{
    if (s < 0)
        return NULL;
    if (g->vocab != v) { /* masks are per vocabulary */
        for (int32_t i = 0; i < g->n_states; i++) {
            free(g->states[i].mask);
            g->states[i].mask = NULL;
        }
        g->mask_bytes = 0;
        g->vocab = v;
    }
    if (g->states[s].mask) {
        g->n_cached++;
        return g->states[s].mask;
    }
    const size_t words = ((size_t)v->n_logits + 31) / 32;
    uint32_t *m = calloc(words, sizeof(uint32_t));
    if (!m)
        return NULL;
    size_t sp = 0;
    int failed = 0;
#define DFS_PUSH(node_, st_)                                                                       \
    do {                                                                                           \
        if (sp + 2 > g->cap_dfs) {                                                                 \
            size_t c_ = g->cap_dfs ? 2 * g->cap_dfs : 4096;                                        \
            int32_t *d_ = realloc(g->dfs, sizeof(int32_t) * c_);                                   \
            if (!d_) {                                                                             \
                failed = 1;                                                                        \
                break;                                                                             \
            }                                                                                      \
            g->dfs = d_;                                                                           \
            g->cap_dfs = c_;                                                                       \
        }                                                                                          \
        g->dfs[sp++] = (node_);                                                                    \
        g->dfs[sp++] = (st_);                                                                      \
    } while (0)
    /* the work: the expansions of every distinct step the walk takes, cached or not
     * (engine_grammar_step_cost) -- what computing this mask from a cold grammar costs, a
     * function of the state alone */
    uint64_t work = 0;
    int cut = 0;
    const uint32_t epoch = ++g->mask_epoch;
    DFS_PUSH(0, s);
    while (sp && !failed && !cut) {
        int32_t st = g->dfs[--sp], node = g->dfs[--sp];
        for (int32_t t = v->nodes[node].tok; t >= 0; t = v->tok_next[t])
            m[t >> 5] |= 1u << (t & 31);
        for (int32_t c = v->nodes[node].child; c >= 0 && !failed; c = v->nodes[c].sibling) {
            const unsigned char byte = v->nodes[c].byte;
            int32_t nx = engine_grammar_step(g, st, byte);
            struct state *ts = &g->states[st]; /* (after the step: interning may move them) */
            if (ts->wepoch != epoch) {
                ts->wepoch = epoch;
                memset(ts->wseen, 0, sizeof(ts->wseen));
            }
            if (!(ts->wseen[byte >> 5] >> (byte & 31) & 1)) {
                ts->wseen[byte >> 5] |= 1u << (byte & 31);
                work += engine_grammar_step_cost(g, st, byte);
            }
            if (nx >= 0)
                DFS_PUSH(c, nx);
        }
        cut = work > ENGINE_GRAMMAR_MASK_WORK;
    }
#undef DFS_PUSH
    if (failed) {
        free(m);
        return NULL;
    }
    if (cut) { /* too costly to follow: nothing is allowed (a partial mask would bias the draw) */
        memset(m, 0, words * sizeof(uint32_t));
        g->n_cut++;
    } else if (g->states[s].accept)
        for (int32_t i = 0; i < v->n_eog; i++)
            m[v->eog[i] >> 5] |= 1u << (v->eog[i] & 31);
    g->states[s].mask = m;
    g->mask_bytes += words * sizeof(uint32_t);
    g->n_computed++;
    return m;
}

void engine_grammar_counts(const struct engine_grammar *g, uint64_t *computed, uint64_t *cached)
{
    *computed = g->n_computed;
    *cached = g->n_cached;
}

uint64_t engine_grammar_masks_cut(const struct engine_grammar *g)
{
    return g->n_cut;
}
