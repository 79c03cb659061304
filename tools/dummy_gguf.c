/* Write a dummy model (engine/dummy.h) to a GGUF file: a preset's real width with random Q4_0
 * weights, optionally fewer layers, and the tokenizer of a real GGUF. For machines the real model
 * cannot reach (scripts/gpu-check.sh carries a 6-layer SmolLM2-shaped file of ~29 MB to the GPU
 * machine): `make build/tools/dummy_gguf && build/tools/dummy_gguf PRESET LAYERS SEED OUT.gguf
 * [TOKENIZER.gguf]` (tokenizer default: the default model). */
#include <stdio.h>
#include <stdlib.h>

#include "engine/dummy.h"
#include "io/gguf.h"
#include "io/gguf_write.h"

int main(int argc, char **argv)
{
    if (argc < 5 || argc > 6) {
        fprintf(stderr, "usage: dummy_gguf PRESET LAYERS SEED OUT.gguf [TOKENIZER.gguf]\n"
                        "  PRESET: %s; LAYERS 0 = the preset's own count\n",
                engine_dummy_names());
        return 2;
    }
    const char *tok_path = argc == 6 ? argv[5] : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    struct err_detail err = {0};
    struct io_gguf *tok, *g;
    if (io_gguf_open(&tok, tok_path, &err) ||
        engine_dummy_gguf(&g, argv[1], tok, strtoull(argv[3], NULL, 10), atoi(argv[2]), 1, &err)) {
        fprintf(stderr, "dummy_gguf: %s\n", err.msg);
        return 1;
    }
    io_gguf_close(tok);
    if (io_gguf_save(g, argv[4], &err)) {
        fprintf(stderr, "dummy_gguf: %s\n", err.msg);
        io_gguf_close(g);
        return 1;
    }
    printf("%s: %s, %llu tensors, %zu bytes\n", argv[4], argv[1],
           (unsigned long long)g->n_tensors, g->size);
    io_gguf_close(g);
    return 0;
}
