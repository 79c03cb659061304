/* The grammar's insides, shared by engine/grammar_build.c (building), engine/grammar.c (the
 * automaton) and engine/grammar_mask.c (the vocabulary trie and token masks). Only they include
 * it. */
#ifndef ENGINE_GRAMMAR_INTERNAL_H
#define ENGINE_GRAMMAR_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/grammar.h"

struct gelem {
    int32_t ref;     /* rule referenced, or -1 for a byte set */
    uint32_t set[8]; /* the bytes matched (ref < 0): bit c of set[c / 32] */
};

/* An alternative being built: its rule and its elements. */
struct balt {
    int32_t rule;    /* owner */
    struct gelem *e; /* elements */
    int32_t n, cap;  /* used, allocated */
};

struct engine_gb {
    struct balt *alts;        /* every alternative made, in order */
    int32_t n_alts, cap_alts; /* used, allocated */
    int32_t n_rules;          /* rules made */
    int32_t cur;              /* alternative being appended to, -1 = none */
    int oom;                  /* an allocation failed: finish reports it */
    int too_big;              /* past ENGINE_GB_MAX_ALTS / _ELEMS: nothing more is kept */
    int32_t n_elems;          /* elements appended, over every alternative */
    int32_t json[11];         /* the shared JSON rules once made (-1 before) */
    char **names;             /* rule names for messages (engine_gb_name), n_names entries */
    int32_t n_names;
};

/* ---- the automaton (engine/grammar.c) and its masks (engine/grammar_mask.c) ---- */

/* A stack frame: at element idx of alternative alt; when that alternative ends, continue with
 * frame parent (-1: the input may end). Hash-consed: equal frames have one id. */
struct frame {
    int32_t alt, idx, parent;
};

struct state {
    int32_t off, n;    /* frames[off..off+n) in state_frames: sorted, each at a byte set */
    int accept;        /* the input may end here */
    int32_t *trans;    /* 256 next states (-2 = not computed yet), or NULL; then (same
                        * allocation) 256 uint16_t: each computed step's frame expansions,
                        * at most 65535 (engine_grammar_step_cost) */
    uint32_t *mask;    /* allowed tokens, or NULL */
    uint32_t wepoch;   /* the mask computation (mask_epoch) that last counted its steps */
    uint32_t wseen[8]; /* bytes whose step that computation counted already */
};

struct engine_grammar {
    int refs;
    /* rules, flattened */
    int32_t n_rules;
    int32_t *rule_alt;   /* n_rules + 1 offsets into alt_elem's alternatives */
    int32_t *alt_first;  /* per alternative: first element in elems */
    int32_t *alt_n;      /* per alternative: element count */
    struct gelem *elems;
    /* frames */
    struct frame *frames;
    int32_t n_frames, cap_frames;
    uint32_t *visit;     /* per frame: the closure (epoch) that last expanded it */
    uint32_t epoch;      /* the closure being computed */
    uint64_t n_expand;   /* frames expanded, over all closures (engine_grammar_expansions) */
    uint32_t n_closure;  /* frames expanded by the closure being computed */
    int32_t *fhash;      /* open addressing, frame id + 1 (0 = empty) */
    uint32_t fhash_cap;
    /* states */
    struct state *states;
    int32_t n_states, cap_states;
    int32_t *state_frames;
    size_t n_sf, cap_sf;
    int32_t *shash;      /* open addressing, state id + 1 */
    uint32_t shash_cap;
    int32_t start;
    /* scratch for building a state */
    int32_t *tmp;
    size_t n_tmp, cap_tmp;
    int tmp_accept;
    int oom;
    int too_many; /* the closure passed ENGINE_GRAMMAR_MAX_STACKS stacks or
                   * ENGINE_GRAMMAR_MAX_EXPAND expansions: it stops there */
    /* masks */
    const struct engine_vocab *vocab; /* the vocabulary the cached masks are for */
    size_t mask_bytes;
    uint64_t n_computed, n_cached, n_cut;
    uint32_t mask_epoch; /* mask computations begun (each state's wepoch refers to one) */
    int32_t *dfs;        /* trie walk stack: (node, state) pairs */
    size_t cap_dfs;
};

/* The frames expanded to compute the step from state s on byte c (saturated at 65535), once
 * engine_grammar_step(g, s, c) has been called; a function of (s, c) alone, whether the step was
 * computed now or earlier, so the masks' work bound does not depend on what else ran. */
uint32_t engine_grammar_step_cost(const struct engine_grammar *g, int32_t s, unsigned char c);

#endif
