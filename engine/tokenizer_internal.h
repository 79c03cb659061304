/* Private parts of the tokenizer shared by engine/tokenizer.c (loading),
 * engine/tokenizer_encode.c and engine/tokenizer_decode.c: struct engine_tok and its lookups. */
#ifndef ENGINE_TOKENIZER_INTERNAL_H
#define ENGINE_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "engine/tokenizer.h"

/* How a token behaves, derived from tokenizer.ggml.token_type. */
enum tok_kind {
    TOK_KIND_NORMAL = 0, /* text is byte-level encoded; produced by BPE */
    TOK_KIND_CONTROL,    /* control or unknown: literal text, parsed only on request */
    TOK_KIND_USER,       /* user-defined: literal text, always parsed and printed */
    TOK_KIND_UNUSED,     /* unused slot: never parsed, prints nothing */
    TOK_KIND_BYTE,       /* SentencePiece byte-fallback token <0xXX>: its text is that byte */
};

/* One merge rule in the open-addressing pair table. */
struct tok_merge {
    uint64_t key;   /* (left id << 32) | right id; TOK_EMPTY_KEY when the slot is free */
    int32_t rank;   /* priority: lower merges first (index in tokenizer.ggml.merges) */
    int32_t merged; /* id of the concatenated token */
};

#define TOK_EMPTY_KEY UINT64_MAX

struct engine_tok {
    int32_t n_vocab;          /* number of tokens */
    char *text;               /* all token texts back to back (decoded for normal tokens) */
    uint32_t *text_off;       /* n_vocab + 1 offsets into text */
    uint8_t *kind;            /* n_vocab enum tok_kind values */
    int32_t *text_map;        /* open-addressing table of ids keyed by (text, is_normal) */
    uint32_t text_map_mask;   /* table size - 1 (power of two) */
    struct tok_merge *merges; /* open-addressing pair table */
    uint32_t merge_mask;      /* table size - 1 (power of two) */
    int32_t byte_id[256];     /* the single-byte token for each byte value, or -1 */
    int32_t *special;         /* control + user-defined ids, longest text first */
    size_t n_special;         /* entries in special */
    int32_t eog[16];          /* end-of-generation ids */
    size_t n_eog;             /* entries in eog */
    int32_t bos;              /* beginning of sequence, -1 if none */
    int32_t eos;              /* end of sequence, -1 if none */
    int add_bos;              /* tokenizer.ggml.add_bos_token */
    size_t max_piece;         /* longest token text in bytes */
    pcre2_code *re_digit;     /* \p{N}: splits digits one by one; NULL when not used */
    pcre2_code *re_words;     /* the pre-tokenizer's word regex (BPE) */
    int whole_words;          /* a word that is a token as a whole is that token, whatever the
                               * merges would make of it (Hugging Face's ignore_merges: Llama
                               * 3; tiktoken looks words up first: tekken) */
    /* SentencePiece (tokenizer.ggml.model "llama"; spm = 1): merges by score instead of by
     * rank, over the GGUF's own token texts (U+2581 for spaces), looked up in raw_map */
    int spm;                  /* 1: SentencePiece, 0: byte-level BPE */
    int spm_space_prefix;     /* tokenizer.ggml.add_space_prefix (default 1) */
    int32_t unk;              /* unknown token, -1 if none */
    float *score;             /* n_vocab scores: higher merges first */
    char *raw;                /* the GGUF texts back to back */
    uint32_t *raw_off;        /* n_vocab + 1 offsets into raw */
    int32_t *raw_map;         /* open-addressing table of ids keyed by raw text */
    uint32_t raw_map_mask;    /* table size - 1 */
};

/* Append id to the growing array *v (*n used, *cap allocated). */
enum status engine_tok_push(int32_t **v, size_t *n, size_t *cap, int32_t id,
                            struct err_detail *err);

/* Id of the token whose GGUF text is s[0..n) (SentencePiece vocabularies), or -1. */
int32_t engine_tok_raw_find(const struct engine_tok *t, const char *s, size_t n);

/* The byte-level BPE pre-tokenizer alone (tests): piece(ctx, ...) gets each word of the plain
 * text s[0..n) (valid UTF-8) in order, as the merges would see them. */
enum status engine_tok_pretokenize(const struct engine_tok *t, const char *s, size_t n,
                                   void (*piece)(void *ctx, const char *s, size_t n), void *ctx,
                                   struct err_detail *err);

/* SentencePiece encoding of one stretch of plain text (valid UTF-8), with a leading space
 * when space_prefix, appended to *v (engine_tok_push). As llama.cpp's SPM tokenizer: spaces
 * become U+2581, the characters are merged pairwise, highest-scoring token first (leftmost on
 * ties), and a piece that is no token becomes its bytes' <0xXX> tokens. */
enum status engine_tok_spm_encode(const struct engine_tok *t, const unsigned char *s, size_t n,
                                  int space_prefix, int32_t **v, size_t *nv, size_t *cap,
                                  struct err_detail *err);

/* Length in bytes of token id's text (byte-decoded for normal tokens). */
size_t engine_tok_text_len(const struct engine_tok *t, int32_t id);

/* Token id's text, engine_tok_text_len bytes, not NUL-terminated. */
const char *engine_tok_text(const struct engine_tok *t, int32_t id);

/* Id of the token with this text in the normal (byte-decoded) or the literal class; -1. */
int32_t engine_tok_text_map_find(const struct engine_tok *t, const char *s, size_t n, int normal);

/* The merge rule for the pair (l, r), or NULL when there is none. */
const struct tok_merge *engine_tok_merge_find(const struct engine_tok *t, int32_t l, int32_t r);

#endif
