/* `quern plan`: memory plan for a model and KV budget: weight bytes, KV bytes per token, and
 * how many tokens and sequences of a given length the pool holds. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "io/gguf.h"
#include "kernels/kernels.h"
#include "runner/engine_opts.h"
#include "runner/runner.h"

static const char plan_usage[] =
    "usage: quern plan [--model PATH] [--kv-mem SIZE] [--kv-block B] [--kv-dtype f16|q8]\n"
    "                  [--seq-len L] [--json]\n"
    "\n"
    "Print the memory plan: weights (and the copy this CPU's kernels repack at load for the\n"
    "default exact matmul mode), KV cache bytes per token (layers x 2 x kv_heads x head_dim x\n"
    "2 bytes in f16; with q8, 1 byte per value plus a 4-byte scale per token and head), and how\n"
    "many tokens / sequences of length L fit in --kv-mem.\n"
    "Warns when the budget cannot hold one sequence of the model's full context.\n"
    "\n"
    "  --model PATH           GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --seq-len L            sequence length (prompt + output) to count (default 1024)\n"
    "  --json                 print JSON instead of text\n";

static void usage(FILE *f)
{
    fputs(plan_usage, f);
    runner_engine_help(f, RUNNER_EO_KV);
    fputs("  -h, --help             this help\n", f);
}

int runner_cmd_plan(int argc, char **argv)
{
    static const struct option own[] = {
        {"model", required_argument, 0, 'm'}, {"seq-len", required_argument, 0, 'l'},
        {"json", no_argument, 0, 'j'},          {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    struct option longopts[sizeof(own) / sizeof(own[0]) + RUNNER_EO_MAX_LONGOPTS];
    runner_engine_longopts(longopts, sizeof(longopts) / sizeof(longopts[0]), own, RUNNER_EO_KV);
    struct runner_engine_opts eo;
    runner_engine_opts_default(&eo);
    const char *model = RUNNER_DEFAULT_MODEL;
    long seq_len = 1024;
    int json = 0, c, e;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if ((e = runner_engine_opt("plan", c, optarg, &eo)) != 0) {
            if (e < 0)
                return RUNNER_EXIT_USAGE;
            continue;
        }
        switch (c) {
        case 'm': model = optarg; break;
        case 'j': json = 1; break;
        case 'l':
            if (!runner_parse_long("plan", "seq-len", optarg, 1, 1 << 24, &seq_len))
                return RUNNER_EXIT_USAGE;
            break;
        case 'h': usage(stdout); return RUNNER_EXIT_OK;
        default: usage(stderr); return RUNNER_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern plan: unexpected argument '%s'\n", argv[optind]);
        return RUNNER_EXIT_USAGE;
    }
    const size_t kv_mem = eo.ep.kv_mem;
    const long block = eo.ep.kv_block;
    const int dtype = eo.ep.kv_dtype;
    struct err_detail err = {0};
    struct engine_model *m;
    /* the plan needs no compute: load the model without a backend */
    if (engine_model_load(&m, model, NULL, &err)) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    const struct engine_hparams *hp = engine_model_hparams(m);
    uint64_t weights = 0;
    for (uint64_t i = 0; i < engine_model_gguf(m)->n_tensors; i++)
        weights += engine_model_gguf(m)->tensors[i].nbytes;
    /* the copy of the matrices the backend repacks at load (default exact mode; 0 where it
     * packs nothing) */
    struct kern_backend *be;
    struct kern_backend_opts ko = {.n_threads = 1, .act = KERN_ACT_F32};
    if (kern_backend_open(&be, &ko, &err)) {
        LOG_ERROR("%s", err.msg);
        engine_model_free(m);
        return RUNNER_EXIT_ERROR;
    }
    uint64_t packed = 0;
    for (int l = 0; be->ops->weight_bytes && l <= hp->n_layer; l++) {
        const struct kern_tensor *ws[ENGINE_MAX_LAYER_WEIGHTS];
        for (int i = 0, nw = engine_model_weights(m, l, ws); i < nw; i++)
            packed += be->ops->weight_bytes(be, ws[i]);
    }
    size_t per_tok = engine_kv_bytes_per_token(hp->n_layer, hp->n_kv_head, hp->head_dim, dtype);
    size_t per_block = per_tok * (size_t)block;
    size_t blocks = kv_mem / per_block;
    size_t tokens = blocks * (size_t)block;
    size_t blocks_per_seq = ((size_t)seq_len + (size_t)block - 1) / (size_t)block;
    size_t seqs = blocks / blocks_per_seq;
    size_t ctx_blocks = ((size_t)hp->n_ctx_train + (size_t)block - 1) / (size_t)block;
    int full_ctx_fits = blocks >= ctx_blocks;
    if (json) {
        printf("{\"model\": \"%s\", \"weights_bytes\": %llu, \"kv_bytes_per_token\": %zu, "
               "\"kv_dtype\": \"%s\", \"kv_mem\": %zu, \"kv_block\": %ld, \"kv_blocks\": %zu, "
               "\"kv_tokens\": %zu, "
               "\"seq_len\": %ld, \"sequences\": %zu, \"context\": %d, "
               "\"full_context_fits\": %s, \"packed_weights_bytes\": %llu}\n",
               model, (unsigned long long)weights, per_tok, runner_kv_dtype_name(dtype), kv_mem,
               block, blocks, tokens,
               seq_len, seqs, hp->n_ctx_train, full_ctx_fits ? "true" : "false",
               (unsigned long long)packed);
    } else {
        printf("model:               %s\n", model);
        printf("weights:             %.1f MiB (%llu bytes, mapped from the file)\n",
               (double)weights / 1048576.0, (unsigned long long)weights);
        if (dtype == KERN_KV_Q8)
            printf("KV per token:        %zu bytes (%d layers x 2 x %d kv heads x (%d dims x 1 B + "
                   "4 B scale), q8)\n",
                   per_tok, hp->n_layer, hp->n_kv_head, hp->head_dim);
        else
            printf("KV per token:        %zu bytes (%d layers x 2 x %d kv heads x %d dims x 2 B, "
                   "f16)\n",
                   per_tok, hp->n_layer, hp->n_kv_head, hp->head_dim);
        printf("KV pool:             %.1f MiB = %zu blocks of %ld tokens = %zu tokens\n",
               (double)kv_mem / 1048576.0, blocks, block, tokens);
        printf("sequences:           %zu of %ld tokens at once\n", seqs, seq_len);
        printf("context:             %d tokens (%s)\n", hp->n_ctx_train,
               full_ctx_fits ? "one full-context sequence fits" : "does NOT fit");
        printf("packed weights:      %.1f MiB (the matrices repacked at load for %s kernels)\n",
               (double)packed / 1048576.0, kern_backend_describe(be));
        printf("total resident:      ~%.1f MiB (weights + packed copy + KV pool when full, plus "
               "activations)\n",
               (double)(weights + packed + kv_mem) / 1048576.0);
    }
    if (!full_ctx_fits)
        LOG_WARN("--kv-mem %.1f MiB cannot hold one full-context sequence (%d tokens need "
                 "%.1f MiB); long requests will be rejected",
                 (double)kv_mem / 1048576.0, hp->n_ctx_train,
                 (double)(ctx_blocks * per_block) / 1048576.0);
    kern_backend_free(be);
    engine_model_free(m);
    return RUNNER_EXIT_OK;
}
