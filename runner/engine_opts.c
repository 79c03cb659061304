/* The engine and backend flags shared by the commands (runner/engine_opts.h). */
#include "runner/engine_opts.h"
#include "common/log.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "engine/dummy.h"
#include "io/gguf.h"
#include "runner/runner.h"

/* The seed of every dummy model's weights: the same preset gives the same model everywhere. */
#define DUMMY_SEED 1

void runner_engine_opts_default(struct runner_engine_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->threads = runner_default_threads();
    o->act = RUNNER_ACT_DEFAULT;
    o->tp = 1;
    engine_params_default(&o->ep);
    o->ep.kv_mem = 0; /* --kv-mem auto: the engine sizes it (engine_kv_mem_resolve) */
}

static const struct option backend_opts[] = {
    {"device", required_argument, 0, RUNNER_EO_OPT_DEVICE},
    {"threads", required_argument, 0, RUNNER_EO_OPT_THREADS},
    {"tp", required_argument, 0, RUNNER_EO_OPT_TP},
    {"isa", required_argument, 0, RUNNER_EO_OPT_ISA},
    {"matmul", required_argument, 0, RUNNER_EO_OPT_MATMUL},
};
static const struct option kv_opts[] = {
    {"kv-mem", required_argument, 0, RUNNER_EO_OPT_KVMEM},
    {"kv-block", required_argument, 0, RUNNER_EO_OPT_KVBLOCK},
    {"kv-dtype", required_argument, 0, RUNNER_EO_OPT_KVDTYPE},
    {"no-window-pool", no_argument, 0, RUNNER_EO_OPT_NOWINDOW},
};
static const struct option batch_opts[] = {
    {"max-seqs", required_argument, 0, RUNNER_EO_OPT_SEQS},
    {"max-batch-tokens", required_argument, 0, RUNNER_EO_OPT_BATCH},
};
static const struct option prefix_opts[] = {
    {"no-prefix-cache", no_argument, 0, RUNNER_EO_OPT_NOPREFIX},
};

static const struct option spec_opts[] = {
    {"spec", required_argument, 0, RUNNER_EO_OPT_SPEC},
    {"spec-max-k", required_argument, 0, RUNNER_EO_OPT_SPEC_K},
    {"spec-budget", required_argument, 0, RUNNER_EO_OPT_SPEC_BUDGET},
    {"draft-model", required_argument, 0, RUNNER_EO_OPT_DRAFT_MODEL},
};

static const struct option dummy_opts[] = {
    {"dummy", required_argument, 0, RUNNER_EO_OPT_DUMMY},
};

/* Every entry of src after dst's k (a caller's cap too small is a bug: an option silently
 * dropped was once how --dummy went missing from bench). */
static size_t append(struct option *dst, size_t k, size_t cap, const struct option *src, size_t n)
{
    assert(k + n < cap);
    (void)cap;
    for (size_t i = 0; i < n; i++)
        dst[k++] = src[i];
    return k;
}

void runner_engine_longopts(struct option *dst, size_t cap, const struct option *own,
                            unsigned groups)
{
    size_t k = 0;
    while (own[k].name && k + 1 < cap) {
        dst[k] = own[k];
        k++;
    }
    if (groups & RUNNER_EO_BACKEND)
        k = append(dst, k, cap, backend_opts, sizeof(backend_opts) / sizeof(backend_opts[0]));
    if (groups & RUNNER_EO_KV)
        k = append(dst, k, cap, kv_opts, sizeof(kv_opts) / sizeof(kv_opts[0]));
    if (groups & RUNNER_EO_BATCH)
        k = append(dst, k, cap, batch_opts, sizeof(batch_opts) / sizeof(batch_opts[0]));
    if (groups & RUNNER_EO_PREFIX)
        k = append(dst, k, cap, prefix_opts, sizeof(prefix_opts) / sizeof(prefix_opts[0]));
    if (groups & RUNNER_EO_SPEC)
        k = append(dst, k, cap, spec_opts, sizeof(spec_opts) / sizeof(spec_opts[0]));
    if (groups & RUNNER_EO_DUMMY)
        k = append(dst, k, cap, dummy_opts, sizeof(dummy_opts) / sizeof(dummy_opts[0]));
    memset(&dst[k], 0, sizeof(dst[k]));
}

/* 1 when s is one of the "|"-separated names. */
static int one_of(const char *s, const char *names)
{
    const size_t n = strlen(s);
    for (const char *p = names; *p;) {
        const char *e = strchr(p, '|');
        const size_t k = e ? (size_t)(e - p) : strlen(p);
        if (k == n && !strncmp(p, s, n))
            return 1;
        p += k + (e != NULL);
    }
    return 0;
}

static int usage_bad(const char *cmd, const char *opt, const char *arg, const char *names)
{
    fprintf(stderr, "quern %s: unknown --%s '%s' (%s)\n", cmd, opt, arg, names);
    return -1;
}

int runner_engine_opt(const char *cmd, int c, const char *arg, struct runner_engine_opts *o)
{
    long l;
    switch (c) {
    case RUNNER_EO_OPT_DEVICE: /* names checked here: a usage error, before any loading */
        if (!one_of(arg, "auto|cpu|cuda"))
            return usage_bad(cmd, "device", arg, "auto|cpu|cuda");
        o->device = arg;
        return 1;
    case RUNNER_EO_OPT_ISA:
        if (!one_of(arg, "auto|scalar|avx2|avxvnni|avx-vnni|avx512|amx"))
            return usage_bad(cmd, "isa", arg, "auto|scalar|avx2|avxvnni|avx512|amx");
        o->isa = arg;
        return 1;
    case RUNNER_EO_OPT_DUMMY:
        if (!one_of(arg, engine_dummy_names()))
            return usage_bad(cmd, "dummy", arg, engine_dummy_names());
        o->dummy = arg;
        return 1;
    case RUNNER_EO_OPT_NOPREFIX:
        o->ep.prefix_cache = 0;
        return 1;
    case RUNNER_EO_OPT_NOWINDOW:
        o->ep.kv_window_pool = 0;
        return 1;
    case RUNNER_EO_OPT_SPEC:
        if (!strcmp(arg, "off"))
            o->ep.spec = 0;
        else if (!strcmp(arg, "auto"))
            o->ep.spec = ENGINE_SPEC_NGRAM | ENGINE_SPEC_SUFFIX;
        else if (!strcmp(arg, "ngram"))
            o->ep.spec = ENGINE_SPEC_NGRAM;
        else if (!strcmp(arg, "suffix"))
            o->ep.spec = ENGINE_SPEC_SUFFIX;
        else if (!strcmp(arg, "model"))
            o->ep.spec = ENGINE_SPEC_MODEL;
        else {
            fprintf(stderr, "quern %s: --spec: '%s' is not one of off, auto, ngram, suffix, model\n",
                    cmd, arg);
            return -1;
        }
        return 1;
    case RUNNER_EO_OPT_DRAFT_MODEL:
        o->draft_model = arg;
        return 1;
    case RUNNER_EO_OPT_SPEC_K:
        if (!runner_parse_long(cmd, "spec-max-k", arg, 1, ENGINE_SPEC_MAX_K, &l))
            return -1;
        o->ep.spec_max_k = (int)l;
        o->spec_tuned = "--spec-max-k";
        return 1;
    case RUNNER_EO_OPT_SPEC_BUDGET:
        if (!strcmp(arg, "auto") || !strcmp(arg, "all")) {
            o->ep.spec_budget = arg[0] == 'a' && arg[1] == 'l' ? ENGINE_SPEC_BUDGET_ALL
                                                               : ENGINE_SPEC_BUDGET_AUTO;
            o->spec_tuned = "--spec-budget";
            return 1;
        }
        fprintf(stderr, "quern %s: --spec-budget: '%s' is not auto or all\n", cmd, arg);
        return -1;
    case RUNNER_EO_OPT_TP:
        return runner_parse_long(cmd, "tp", arg, 1, 64, &o->tp) ? 1 : -1;
    case RUNNER_EO_OPT_THREADS:
        if (!runner_parse_long(cmd, "threads", arg, 1, 256, &o->threads))
            return -1;
        if (o->threads > runner_default_threads()) /* (an audit: 256 on 2 CPUs, 25-35x slower) */
            LOG_WARN("--threads %ld is more than the %d CPUs this process may use: the threads "
                     "wait on each other, much slower than %d",
                     o->threads, runner_default_threads(), runner_default_threads());
        return 1;
    case RUNNER_EO_OPT_MATMUL:
        return runner_parse_matmul(cmd, arg, &o->act) ? 1 : -1;
    case RUNNER_EO_OPT_KVMEM:
        if (!strcmp(arg, "auto")) {
            o->ep.kv_mem = 0;
            return 1;
        }
        return runner_parse_size(cmd, "kv-mem", arg, &o->ep.kv_mem) ? 1 : -1;
    case RUNNER_EO_OPT_KVDTYPE:
        return runner_parse_kv_dtype(cmd, arg, &o->ep.kv_dtype) ? 1 : -1;
    case RUNNER_EO_OPT_KVBLOCK:
        if (!runner_parse_long(cmd, "kv-block", arg, 1, 4096, &l))
            return -1;
        o->ep.kv_block = (int)l;
        return 1;
    case RUNNER_EO_OPT_SEQS:
        if (!runner_parse_long(cmd, "max-seqs", arg, 1, 1 << 16, &l))
            return -1;
        o->ep.max_seqs = (int)l;
        return 1;
    case RUNNER_EO_OPT_BATCH:
        if (!runner_parse_long(cmd, "max-batch-tokens", arg, 1, 1 << 20, &l))
            return -1;
        o->ep.max_batch_tokens = (int)l;
        return 1;
    default:
        return 0;
    }
}

void runner_engine_help(FILE *f, unsigned groups)
{
    if (groups & RUNNER_EO_DUMMY)
        fprintf(f,
                "  --dummy PRESET         no weight file: the preset's real sizes with random Q4_0\n"
                "                         weights made in memory (fixed seed), the tokenizer and\n"
                "                         chat template of --model; PRESET is one of\n"
                "                         %s\n"
                "                         (each with its architecture's extra tensors); for\n"
                "                         speed and memory: the text is noise\n",
                engine_dummy_names());
    if (groups & RUNNER_EO_BACKEND)
        fputs(
            "  --device NAME          compute device: auto|cpu|cuda (default auto); `quern info`\n"
            "                         lists the ones this build has\n"
            "  --threads N            CPU threads (default: the CPUs this process may use:\n"
            "                         affinity mask, cgroup CPU quota), shared by the ranks\n"
            "  --tp N                 tensor-parallel ranks (default 1): every matrix split by\n"
            "                         output rows (attention by heads, the KV cache by KV head),\n"
            "                         the slices all-gathered (four a layer), the outputs bitwise\n"
            "                         one rank's; the model's query and KV heads and FFN rows "
            "must\n"
            "                         divide by N (SmolLM2-135M: 1 or 3). On the CPU the ranks "
            "are\n"
            "                         threads of this process (a CPU has no faster path: for\n"
            "                         tests); on CUDA rank r runs on GPU r joined by NCCL where N\n"
            "                         GPUs and libnccl.so.2 are found, else all on GPU 0 through\n"
            "                         host memory (QUERN_TP_COMM=auto|nccl|staged; `quern info`)\n"
            "  --isa NAME             auto|scalar|avx2|avxvnni|avx512|amx (default auto)\n"
            "  --matmul MODE          q8 (default on CPUs without AMX-BF16): 8-bit activations as\n"
            "                         llama.cpp, the fastest mode whose perplexity is within\n"
            "                         0.5 % of exact's (+0.42 % on `make eval`'s text);\n"
            "                         bf16 (default on AMX-BF16 CPUs): activations and weights\n"
            "                         rounded to bfloat16 (on AMX: exact's perplexity, 1.5x q8's\n"
            "                         batched speed, half its speed for one sequence alone;\n"
            "                         CUDA: tensor cores); exact (default on CUDA): f32\n"
            "                         activations, matches the float reference "
            "(bit-reproducible);\n"
            "                         q16: 16-bit activations with exact integer sums\n"
            "                         (Q4_0/Q4_1/Q8_0 weights, near-exact); CUDA runs exact, bf16\n"
            "                         and q8\n",
            f);
    if (groups & RUNNER_EO_BATCH)
        fputs("  --max-seqs S           sequences running at once (default 256; 1 = no batching)\n"
              "  --max-batch-tokens T   tokens per forward step, >= --max-seqs (default 512)\n",
              f);
    if (groups & RUNNER_EO_PREFIX)
        fputs("  --no-prefix-cache      disable automatic prefix caching\n", f);
    if (groups & RUNNER_EO_SPEC)
        fprintf(
            f,
            "  --spec MODE            speculative decoding: off (default), auto (both drafters),\n"
            "                         ngram (the request's own tokens), suffix (the job's\n"
            "                         finished outputs) or model (--draft-model);\n"
            "                         lossless: the same tokens as off\n"
            "  --draft-model PATH     GGUF draft model for --spec model: the same vocabulary;\n"
            "                         its KV cache gets as many blocks as the model's KV\n"
            "                         pool (its own bytes per block)\n"
            "  --spec-max-k K         draft tokens per sequence and step at most (1..%d,\n"
            "                         default 8)\n"
            "  --spec-budget B        auto (default): verify only the draft tokens expected to\n"
            "                         raise tokens/second at the current load (none at full\n"
            "                         batch); all: every drafted token\n",
            ENGINE_SPEC_MAX_K);
    if (groups & RUNNER_EO_KV)
        fputs(
            "  --kv-mem SIZE|auto     KV cache pool, e.g. 2G (default auto: on the CPU a quarter\n"
            "                         of the memory available to this process (its cgroup's\n"
            "                         limit too, e.g. Slurm's --mem), at most what --max-seqs\n"
            "                         sequences at the model's full context take, at least\n"
            "                         1G and one such sequence; on CUDA what the devices\n"
            "                         have free once the weights and buffers are in, less\n"
            "                         5 % (at least 256M) for the runtime, at most the same)\n"
            "  --kv-block B           tokens per KV block (default 16)\n"
            "  --kv-dtype f16|q8      KV cache storage (default f16: 16 bits per value, stored\n"
            "                         as bfloat16 for the tile unit in the bf16 matmul mode on\n"
            "                         AMX; q8: 8 bits per value with a scale per token and head,\n"
            "                         half the bytes, less accurate)\n"
            "  --no-window-pool       keep sliding-window layers (Gemma 3) in the main KV pool\n"
            "                         instead of their own, whose blocks are given back once out\n"
            "                         of the window (sized for sequences two windows long)\n",
            f);
}

struct kern_backend_opts runner_engine_backend(struct runner_engine_opts *o)
{
    if (o->act == RUNNER_ACT_DEFAULT)
        o->act = (int)kern_default_act(o->device, o->isa);
    struct kern_backend_opts ko = {o->device, (int)o->threads, o->isa, (enum kern_act)o->act,
                                   0,         (int)o->tp,      0};
    return ko;
}

enum status runner_model_load(struct engine_model **out, const char *path,
                              const struct runner_engine_opts *o, const struct kern_group *grp,
                              struct err_detail *err)
{
    *out = NULL;
    if (!o->dummy)
        return grp ? engine_model_load_group(out, path, grp, err)
                   : engine_model_load(out, path, NULL, err);
    struct io_gguf *tok, *g;
    enum status st = io_gguf_open(&tok, path, err);
    if (st)
        return st;
    st = engine_dummy_gguf(&g, o->dummy, tok, DUMMY_SEED, 0, grp != NULL, err);
    io_gguf_close(tok);
    if (st)
        return st;
    st = grp ? engine_model_from_gguf_group(out, g, grp, err)
             : engine_model_from_gguf(out, g, NULL, err);
    if (st) {
        err_prefix(err, "--dummy %s", o->dummy);
        io_gguf_close(g);
    }
    return st;
}

const char *runner_model_label(const char *path, const struct runner_engine_opts *o, char *buf,
                               size_t size)
{
    if (!o->dummy)
        return path;
    snprintf(buf, size, "dummy %s (tokenizer of %s)", o->dummy, path);
    return buf;
}

int runner_engine_opts_check(const char *cmd, const struct runner_engine_opts *o)
{
    if (o->ep.max_batch_tokens < o->ep.max_seqs) {
        fprintf(stderr, "quern %s: --max-batch-tokens (%d) must be at least --max-seqs (%d)\n", cmd,
                o->ep.max_batch_tokens, o->ep.max_seqs);
        return 0;
    }
    const int model = (o->ep.spec & ENGINE_SPEC_MODEL) != 0;
    if (model && !o->draft_model) {
        fprintf(stderr, "quern %s: --spec model needs --draft-model PATH\n", cmd);
        return 0;
    }
    if (!model && o->draft_model) {
        fprintf(stderr, "quern %s: --draft-model is used with --spec model\n", cmd);
        return 0;
    }
    if (!o->ep.spec && o->spec_tuned) {
        fprintf(stderr,
                "quern %s: %s tunes speculative decoding, which is off: give --spec "
                "ngram|suffix|auto|model too\n",
                cmd, o->spec_tuned);
        return 0;
    }
    return 1;
}

enum status runner_draft_load(struct engine_model **out, struct runner_engine_opts *o,
                              const struct kern_group *grp, struct err_detail *err)
{
    *out = NULL;
    if (!(o->ep.spec & ENGINE_SPEC_MODEL))
        return ST_OK;
    enum status st = engine_model_load_group(out, o->draft_model, grp, err);
    if (st)
        err_prefix(err, "--draft-model %s", o->draft_model);
    o->ep.draft_model = *out;
    return st;
}
