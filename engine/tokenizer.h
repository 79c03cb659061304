/* The tokenizer built from a GGUF file's tokenizer.* metadata: byte-level BPE (GPT-2 family:
 * special-token split, the regex pre-tokenizer tokenizer.ggml.pre names, rank-ordered merges)
 * or SentencePiece (tokenizer.ggml.model "llama": Gemma; score-ordered merges, U+2581 for
 * spaces, <0xXX> byte fallback), text -> token ids, and token ids -> bytes, including a
 * streaming decoder that only emits whole UTF-8 characters.
 *
 * Invalid UTF-8 in encode input is not an error: every byte that does not begin a well-formed
 * UTF-8 sequence (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF, no truncated
 * sequence) is replaced by U+FFFD, one replacement per byte, before tokenizing. This matches
 * llama.cpp (unicode_cpts_from_utf8), except that llama.cpp decodes overlong and surrogate
 * forms leniently instead of replacing them. Decoding such ids gives back U+FFFD, so the
 * byte round trip holds for valid UTF-8 input only.
 *
 * Bytes the vocabulary has no single-byte token for (SmolLM2 lacks 0x04 0x06 0x13 0x14 0x16 0x1D
 * and the lead bytes of planes 4-11) are dropped and their neighbours may merge, as in Hugging
 * Face tokenizers; llama.cpp drops them too but does not merge across them.
 *
 * A loaded struct engine_tok is immutable: every function below may be called concurrently
 * from several threads on one tokenizer (each call allocates its own scratch memory). */
#ifndef ENGINE_TOKENIZER_H
#define ENGINE_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "io/gguf.h"

struct engine_tok; /* opaque; see engine/tokenizer_internal.h */

/* Build a tokenizer from g's tokenizer.* metadata. Supported: tokenizer.ggml.model "gpt2"
 * with tokenizer.ggml.pre "smollm" (digits split one by one, then the GPT-2 regex),
 * "default"/"gpt2"/absent (the GPT-2 regex alone), "llama-bpe" (Llama 3) or "qwen2" (Qwen2,
 * Qwen2.5, Qwen3); tokenizer.ggml.model "llama" (SentencePiece; the pre-tokenizer name is not
 * read). Anything else fails with ST_ERR_UNSUPPORTED naming the model or pre-tokenizer. The tokenizer copies what it needs;
 * g may be closed afterwards. On success the caller owns *out (free with engine_tok_free). */
enum status engine_tok_load(struct engine_tok **out, const struct io_gguf *g,
                            struct err_detail *err);

/* Free a tokenizer; NULL is a no-op. */
void engine_tok_free(struct engine_tok *t);

#define ENGINE_TOK_PARSE_SPECIAL 1u /* recognise control/special token text in the input */
#define ENGINE_TOK_ADD_BOS       2u /* prepend BOS if the model's add_bos_token says so */

/* Tokenize len bytes of text (need not be NUL-terminated; may contain NUL bytes).
 * Without ENGINE_TOK_PARSE_SPECIAL, control-token text such as "<|im_end|>" is ordinary text;
 * with it, the input is first split at occurrences of control-token texts, longest token
 * first (as llama.cpp does). User-defined tokens (token_type 4) are always recognised.
 * On success *ids (caller frees with free()) holds *n_ids ids; an empty input gives
 * *n_ids == 0 and a non-NULL *ids. On failure *ids is NULL and *n_ids is 0. */
enum status engine_tok_encode(const struct engine_tok *t, const char *text, size_t len,
                              unsigned flags, int32_t **ids, size_t *n_ids, struct err_detail *err);

/* Vocabulary size (number of token ids). */
int32_t engine_tok_n_vocab(const struct engine_tok *t);

/* Beginning / end of sequence ids from the metadata; -1 when the model has none. */
int32_t engine_tok_bos(const struct engine_tok *t);
int32_t engine_tok_eos(const struct engine_tok *t);

/* 1 when id ends generation: eos, tokenizer.ggml.eot_token_id / eom_token_id when present,
 * and control tokens whose text is a known end-of-turn marker (<|im_end|>, <|endoftext|>,
 * <|eot_id|>, <|eom_id|>, <|end|>, <end_of_turn>, <|end_of_text|>). 0 otherwise, including
 * for ids out of range. */
int engine_tok_is_eog(const struct engine_tok *t, int32_t id);

/* Exact lookup of a token by its text: raw bytes (after byte-level decoding, or with U+2581
 * as a space in SentencePiece vocabularies) for normal tokens, literal text for control and
 * user-defined tokens, the byte of a byte-fallback token <0xXX> when no other token is that
 * one byte. -1 when no token has that text. */
int32_t engine_tok_find(const struct engine_tok *t, const char *text, size_t len);

/* The control or user-defined token whose literal text is text[0..len), or -1 (a normal token
 * with that text does not count). */
int32_t engine_tok_find_special(const struct engine_tok *t, const char *text, size_t len);

/* 1 when encoding writes a space before text at the start or after a special token
 * (SentencePiece with add_space_prefix), else 0. */
int engine_tok_space_prefix(const struct engine_tok *t);

/* Raw bytes of token id (byte-level decoded). Control tokens give their literal text when
 * include_special is nonzero and 0 bytes otherwise; user-defined tokens always give their
 * text; ids out of range give 0 bytes. Writes at most cap bytes to buf (no NUL terminator)
 * and returns the full byte count, which may exceed cap (then buf holds a truncated copy). */
size_t engine_tok_piece(const struct engine_tok *t, int32_t id, int include_special, char *buf,
                        size_t cap);

/* Largest byte count engine_tok_piece can return for this vocabulary (include_special on). */
size_t engine_tok_max_piece(const struct engine_tok *t);

/* UTF-8 holdback state of a streaming decoder; zero-initialise before the first push. */
struct engine_tok_stream {
    unsigned char pend[8]; /* held bytes: a valid but incomplete UTF-8 prefix (at most 3) */
    int n_pend;            /* number of bytes in pend */
};

/* Bytes out of one push never exceed this for a piece of piece_len bytes: every held or new
 * byte may turn into a 3-byte U+FFFD. */
#define ENGINE_TOK_STREAM_OUT_MAX(piece_len) (3 * ((size_t)(piece_len) + 3))

/* Append the bytes of token id (as engine_tok_piece with include_special = 0) to out,
 * emitting only complete UTF-8 characters: a valid but incomplete trailing sequence is held
 * in s until the next push; bytes that can never become valid are emitted as U+FFFD, one per
 * maximal subpart (utf8_bad_len: "\xE2\x82" then "A" gives one U+FFFD, as Hugging Face's and
 * Python's decoders do). Returns the number of bytes of output. If that is more than cap, nothing
 * is written, s is unchanged, and the caller should retry with a buffer of at least the returned
 * size (ENGINE_TOK_STREAM_OUT_MAX(engine_tok_max_piece(t)) always suffices). */
size_t engine_tok_stream_push(const struct engine_tok *t, struct engine_tok_stream *s, int32_t id,
                              char *out, size_t cap);

/* End of stream: the held bytes (a cut-off character) become one U+FFFD; s is reset. Returns
 * the byte count (0 or 3); when it exceeds cap nothing is written and s is unchanged. */
size_t engine_tok_stream_flush(struct engine_tok_stream *s, char *out, size_t cap);

#endif
