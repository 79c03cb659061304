/* Models without weight files: a preset's real dimensions and architecture (SmolLM2-135M, Llama 3
 * 8B/70B, Qwen2.5 7B, Qwen3 8B, Gemma 3 27B) with random INT4 weights made in memory (as vLLM's `--load-format dummy`), and a tokenizer
 * taken from a real GGUF. For throughput and memory planning at real sizes, and for comparing
 * backends on the same weights; the text they write is noise. */
#ifndef ENGINE_DUMMY_H
#define ENGINE_DUMMY_H

#include <stdint.h>

#include "common/err.h"
#include "io/gguf.h"

/* The preset names, "|"-separated (help texts). */
const char *engine_dummy_names(void);

/* A GGUF of the preset's architecture in memory (io/gguf_write.h): its hyperparameters and tensor
 * shapes (n_layer > 0 overrides the layer count: small files of a real width), every
 * "tokenizer." pair of tok copied, Q4_0 matrices and f32 norms, biases and RoPE factors. fill 1: random weights from
 * seed (the same seed gives the same bytes, whatever the machine); 0: zero pages, never touched
 * (quern plan at 70B costs no memory). *out owns its mapping (io_gguf_close). An unknown preset
 * is an error naming the known ones. */
enum status engine_dummy_gguf(struct io_gguf **out, const char *preset, const struct io_gguf *tok,
                              uint64_t seed, int n_layer, int fill, struct err_detail *err);

#endif
