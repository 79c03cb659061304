/* `quern info`: a GGUF model's metadata, tensor table and size totals, as text on stdout. */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/dtype.h"
#include "common/log.h"
#include "common/utf8.h"
#include "io/gguf.h"
#include "kernels/kernels.h"
#include "runner/runner.h"

static const char info_usage[] =
    "usage: quern info [--model PATH] [--tensors]\n"
    "\n"
    "Print a GGUF model's metadata and per-type tensor totals.\n"
    "\n"
    "  --model PATH   GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --tensors      also list every tensor (name, type, shape, bytes)\n"
    "  -h, --help     this help\n";

/* Print a string value, escaping control bytes and bytes that are not well-formed UTF-8 (as
 * \xNN; they went to the terminal raw), cut at max bytes. */
/* s's first max bytes with control characters (C1 too), '"', '\\' and bytes that are not UTF-8
 * escaped (a file's text must not reach the terminal as escape sequences); returns the columns
 * printed. */
static size_t print_escaped(struct io_gguf_str s, size_t max)
{
    const unsigned char *p = (const unsigned char *)s.ptr;
    const uint64_t end = s.len < max ? s.len : max;
    size_t cols = 0;
    for (uint64_t i = 0; i < end;) {
        unsigned char ch = p[i];
        size_t k = ch >= 0x80 ? utf8_decode(p + i, (size_t)(end - i), NULL, NULL) : 1;
        if (ch == 0xC2 && k == 2 && p[i + 1] < 0xA0) { /* a C1 control, U+0080-9F (U+009B
                                                        * starts a terminal escape too) */
            cols += (size_t)printf("\\u%04x", p[i + 1]);
            i += 2;
            continue;
        }
        if (ch >= 0x80 && k) { /* a whole character */
            fwrite(p + i, 1, k, stdout);
            i += k;
            cols++;
            continue;
        }
        if (ch == '\n')
            cols += (size_t)printf("\\n");
        else if (ch == '"' || ch == '\\')
            cols += (size_t)printf("\\%c", ch);
        else if (ch < 0x20 || ch >= 0x7f)
            cols += (size_t)printf("\\x%02x", ch);
        else
            cols += putchar(ch) != EOF;
        i++;
    }
    return cols;
}

static void print_str(struct io_gguf_str s, size_t max)
{
    putchar('"');
    print_escaped(s, max);
    putchar('"');
    if (s.len > max)
        printf("... (%" PRIu64 " bytes)", s.len);
}

static void print_scalar(enum io_gguf_vtype t, const uint8_t *p)
{
    union {
        uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
        uint64_t u64; int64_t i64; float f32; double f64;
    } v;
    memcpy(&v, p, t == IO_GGUF_UINT64 || t == IO_GGUF_INT64 || t == IO_GGUF_FLOAT64 ? 8
                  : t == IO_GGUF_UINT32 || t == IO_GGUF_INT32 || t == IO_GGUF_FLOAT32 ? 4
                  : t == IO_GGUF_UINT16 || t == IO_GGUF_INT16 ? 2 : 1);
    switch (t) {
    case IO_GGUF_UINT8: printf("%u", v.u8); break;
    case IO_GGUF_INT8: printf("%d", v.i8); break;
    case IO_GGUF_UINT16: printf("%u", v.u16); break;
    case IO_GGUF_INT16: printf("%d", v.i16); break;
    case IO_GGUF_UINT32: printf("%" PRIu32, v.u32); break;
    case IO_GGUF_INT32: printf("%" PRId32, v.i32); break;
    case IO_GGUF_UINT64: printf("%" PRIu64, v.u64); break;
    case IO_GGUF_INT64: printf("%" PRId64, v.i64); break;
    case IO_GGUF_FLOAT32: printf("%g", (double)v.f32); break;
    case IO_GGUF_FLOAT64: printf("%g", v.f64); break;
    case IO_GGUF_BOOL: fputs(v.u8 ? "true" : "false", stdout); break;
    default: fputs("?", stdout);
    }
}

static size_t scalar_size(enum io_gguf_vtype t)
{
    switch (t) {
    case IO_GGUF_UINT8: case IO_GGUF_INT8: case IO_GGUF_BOOL: return 1;
    case IO_GGUF_UINT16: case IO_GGUF_INT16: return 2;
    case IO_GGUF_UINT32: case IO_GGUF_INT32: case IO_GGUF_FLOAT32: return 4;
    default: return 8;
    }
}

static void print_kv(const struct io_gguf_kv *kv)
{
    fputs("  ", stdout);
    print_escaped(kv->key, SIZE_MAX);
    fputs(" = ", stdout);
    if (kv->type == IO_GGUF_STRING) {
        struct io_gguf_str s;
        memcpy(&s.len, kv->val, 8);
        s.ptr = (const char *)kv->val + 8;
        print_str(s, 200);
    } else if (kv->type == IO_GGUF_ARRAY) {
        printf("[%s x %" PRIu64 "]", io_gguf_vtype_name(kv->arr_type), kv->arr_n);
        uint64_t show = kv->arr_n < 6 ? kv->arr_n : 6;
        if (kv->arr_type == IO_GGUF_STRING) {
            for (uint64_t i = 0; i < show; i++) {
                fputs(i ? ", " : " ", stdout);
                print_str(kv->strs[i], 40);
            }
        } else if (kv->arr_type != IO_GGUF_ARRAY) {
            for (uint64_t i = 0; i < show; i++) {
                fputs(i ? ", " : " ", stdout);
                print_scalar(kv->arr_type, kv->val + i * scalar_size(kv->arr_type));
            }
        }
        if (show < kv->arr_n && kv->arr_type != IO_GGUF_ARRAY)
            fputs(", ...", stdout);
    } else {
        print_scalar(kv->type, kv->val);
    }
    putchar('\n');
}

int runner_cmd_info(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"tensors", no_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *model = RUNNER_DEFAULT_MODEL;
    int list = 0, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 't': list = 1; break;
        case 'h': fputs(info_usage, stdout); return RUNNER_EXIT_OK;
        default: fputs(info_usage, stderr); return RUNNER_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern info: unexpected argument '%s'\n", argv[optind]);
        return RUNNER_EXIT_USAGE;
    }
    struct err_detail err = {0};
    struct io_gguf *g;
    if (io_gguf_open(&g, model, &err)) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    kern_backends_print(stdout);
    printf("file: %s\nsize: %zu bytes\nGGUF version: %u\nalignment: %u\n", model, g->size,
           g->version, g->alignment);
    printf("metadata (%" PRIu64 " keys):\n", g->n_kv);
    for (uint64_t i = 0; i < g->n_kv; i++)
        print_kv(&g->kv[i]);
    uint64_t count[DTYPE_COUNT] = {0}, bytes[DTYPE_COUNT] = {0}, elems[DTYPE_COUNT] = {0};
    uint64_t total_b = 0, total_e = 0;
    if (list)
        printf("tensors (%" PRIu64 "):\n", g->n_tensors);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct io_gguf_tensor *t = &g->tensors[i];
        uint64_t ne = 1;
        for (int d = 0; d < IO_GGUF_MAX_DIMS; d++)
            ne *= (uint64_t)t->ne[d];
        count[t->type]++;
        bytes[t->type] += t->nbytes;
        elems[t->type] += ne;
        total_b += t->nbytes;
        total_e += ne;
        if (list) {
            fputs("  ", stdout);
            const struct io_gguf_str name = {t->name, strlen(t->name)};
            for (size_t w = print_escaped(name, SIZE_MAX); w < 32; w++)
                putchar(' ');
            printf(" %-5s [", dtype_get(t->type)->name);
            for (uint32_t d = 0; d < t->n_dims; d++)
                printf(d ? ", %" PRId64 : "%" PRId64, t->ne[d]);
            printf("] %" PRIu64 " bytes\n", t->nbytes);
        }
    }
    printf("tensor totals (%" PRIu64 " tensors, %" PRIu64 " parameters, %" PRIu64 " bytes):\n",
           g->n_tensors, total_e, total_b);
    for (int t = 0; t < DTYPE_COUNT; t++)
        if (count[t])
            printf("  %-5s %4" PRIu64 " tensors %12" PRIu64 " params %12" PRIu64
                   " bytes (%.2f bits/param)\n",
                   dtype_get((uint32_t)t)->name, count[t], elems[t], bytes[t],
                   8.0 * (double)bytes[t] / (double)elems[t]);
    io_gguf_close(g);
    return RUNNER_EXIT_OK;
}
