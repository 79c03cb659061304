/* Constrained decoding: a context-free grammar over bytes, run as a pushdown automaton, and the
 * token masks that keep a model's output inside it (structured outputs: JSON objects, JSON
 * schemas).
 *
 * A grammar is built rule by rule (engine_gb_*): a rule is a list of alternatives, an
 * alternative a sequence of byte sets and references to rules. Rule 0 is the root. Left
 * recursion is refused when the grammar is finished (every cycle of references must consume a
 * byte first); right recursion is free (a reference in last position does not grow the stack).
 *
 * The automaton's stacks are hash-consed frames (rule, alternative, element, parent), so a
 * stack is one integer; a state is the sorted set of stacks that can read a byte next, plus
 * "the input may end here". States are interned and their transitions filled in lazily, one
 * byte at a time (a lazily determinised pushdown automaton), so a state seen again costs a table
 * lookup. A token's mask for a state comes from one walk of the vocabulary's byte trie through
 * those transitions, cached per state: a job whose requests share a schema computes each mask
 * once. End-of-generation tokens are allowed exactly where the input may end; tokens without
 * bytes (other control tokens) never are.
 *
 * Not thread-safe: the engine computes masks and advances states between forward passes, on
 * its own thread; the sampling threads only read the masks. */
#ifndef ENGINE_GRAMMAR_H
#define ENGINE_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

struct engine_tok;
struct engine_grammar;

/* ---- building --------------------------------------------------------------------------- */

struct engine_gb; /* a grammar being built */

enum status engine_gb_new(struct engine_gb **out, struct err_detail *err);
void engine_gb_free(struct engine_gb *b); /* NULL is a no-op */

/* A new rule without alternatives; returns its id (the first rule made is the root, 0). */
int32_t engine_gb_rule(struct engine_gb *b);
/* Name rule for error messages (copied; optional). */
void engine_gb_name(struct engine_gb *b, int32_t rule, const char *name);
/* Start a new (empty) alternative of rule; the appends below go to it. */
void engine_gb_alt(struct engine_gb *b, int32_t rule);
/* Append the bytes lo..hi (inclusive) as one element. */
void engine_gb_range(struct engine_gb *b, unsigned lo, unsigned hi);
/* Append one element matching any byte of set (256 bits, bit b of set[b / 32]). */
void engine_gb_set(struct engine_gb *b, const uint32_t set[8]);
/* Append one element matching any of the bytes of the NUL-terminated string chars. */
void engine_gb_chars(struct engine_gb *b, const char *chars);
/* Append the n bytes of s, one element each. */
void engine_gb_lit(struct engine_gb *b, const char *s, size_t n);
/* Append a reference to rule (which may be defined later). */
void engine_gb_ref(struct engine_gb *b, int32_t rule);
/* A builder takes at most ENGINE_GB_MAX_ALTS alternatives (and rules) and ENGINE_GB_MAX_ELEMS
 * elements; past either it keeps nothing more, engine_gb_full says so (a parser can stop
 * there), and engine_gb_finish refuses the grammar. A line's 16 MiB could otherwise ask for
 * gigabytes: a 220 KB GBNF of 20,000 alternatives "a"{256} took 4.8 s and 2.1 GB. JSON schemas
 * make a few hundred alternatives (at most 259 for tests/e2e/gen_schemas.py's 60). */
#define ENGINE_GB_MAX_ALTS  (1 << 18)
#define ENGINE_GB_MAX_ELEMS (1 << 20)
int engine_gb_full(const struct engine_gb *b);

/* Standard pieces for JSON grammars, each a rule made once per builder and shared:
 * ws (0 or 1 space, or a newline and up to 20 spaces/tabs: whitespace cannot run on forever),
 * a JSON string (any valid UTF-8 but '"', '\\' and controls, plus every JSON escape),
 * a JSON number, integer, and any JSON value / object (for json_object and untyped schemas). */
int32_t engine_gb_json_ws(struct engine_gb *b);
int32_t engine_gb_json_string(struct engine_gb *b);
int32_t engine_gb_json_string_char(struct engine_gb *b); /* one character of a string body */
int32_t engine_gb_utf8_multibyte(struct engine_gb *b);   /* one well-formed non-ASCII character */
int32_t engine_gb_json_number(struct engine_gb *b);
int32_t engine_gb_json_unsigned_number(struct engine_gb *b); /* a number without a sign */
int32_t engine_gb_json_digits(struct engine_gb *b);          /* [0-9]+ */
int32_t engine_gb_json_integer(struct engine_gb *b);
int32_t engine_gb_json_value(struct engine_gb *b);
int32_t engine_gb_json_object(struct engine_gb *b);
/* A new rule: a JSON array (object 0) of `value` items, or a JSON object (object 1) whose
 * members' values are `value` (any string keys). */
int32_t engine_gb_json_container(struct engine_gb *b, int object, int32_t value);

/* Finish: checks that every rule has an alternative and every reference a rule, and that no
 * rule can reach itself without reading a byte (left recursion). Consumes b (freed on every
 * path); *out is the grammar, refcount 1. */
enum status engine_gb_finish(struct engine_gb *b, struct engine_grammar **out,
                             struct err_detail *err);

/* ---- running ---------------------------------------------------------------------------- */

struct engine_grammar;

/* References: a grammar is shared by the requests that use it (engine_request.grammar). */
void engine_grammar_ref(struct engine_grammar *g);
void engine_grammar_unref(struct engine_grammar *g); /* frees at zero; NULL is a no-op */

#define ENGINE_GRAMMAR_DEAD (-1) /* no state: the input cannot continue */

/* The start state. */
int32_t engine_grammar_start(struct engine_grammar *g);
/* The state after reading byte c in state s, or ENGINE_GRAMMAR_DEAD; ENGINE_GRAMMAR_DEAD also
 * when the grammar's state limit (ENGINE_GRAMMAR_MAX_STATES) is reached. */
int32_t engine_grammar_step(struct engine_grammar *g, int32_t s, unsigned char c);
/* The state after reading bytes p[0..n) from s (ENGINE_GRAMMAR_DEAD if any step is). */
int32_t engine_grammar_feed(struct engine_grammar *g, int32_t s, const char *p, size_t n);
/* 1 when the input may end in state s. */
int engine_grammar_accepting(const struct engine_grammar *g, int32_t s);
/* 1 when state s can read no further byte (the input must end). */
int engine_grammar_final(struct engine_grammar *g, int32_t s);
/* Frames expanded so far, over every closure computed (work done; tests bound it). */
uint64_t engine_grammar_expansions(const struct engine_grammar *g);
/* States interned so far. */
int32_t engine_grammar_n_states(const struct engine_grammar *g);

#define ENGINE_GRAMMAR_MAX_STATES 200000
/* Most stacks alive in one state: an ambiguous grammar (".+++", nested repetitions) can keep
 * exponentially many parses alive; a step past this is ENGINE_GRAMMAR_DEAD, so a grammar
 * never costs more than this per byte. */
#define ENGINE_GRAMMAR_MAX_STACKS 4096
/* Most frames one closure expands: nested repetitions of nullable items ("x?{200}?{200}") can
 * reach millions of distinct frames that end at few byte sets, so the stack bound alone does
 * not bound the work; a closure past this is ENGINE_GRAMMAR_DEAD as well (engine_gb_finish
 * refuses a grammar whose start passes either bound). */
#define ENGINE_GRAMMAR_MAX_EXPAND 65536

/* The vocabulary as the masks see it: each token's bytes in a trie, the end-of-generation ids. */
struct engine_vocab;
enum status engine_vocab_new(struct engine_vocab **out, const struct engine_tok *tok,
                             int32_t n_logits, struct err_detail *err);
void engine_vocab_free(struct engine_vocab *v); /* NULL is a no-op */

/* The allowed tokens in state s: a bitmap of n_logits bits (bit t of word t / 32), cached with
 * the state and valid until engine_grammar_trim(g). NULL when out of memory. The work of a mask
 * is what computing it from a cold grammar costs: the expansions (engine_grammar_step_cost) of
 * every distinct (state, byte) step its walk of the vocabulary takes, counted whether the step
 * was cached or not, so it depends on the state alone (not on what other requests computed)
 * and hardly on the vocabulary's size. Past ENGINE_GRAMMAR_MASK_WORK the walk stops and the
 * mask allows no token at all (the request ends as for a dead state; a partial mask would bias
 * the draw). Measured (2026-12-05), random walks of 200 tokens through the 60 schemas of
 * `tests/e2e/gen_schemas.py 60 7`: at most 16,600 on the default model's 49k vocabulary, 56,000
 * on Gemma 3's 262k; "[^\n]* \"!\" | [^\n]* \"?\" | ..." and unions of objects sharing a first
 * property under 45,000; "([a-z ]?{100}){40}"'s first mask 9.2M (0.45 s on its own). Counting
 * every step taken instead of every distinct one grew with the vocabulary (7.7M inside a JSON
 * string on Gemma) and cut ordinary masks there. */
const uint32_t *engine_grammar_mask(struct engine_grammar *g, int32_t s,
                                    const struct engine_vocab *v);
/* Drop the cached masks when they hold more than ENGINE_GRAMMAR_MASK_BYTES (called before a
 * step's masks are taken, so none in use is freed). */
void engine_grammar_trim(struct engine_grammar *g);

#define ENGINE_GRAMMAR_MASK_BYTES ((size_t)64 << 20)
#define ENGINE_GRAMMAR_MASK_WORK  (1u << 21)

/* Mask computations (cache misses) and lookups since the grammar was made. */
void engine_grammar_counts(const struct engine_grammar *g, uint64_t *computed, uint64_t *cached);
/* Masks cut short by ENGINE_GRAMMAR_MASK_WORK (each allows no token) since it was made. */
uint64_t engine_grammar_masks_cut(const struct engine_grammar *g);

#endif
