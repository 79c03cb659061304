/* Writes the seeds of the GGUF fuzz harness (tests/fuzz/fuzz_gguf.c) into a folder: small
 * synthetic files (a llama-shaped toy model with a tokenizer, every value and tensor type,
 * version 2 with another alignment, metadata only) and, from the default model when given,
 * its metadata with the vocabulary cut short plus two small tensors, and its first 2 MiB.
 * Usage: gguf_seeds OUTDIR [MODEL.gguf]. Every seed but the 2 MiB cut must read back. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/err.h"
#include "io/gguf.h"

#define SEED_MAX_TENSORS 32
#define SEED_VOCAB_KEEP  256 /* elements kept of each array of the real model */
#define SEED_HEAD_BYTES  (2u << 20)

struct seed_tensor {
    char name[64];    /* tensor name */
    uint32_t n_dims;  /* 1..4 */
    uint64_t ne[4];   /* elements per dimension */
    uint32_t type;    /* enum dtype */
    const void *data; /* bytes to write, or NULL for pseudo-random ones */
};

struct seed {
    uint8_t *buf;                           /* the metadata written so far */
    size_t n, cap;                          /* bytes used, allocated */
    uint64_t n_kv;                          /* pairs written */
    uint32_t version, alignment;            /* header version, data alignment */
    struct seed_tensor t[SEED_MAX_TENSORS]; /* tensors added */
    int n_t;                                /* how many */
};

static void die(const char *what)
{
    fprintf(stderr, "gguf_seeds: %s\n", what);
    exit(1);
}

static void put(struct seed *s, const void *p, size_t n)
{
    if (!n)
        return;
    if (s->n + n > s->cap) {
        s->cap = (s->n + n) * 2;
        s->buf = realloc(s->buf, s->cap);
        if (!s->buf)
            die("out of memory");
    }
    memcpy(s->buf + s->n, p, n);
    s->n += n;
}

static void put_u32(struct seed *s, uint32_t v)
{
    put(s, &v, 4);
}

static void put_u64(struct seed *s, uint64_t v)
{
    put(s, &v, 8);
}

static void put_str(struct seed *s, const char *p, uint64_t len)
{
    put_u64(s, len);
    put(s, p, (size_t)len);
}

/* Start a pair: its key and value type; the caller writes the value. */
static void key(struct seed *s, const char *k, enum io_gguf_vtype t)
{
    put_str(s, k, strlen(k));
    put_u32(s, t);
    s->n_kv++;
}

static void kv_u32(struct seed *s, const char *k, uint32_t v)
{
    key(s, k, IO_GGUF_UINT32);
    put_u32(s, v);
}

static void kv_f32(struct seed *s, const char *k, float v)
{
    key(s, k, IO_GGUF_FLOAT32);
    put(s, &v, 4);
}

static void kv_str(struct seed *s, const char *k, const char *v)
{
    key(s, k, IO_GGUF_STRING);
    put_str(s, v, strlen(v));
}

static void kv_strs(struct seed *s, const char *k, const char *const *v, uint64_t n)
{
    key(s, k, IO_GGUF_ARRAY);
    put_u32(s, IO_GGUF_STRING);
    put_u64(s, n);
    for (uint64_t i = 0; i < n; i++)
        put_str(s, v[i], strlen(v[i]));
}

/* An array of n fixed-size elements of esize bytes each. */
static void kv_arr(struct seed *s, const char *k, enum io_gguf_vtype et, const void *v, uint64_t n,
                   size_t esize)
{
    key(s, k, IO_GGUF_ARRAY);
    put_u32(s, et);
    put_u64(s, n);
    put(s, v, (size_t)n * esize);
}

static void tensor(struct seed *s, const char *name, uint32_t type, uint32_t n_dims, uint64_t ne0,
                   uint64_t ne1, uint64_t ne2, uint64_t ne3, const void *data)
{
    if (s->n_t == SEED_MAX_TENSORS)
        die("too many tensors");
    struct seed_tensor *t = &s->t[s->n_t++];
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = ne2, t->ne[3] = ne3;
    t->type = type;
    t->data = data;
}

static uint64_t tensor_bytes(const struct seed_tensor *t)
{
    return dtype_row_bytes(t->type, (int64_t)t->ne[0]) * t->ne[1] * t->ne[2] * t->ne[3];
}

/* Header, the pairs written, tensor infos, padding, then each tensor's data (aligned); the
 * file must read back with the reader before it is written to dir/file. */
static void finish(struct seed *s, const char *dir, const char *file)
{
    struct seed f = {0};
    put(&f, "GGUF", 4);
    put_u32(&f, s->version);
    put_u64(&f, (uint64_t)s->n_t);
    put_u64(&f, s->n_kv);
    put(&f, s->buf, s->n);
    uint64_t off = 0, offs[SEED_MAX_TENSORS];
    for (int i = 0; i < s->n_t; i++) {
        const struct seed_tensor *t = &s->t[i];
        put_str(&f, t->name, strlen(t->name));
        put_u32(&f, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            put_u64(&f, t->ne[d]);
        put_u32(&f, t->type);
        offs[i] = off;
        put_u64(&f, off);
        off += (tensor_bytes(t) + s->alignment - 1) / s->alignment * s->alignment;
    }
    static const uint8_t zero[1u << 12];
    if (s->n_t)
        put(&f, zero, (s->alignment - f.n % s->alignment) % s->alignment);
    size_t data_start = f.n;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < s->n_t; i++) {
        const struct seed_tensor *t = &s->t[i];
        put(&f, zero, (size_t)(data_start + offs[i] - f.n));
        for (uint64_t j = 0, n = tensor_bytes(t); j < n; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            uint8_t byte = t->data ? ((const uint8_t *)t->data)[j] : (uint8_t)x;
            put(&f, &byte, 1);
        }
    }
    struct io_gguf *g;
    struct err_detail err = {0};
    if (io_gguf_open_mem(&g, f.buf, f.n, &err) != ST_OK) {
        fprintf(stderr, "gguf_seeds: %s does not read back: %s\n", file, err.msg);
        exit(1);
    }
    io_gguf_close(g);
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    FILE *out = fopen(path, "wb");
    if (!out || fwrite(f.buf, 1, f.n, out) != f.n || fclose(out))
        die(path);
    printf("gguf_seeds: %s (%zu bytes, %llu pairs, %d tensors)\n", path, f.n,
           (unsigned long long)s->n_kv, s->n_t);
    free(f.buf);
    free(s->buf);
    memset(s, 0, sizeof(*s));
}

/* A one-layer llama model with a byte-level BPE tokenizer: what the loaders read. */
static void seed_tiny_llama(const char *dir)
{
    struct seed s = {.version = 3, .alignment = 32};
    kv_str(&s, "general.architecture", "llama");
    kv_str(&s, "general.name", "tiny");
    kv_u32(&s, "llama.context_length", 64);
    kv_u32(&s, "llama.embedding_length", 32);
    kv_u32(&s, "llama.feed_forward_length", 64);
    kv_u32(&s, "llama.block_count", 1);
    kv_u32(&s, "llama.attention.head_count", 4);
    kv_u32(&s, "llama.attention.head_count_kv", 2);
    kv_u32(&s, "llama.rope.dimension_count", 8);
    kv_f32(&s, "llama.rope.freq_base", 10000.0f);
    kv_f32(&s, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_str(&s, "tokenizer.ggml.model", "gpt2");
    kv_str(&s, "tokenizer.ggml.pre", "smollm");
    static const char *const toks[] = {
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "a",
        "b",
        "c",
        "d",
        "e",
        "h",
        "l",
        "o",
        "\xc4\xa0",
        "\xc4\xa0h",
        "he",
        "ll",
        "llo",
        "hello",
        "\xc4\x8a",
        "1",
        "2",
    };
    uint64_t n_toks = sizeof(toks) / sizeof(toks[0]);
    kv_strs(&s, "tokenizer.ggml.tokens", toks, n_toks);
    int32_t types[sizeof(toks) / sizeof(toks[0])];
    for (uint64_t i = 0; i < n_toks; i++)
        types[i] = i < 3 ? 3 : 1;
    kv_arr(&s, "tokenizer.ggml.token_type", IO_GGUF_INT32, types, n_toks, 4);
    static const char *const merges[] = {"\xc4\xa0 h", "h e", "l l", "ll o", "he llo"};
    kv_strs(&s, "tokenizer.ggml.merges", merges, sizeof(merges) / sizeof(merges[0]));
    kv_u32(&s, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(&s, "tokenizer.ggml.eos_token_id", 2);
    key(&s, "tokenizer.ggml.add_bos_token", IO_GGUF_BOOL);
    put(&s, "\0", 1);
    kv_str(&s, "tokenizer.chat_template",
           "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}");
    tensor(&s, "token_embd.weight", DTYPE_Q8_0, 2, 32, n_toks, 1, 1, NULL);
    tensor(&s, "output_norm.weight", DTYPE_F32, 1, 32, 1, 1, 1, NULL);
    tensor(&s, "blk.0.attn_norm.weight", DTYPE_F32, 1, 32, 1, 1, 1, NULL);
    tensor(&s, "blk.0.attn_q.weight", DTYPE_F16, 2, 32, 32, 1, 1, NULL);
    tensor(&s, "blk.0.attn_k.weight", DTYPE_Q4_1, 2, 32, 16, 1, 1, NULL);
    tensor(&s, "blk.0.attn_v.weight", DTYPE_Q5_0, 2, 32, 16, 1, 1, NULL);
    tensor(&s, "blk.0.attn_output.weight", DTYPE_BF16, 2, 32, 32, 1, 1, NULL);
    tensor(&s, "blk.0.ffn_norm.weight", DTYPE_F32, 1, 32, 1, 1, 1, NULL);
    tensor(&s, "blk.0.ffn_gate.weight", DTYPE_Q4_0, 2, 32, 64, 1, 1, NULL);
    tensor(&s, "blk.0.ffn_up.weight", DTYPE_Q8_0, 2, 32, 64, 1, 1, NULL);
    tensor(&s, "blk.0.ffn_down.weight", DTYPE_Q8_0, 2, 64, 32, 1, 1, NULL);
    finish(&s, dir, "tiny_llama.gguf");
}

/* Version 2, alignment 64: every value type, empty and nested arrays (to the deepest nesting
 * read), 3-d and 4-d tensors, the K-quant types. */
static void seed_all_types(const char *dir)
{
    struct seed s = {.version = 2, .alignment = 64};
    kv_u32(&s, "general.alignment", 64);
    static const uint8_t raw[64] = {1, 0, 1, 1, 0x7F, 0x80, 0xFF, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    static const enum io_gguf_vtype scalars[] = {
        IO_GGUF_UINT8,  IO_GGUF_INT8,  IO_GGUF_UINT16,  IO_GGUF_INT16,
        IO_GGUF_UINT32, IO_GGUF_INT32, IO_GGUF_FLOAT32, IO_GGUF_BOOL,
        IO_GGUF_UINT64, IO_GGUF_INT64, IO_GGUF_FLOAT64,
    };
    static const size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 8, 8, 8};
    for (size_t i = 0; i < sizeof(scalars) / sizeof(scalars[0]); i++) {
        char k[64];
        snprintf(k, sizeof(k), "test.%s", io_gguf_vtype_name(scalars[i]));
        key(&s, k, scalars[i]);
        put(&s, raw, sizes[i]);
        snprintf(k, sizeof(k), "test.arr_%s", io_gguf_vtype_name(scalars[i]));
        kv_arr(&s, k, scalars[i], raw, scalars[i] == IO_GGUF_BOOL ? 4 : 3, sizes[i]);
    }
    kv_arr(&s, "test.arr_empty", IO_GGUF_FLOAT32, raw, 0, 4);
    kv_strs(&s, "test.arr_str_empty", NULL, 0);
    kv_str(&s, "test.str_empty", "");
    static const char *const words[] = {"x", "", "\xe2\x82\xac uro"};
    kv_strs(&s, "test.arr_str", words, 3);
    /* [[u16 x2], [u16 x0]] and [[["x", "", "€ uro"]]] */
    key(&s, "test.arr_nested", IO_GGUF_ARRAY);
    put_u32(&s, IO_GGUF_ARRAY);
    put_u64(&s, 2);
    put_u32(&s, IO_GGUF_UINT16);
    put_u64(&s, 2);
    put(&s, raw, 4);
    put_u32(&s, IO_GGUF_UINT16);
    put_u64(&s, 0);
    key(&s, "test.arr_nested_str", IO_GGUF_ARRAY);
    put_u32(&s, IO_GGUF_ARRAY);
    put_u64(&s, 1);
    put_u32(&s, IO_GGUF_ARRAY);
    put_u64(&s, 1);
    put_u32(&s, IO_GGUF_STRING);
    put_u64(&s, 3);
    for (int i = 0; i < 3; i++)
        put_str(&s, words[i], strlen(words[i]));
    /* arrays nested as deep as the reader accepts: 8 levels, then one uint8 */
    key(&s, "test.arr_deep", IO_GGUF_ARRAY);
    for (int i = 0; i < 7; i++) {
        put_u32(&s, IO_GGUF_ARRAY);
        put_u64(&s, 1);
    }
    put_u32(&s, IO_GGUF_UINT8);
    put_u64(&s, 1);
    put(&s, raw, 1);
    tensor(&s, "t.q4_k", DTYPE_Q4_K, 2, 256, 2, 1, 1, NULL);
    tensor(&s, "t.q6_k", DTYPE_Q6_K, 1, 256, 1, 1, 1, NULL);
    tensor(&s, "t.f32.3d", DTYPE_F32, 3, 2, 3, 4, 1, NULL);
    tensor(&s, "t.f16.4d", DTYPE_F16, 4, 2, 2, 2, 2, NULL);
    tensor(&s, "t.q8_0.1", DTYPE_Q8_0, 2, 32, 1, 1, 1, NULL);
    finish(&s, dir, "all_types_v2.gguf");
}

/* Metadata only: no tensors, so no data section; and the smallest file, an empty one. */
static void seed_metadata_only(const char *dir)
{
    struct seed s = {.version = 3, .alignment = 32};
    kv_str(&s, "general.architecture", "llama");
    kv_u32(&s, "llama.block_count", 2);
    kv_u32(&s, "general.alignment", 16);
    finish(&s, dir, "metadata_only.gguf");
    s = (struct seed){.version = 3, .alignment = 32};
    finish(&s, dir, "empty.gguf");
}

/* The default model's metadata (every pair, arrays cut to SEED_VOCAB_KEEP elements) and its
 * two smallest norm tensors with their real data. */
static void seed_model_meta(const char *dir, const struct io_gguf *g)
{
    static const size_t vsize[IO_GGUF_VTYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    struct seed s = {.version = g->version, .alignment = g->alignment};
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct io_gguf_kv *kv = &g->kv[i];
        if (kv->type == IO_GGUF_ARRAY && kv->arr_type == IO_GGUF_ARRAY)
            continue; /* none in the model; not worth cutting */
        put_str(&s, kv->key.ptr, kv->key.len);
        put_u32(&s, kv->type);
        s.n_kv++;
        if (kv->type == IO_GGUF_STRING) {
            uint64_t len;
            memcpy(&len, kv->val, 8);
            put_str(&s, (const char *)kv->val + 8, len);
        } else if (kv->type == IO_GGUF_ARRAY) {
            uint64_t n = kv->arr_n < SEED_VOCAB_KEEP ? kv->arr_n : SEED_VOCAB_KEEP;
            put_u32(&s, kv->arr_type);
            put_u64(&s, n);
            if (kv->arr_type == IO_GGUF_STRING)
                for (uint64_t j = 0; j < n; j++)
                    put_str(&s, kv->strs[j].ptr, kv->strs[j].len);
            else
                put(&s, kv->val, (size_t)n * vsize[kv->arr_type]);
        } else {
            put(&s, kv->val, vsize[kv->type]);
        }
    }
    static const char *const names[] = {"output_norm.weight", "blk.0.attn_norm.weight"};
    for (int i = 0; i < 2; i++) {
        const struct io_gguf_tensor *t = io_gguf_find_tensor(g, names[i]);
        if (!t)
            die("the model lacks its norm tensors");
        tensor(&s, t->name, t->type, t->n_dims, (uint64_t)t->ne[0], (uint64_t)t->ne[1],
               (uint64_t)t->ne[2], (uint64_t)t->ne[3], t->data);
    }
    finish(&s, dir, "model_meta.gguf");
}

/* The first SEED_HEAD_BYTES of the model as they are: the header, all metadata and the
 * tensor infos, cut inside the data (refused, but mutations of it reach everything else). */
static void seed_model_head(const char *dir, const struct io_gguf *g)
{
    size_t n = g->size < SEED_HEAD_BYTES ? g->size : SEED_HEAD_BYTES;
    char path[4096];
    snprintf(path, sizeof(path), "%s/model_head.gguf", dir);
    FILE *out = fopen(path, "wb");
    if (!out || fwrite(g->base, 1, n, out) != n || fclose(out))
        die(path);
    printf("gguf_seeds: %s (%zu bytes, cut)\n", path, n);
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: gguf_seeds OUTDIR [MODEL.gguf]\n");
        return 2;
    }
    seed_tiny_llama(argv[1]);
    seed_all_types(argv[1]);
    seed_metadata_only(argv[1]);
    if (argc == 3) {
        struct io_gguf *g;
        struct err_detail err = {0};
        if (io_gguf_open(&g, argv[2], &err) != ST_OK) {
            fprintf(stderr, "gguf_seeds: no seeds from the model: %s\n", err.msg);
            return 0; /* the synthetic seeds are enough to run */
        }
        seed_model_meta(argv[1], g);
        seed_model_head(argv[1], g);
        io_gguf_close(g);
    }
    return 0;
}
