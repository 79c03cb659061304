/* `quern plan`: memory plan for a model and KV budget: weight bytes, KV bytes per token, and
 * how many tokens and sequences of a given length the pool holds. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpus.h"
#include "common/log.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "io/gguf.h"
#include "kernels/cuda/cuda_sizes.h"
#include "kernels/kernels.h"
#include "runner/engine_opts.h"
#include "runner/runner.h"

static const char plan_usage[] =
    "usage: quern plan [--model PATH | --dummy PRESET] [--tp N] [--mem SIZE | --kv-mem SIZE]\n"
    "                  [--device cpu|cuda] [--matmul MODE] [--kv-block B] [--kv-dtype f16|q8]\n"
    "                  [--max-seqs N] [--max-batch-tokens N] [--seq-len L] [--json]\n"
    "\n"
    "Print the memory plan: weights (and the copy this CPU's kernels repack at load for the\n"
    "default matmul mode), KV cache bytes per token (layers x 2 x kv_heads x head_dim x\n"
    "2 bytes in f16; with q8, 1 byte per value plus a 4-byte scale per token and head), and how\n"
    "many tokens / sequences of length L fit in the KV pool. With --tp N, per rank: 1/N of every\n"
    "layer's matrices and KV heads, plus the embedding, output head and norms (replicated).\n"
    "With --mem, the pool is what each rank's memory holds after its weights and a reserve\n"
    "for activations (5 %, at least 256 MiB); --kv-mem is then ignored.\n"
    "With --device cuda (no GPU needed), each rank's device memory is counted as the CUDA\n"
    "backend holds it: the weights in its layout (4- and 8-bit matrices repacked), the\n"
    "engine's buffers for --max-batch-tokens tokens over --max-seqs sequences (logits rows\n"
    "included), the backend's scratch (greedy keys, split attention's 64 MiB, the device\n"
    "sampler's, the matmul inputs in bf16 or 8 bits with --matmul bf16 or q8) and the same\n"
    "reserve for the CUDA runtime.\n"
    "Warns when the pool cannot hold one sequence of the model's full context.\n"
    "\n"
    "  --model PATH           GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --tp N                 tensor-parallel ranks (default 1)\n"
    "  --mem SIZE             memory of each rank's device, e.g. 80G (a GPU's HBM)\n"
    "  --device cpu|cuda      the backend to plan for (default cpu)\n"
    "  --matmul MODE          cuda: exact (default), bf16 or q8 (their scratch differs)\n"
    "  --seq-len L            sequence length (prompt + output) to count (default 1024)\n"
    "  --json                 print JSON instead of text\n";

static void usage(FILE *f)
{
    fputs(plan_usage, f);
    runner_engine_help(f, RUNNER_EO_KV | RUNNER_EO_BATCH | RUNNER_EO_DUMMY);
    fputs("  -h, --help             this help\n", f);
}

/* The smallest KV pool in (lo, hi] whose main part the engine's split gives main_blocks blocks,
 * to within step bytes, by bisection over engine_model_kv_plan (a window pool takes its share
 * first); hi when even hi does not. */
static size_t pool_for(const struct engine_model *m, const struct engine_kv_plan_in *in, size_t lo,
                       size_t hi, int64_t main_blocks, size_t step)
{
    struct engine_kv_plan_in q = *in;
    struct engine_kv_plan t;
    for (int i = 0; i < 64 && hi - lo > step; i++) {
        q.kv_mem = lo + (hi - lo) / 2;
        engine_model_kv_plan(m, &q, &t);
        if (t.n_main >= main_blocks)
            hi = q.kv_mem;
        else
            lo = q.kv_mem;
    }
    return hi;
}

int runner_cmd_plan(int argc, char **argv)
{
    static const struct option own[] = {
        {"model", required_argument, 0, 'm'},
        {"seq-len", required_argument, 0, 'l'},
        {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'},
        {"tp", required_argument, 0, 't'},
        {"mem", required_argument, 0, 'M'},
        {"device", required_argument, 0, 'd'},
        {"matmul", required_argument, 0, 'x'},
        {0, 0, 0, 0},
    };
    struct option longopts[sizeof(own) / sizeof(own[0]) + RUNNER_EO_MAX_LONGOPTS];
    runner_engine_longopts(longopts, sizeof(longopts) / sizeof(longopts[0]), own,
                           RUNNER_EO_KV | RUNNER_EO_BATCH | RUNNER_EO_DUMMY);
    struct runner_engine_opts eo;
    runner_engine_opts_default(&eo);
    const char *model = RUNNER_DEFAULT_MODEL;
    long seq_len = 1024, tp = 1;
    size_t mem = 0;
    int json = 0, c, e, cuda = 0;
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
        case 't':
            if (!runner_parse_long("plan", "tp", optarg, 1, 64, &tp))
                return RUNNER_EXIT_USAGE;
            break;
        case 'M':
            if (!runner_parse_size("plan", "mem", optarg, &mem))
                return RUNNER_EXIT_USAGE;
            break;
        case 'd':
            if (strcmp(optarg, "cpu") && strcmp(optarg, "cuda")) {
                fprintf(stderr, "quern plan: --device %s: want cpu or cuda\n", optarg);
                return RUNNER_EXIT_USAGE;
            }
            cuda = !strcmp(optarg, "cuda");
            break;
        case 'x':
            if (!runner_parse_matmul("plan", optarg, &eo.act))
                return RUNNER_EXIT_USAGE;
            break;
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
    if (!runner_engine_opts_check("plan", &eo))
        return RUNNER_EXIT_USAGE;
    if (cuda && eo.act == RUNNER_ACT_DEFAULT)
        eo.act = KERN_ACT_F32; /* the CUDA backend's default mode */
    if (cuda && eo.act == KERN_ACT_Q16) {
        fprintf(stderr, "quern plan: --device cuda runs --matmul exact, bf16 or q8, not %s\n",
                kern_act_name((enum kern_act)eo.act));
        return RUNNER_EXIT_USAGE;
    }
    size_t kv_mem = eo.ep.kv_mem;
    const long block = eo.ep.kv_block;
    const int dtype = eo.ep.kv_dtype;
    struct err_detail err = {0};
    struct engine_model *m;
    /* the plan needs no compute: load the model without a backend */
    if (runner_model_load(&m, model, &eo, NULL, &err)) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    const struct engine_hparams *hp = engine_model_hparams(m);
    if (hp->n_head % tp || hp->n_kv_head % tp || hp->n_ff % tp || hp->n_ff_shexp % tp ||
        hp->n_embd % tp) {
        char shexp[48] = "";
        if (hp->n_ff_shexp)
            snprintf(shexp, sizeof(shexp), " (%d of its shared expert)", hp->n_ff_shexp);
        LOG_ERROR("--tp %ld: the model's %d query heads, %d KV heads, %d FFN rows%s and %d hidden "
                  "rows must divide by it",
                  tp, hp->n_head, hp->n_kv_head, hp->n_ff, shexp, hp->n_embd);
        engine_model_free(m);
        return RUNNER_EXIT_ERROR;
    }
    /* the copy of the matrices the CPU backend repacks at load in its default matmul mode (0
     * where it packs nothing); for CUDA the device holds each matrix in its own layout instead */
    struct kern_backend *be = NULL;
    if (!cuda) {
        eo.device = "cpu";
        struct kern_backend_opts ko = runner_engine_backend(&eo);
        ko.n_threads = 1;
        ko.tp = 1;
        if (kern_backend_open(&be, &ko, &err)) {
            LOG_ERROR("%s", err.msg);
            engine_model_free(m);
            return RUNNER_EXIT_ERROR;
        }
    }
    /* every tensor, split (layer matrices) or replicated (the rest) over the ranks */
    uint64_t weights = 0, split = 0, packed = 0, mats = 0, dev_w = 0;
    for (uint64_t i = 0; i < engine_model_gguf(m)->n_tensors; i++)
        weights += engine_model_gguf(m)->tensors[i].nbytes;
    for (int l = 0; l <= hp->n_layer; l++) {
        const struct kern_tensor *ws[ENGINE_MAX_LAYER_WEIGHTS];
        const struct kern_tensor *xs = engine_model_experts(m, l); /* a mixture's experts */
        const int nw = engine_model_weights(m, l, ws), nx = xs ? 3 * engine_hp_n_ffns(hp) : 0;
        for (int i = 0; i < nw + nx; i++) {
            const struct kern_tensor *w = i < nw ? ws[i] : &xs[i - nw];
            /* the layers' matrices are split, but a router and a shared expert's gate (a
             * mixture's list after q, k, v, o) are whole on every rank, as the output head is */
            const int whole = l == hp->n_layer || (xs && i >= 4 && i < nw);
            mats += (uint64_t)w->ne1 * w->row_bytes;
            if (!whole)
                split += (uint64_t)w->ne1 * w->row_bytes;
            dev_w += kcu_weight_device_bytes(w->type, w->ne0, whole ? w->ne1 : w->ne1 / tp,
                                             w->row_bytes, 1);
            if (be && be->ops->weight_bytes)
                packed += be->ops->weight_bytes(be, w);
        }
    }
    const struct kern_tensor *emb = engine_model_untied_embedding(m); /* prepared like a matrix */
    if (emb) {
        mats += (uint64_t)emb->ne1 * emb->row_bytes;
        dev_w += kcu_weight_device_bytes(emb->type, emb->ne0, emb->ne1, emb->row_bytes, 1);
    }
    dev_w += weights > mats ? weights - mats : 0; /* norms and the rest as in the file */
    /* CUDA: the engine's buffers and the backend's scratch on each rank (rank 0's: the logits) */
    const int max_tok = eo.ep.max_batch_tokens, max_seqs = eo.ep.max_seqs;
    const int tbl_blocks = (int)((hp->n_ctx_train + block - 1) / block) + 1; /* as reserve */
    const int64_t qd = (int64_t)hp->n_head * hp->head_dim;
    int64_t widest = engine_hp_ffn_width(hp) > hp->n_embd ? engine_hp_ffn_width(hp) : hp->n_embd;
    widest = widest > qd ? widest : qd;
    const size_t dev_act =
        cuda ? engine_model_stage_bytes(m, (int)tp, 0, max_tok, max_seqs, tbl_blocks, 1) : 0;
    const size_t dev_scratch =
        cuda ? kcu_scratch_bytes(eo.act == KERN_ACT_BF16 ? 1
                                 : eo.act == KERN_ACT_Q8 ? 2
                                                         : 0,
                                 max_tok, widest, max_tok < max_seqs ? max_tok : max_seqs,
                                 hp->n_vocab)
             : 0;
    /* a rank's resident weights: the file's bytes (mapped) and the repacked copy on the CPU;
     * the device copy alone on CUDA */
    const uint64_t w_rank = cuda ? dev_w : split / (uint64_t)tp + (weights - split);
    const uint64_t p_rank = packed / (uint64_t)tp; /* about: the head's share is small */
    const size_t counted = (size_t)(w_rank + p_rank) + dev_act + dev_scratch;
    size_t per_tok = engine_kv_bytes_per_token(hp->n_layer, hp->n_kv_head, hp->head_dim, dtype);
    const size_t per_tok_rank = per_tok / (size_t)tp;
    size_t reserve = 0;
    if (mem) {
        reserve = engine_device_reserve(mem);
        kv_mem = mem > counted + reserve ? (mem - counted - reserve) * (size_t)tp : 0;
    }
    const int kv_auto = !mem && !kv_mem; /* --kv-mem auto: what a run here would make */
    /* (on CUDA a run's pool is what the device has free beside the rest, at most --max-seqs
     * full-context sequences: that most, which the model's plan without a backend is given by
     * memory without bound) */
    if (kv_auto)
        kv_mem = engine_kv_mem_auto(m, &eo.ep, cuda ? UINT64_MAX : mem_available());
    size_t per_block = per_tok * (size_t)block;
    /* the engine's own split: sliding-window layers in a pool of their own (engine_kv_plan) */
    const struct engine_kv_plan_in pin = {kv_mem,          (int)block,
                                          dtype,           eo.ep.max_seqs,
                                          eo.ep.max_batch_tokens, eo.ep.kv_window_pool};
    struct engine_kv_plan plan;
    engine_model_kv_plan(m, &pin, &plan);
    size_t blocks = plan.n_main > 0 ? (size_t)plan.n_main : 0;
    size_t tokens = blocks * (size_t)block;
    if (seq_len > hp->n_ctx_train)
        LOG_WARN("--seq-len %ld is longer than the model's context (%d tokens): no request can "
                 "be that long (counted as asked)",
                 seq_len, hp->n_ctx_train);
    size_t blocks_per_seq = ((size_t)seq_len + (size_t)block - 1) / (size_t)block;
    size_t fit = blocks / blocks_per_seq; /* what the pools hold */
    int n_local = 0;
    for (int l = 0; l < hp->n_layer; l++)
        n_local += engine_model_layer_local(m, l);
    if (plan.n_local) { /* a sequence holds its window's blocks there (and a partial one) */
        const size_t win = ((size_t)hp->swa_window - 1 + (size_t)block - 1) / (size_t)block + 2;
        size_t w_seqs = (size_t)plan.n_local / (win < blocks_per_seq ? win : blocks_per_seq);
        fit = w_seqs < fit ? w_seqs : fit;
    }
    /* the engine runs at most --max-seqs */
    const size_t seqs = fit < (size_t)eo.ep.max_seqs ? fit : (size_t)eo.ep.max_seqs;
    size_t ctx_blocks = ((size_t)hp->n_ctx_train + (size_t)block - 1) / (size_t)block;
    int full_ctx_fits = blocks >= ctx_blocks;
    /* the smallest pool whose main part holds one full-context sequence, as the engine splits
     * it (beside a window pool, the main pool holds only the global layers) */
    size_t ctx_need = ctx_blocks * per_block;
    if (plan.n_local && !full_ctx_fits)
        ctx_need = pool_for(m, &pin, kv_mem, ctx_need, (int64_t)ctx_blocks, 1048576);
    /* the smallest pool that holds a block at all (beside a window pool: one in each) */
    size_t block_need = per_block;
    if (plan.n_local && !blocks)
        block_need = pool_for(m, &pin, kv_mem, 64 * per_block, 1, 1);
    const int weights_fit = !mem || kv_mem > 0;
    char label[512];
    const char *name = runner_model_label(model, &eo, label, sizeof(label));
    if (json) {
        char *qname = runner_json_quote(name); /* NULL only when out of memory */
        printf("{\"model\": %s, \"weights_bytes\": %llu, \"kv_bytes_per_token\": %zu, "
               "\"kv_dtype\": \"%s\", \"kv_mem\": %zu, \"kv_block\": %ld, \"kv_blocks\": %zu, "
               "\"kv_tokens\": %zu, "
               "\"seq_len\": %ld, \"sequences\": %zu, \"context\": %d, "
               "\"full_context_fits\": %s, \"packed_weights_bytes\": %llu, \"tp\": %ld, "
               "\"rank_weights_bytes\": %llu, \"rank_kv_bytes_per_token\": %zu, "
               "\"mem\": %zu, \"weights_fit\": %s, \"kv_window\": %d, "
               "\"kv_window_layers\": %d, \"kv_window_blocks\": %lld, \"device\": \"%s\", "
               "\"matmul\": \"%s\", \"rank_activation_bytes\": %zu, "
               "\"rank_scratch_bytes\": %zu, \"reserve_bytes\": %zu, \"logits_bytes\": %zu, "
               "\"kv_mem_auto\": %s, \"experts\": %d, \"experts_used\": %d}\n",
               qname ? qname : "null", (unsigned long long)weights, per_tok,
               kern_kv_dtype_name((enum kern_kv_dtype)dtype), kv_mem, block, blocks, tokens,
               seq_len, seqs, hp->n_ctx_train, full_ctx_fits ? "true" : "false",
               (unsigned long long)packed, tp, (unsigned long long)w_rank, per_tok_rank, mem,
               weights_fit ? "true" : "false", plan.n_local ? plan.window : 0,
               plan.n_local ? n_local : 0, (long long)plan.n_local, cuda ? "cuda" : "cpu",
               kern_act_name((enum kern_act)eo.act), dev_act, dev_scratch, reserve,
               engine_logits_bytes(&eo.ep, hp->n_vocab), kv_auto ? "true" : "false", hp->n_expert,
               hp->n_expert_used);
        free(qname);
    } else {
        printf("model:               %s\n", name);
        printf("weights:             %.1f MiB (%llu bytes, %s)\n", (double)weights / 1048576.0,
               (unsigned long long)weights,
               eo.dummy ? "random, built in memory: --dummy" : "mapped from the file");
        if (hp->n_expert) {
            printf("experts:             %d per layer, %d a token, each %d wide", hp->n_expert,
                   hp->n_expert_used, hp->n_ff);
            if (hp->n_ff_shexp)
                printf("; a shared expert %d wide", hp->n_ff_shexp);
            printf("\n");
        }
        if (dtype == KERN_KV_Q8)
            printf("KV per token:        %zu bytes (%d layers x 2 x %d kv heads x (%d dims x 1 B + "
                   "4 B scale), q8)\n",
                   per_tok, hp->n_layer, hp->n_kv_head, hp->head_dim);
        else
            printf("KV per token:        %zu bytes (%d layers x 2 x %d kv heads x %d dims x 2 B, "
                   "f16)\n",
                   per_tok, hp->n_layer, hp->n_kv_head, hp->head_dim);
        if (tp > 1)
            printf("per rank (--tp %ld):  weights %.1f MiB (1/%ld of the layers + embedding, head "
                   "and norms), KV %zu bytes per token\n",
                   tp, (double)w_rank / 1048576.0, tp, per_tok_rank);
        if (cuda)
            printf("on the GPU, a rank:  weights %.1f MiB (the CUDA layout), engine buffers %.1f "
                   "MiB (%d tokens, %d sequences, logits rows), backend scratch %.1f MiB (matmul "
                   "%s)\n",
                   (double)w_rank / 1048576.0, (double)dev_act / 1048576.0, max_tok, max_seqs,
                   (double)dev_scratch / 1048576.0, kern_act_name((enum kern_act)eo.act));
        if (mem && cuda)
            printf("device memory:       %.1f MiB per rank: weights, buffers and scratch %.1f MiB, "
                   "runtime reserve %.1f MiB, KV pool %.1f MiB%s\n",
                   (double)mem / 1048576.0, (double)counted / 1048576.0,
                   (double)reserve / 1048576.0, (double)kv_mem / (double)tp / 1048576.0,
                   weights_fit ? "" : " (the weights do NOT fit)");
        else if (mem)
            printf("device memory:       %.1f MiB per rank: weights %.1f MiB, activation reserve "
                   "%.1f MiB, KV pool %.1f MiB%s\n",
                   (double)mem / 1048576.0, (double)(w_rank + p_rank) / 1048576.0,
                   (double)reserve / 1048576.0, (double)kv_mem / (double)tp / 1048576.0,
                   weights_fit ? "" : " (the weights do NOT fit)");
        char all[40] = "";
        if (tp > 1) /* (the pool and the totals below: every rank's together) */
            snprintf(all, sizeof(all), " (all %ld ranks)", tp);
        const char *how = !kv_auto ? ""
                          : cuda   ? " (--kv-mem auto on CUDA: at most this, what the device "
                                     "has free at start; --mem plans a GPU's)"
                                   : " (--kv-mem auto: on this machine now)";
        if (!plan.n_local) {
            printf("KV pool:             %.1f MiB%s%s = %zu blocks of %ld tokens = %zu tokens\n",
                   (double)kv_mem / 1048576.0, all, how, blocks, block, tokens);
        } else {
            printf(
                "KV pool:             %.1f MiB%s = %zu blocks of %ld tokens = %zu tokens for the "
                "%d global layers\n",
                (double)((size_t)plan.n_main * plan.bytes_main) / 1048576.0, how, blocks, block,
                tokens, hp->n_layer - n_local);
            printf("window pool:         %.1f MiB = %lld blocks for the %d sliding-window layers "
                   "(%d positions: blocks that leave the window are given back)\n",
                   (double)((size_t)plan.n_local * plan.bytes_local) / 1048576.0,
                   (long long)plan.n_local, n_local, plan.window);
        }
        if (seqs < fit)
            printf("sequences:           %zu of %ld tokens at once (--max-seqs; the pool holds "
                   "%zu)\n",
                   seqs, seq_len, fit);
        else
            printf("sequences:           %zu of %ld tokens at once\n", seqs, seq_len);
        printf("context:             %d tokens (%s)\n", hp->n_ctx_train,
               full_ctx_fits ? "one full-context sequence fits" : "does NOT fit");
        if (be) {
            printf("packed weights:      %.1f MiB (the matrices repacked at load for %s kernels, "
                   "matmul %s)\n",
                   (double)packed / 1048576.0, kern_backend_describe(be),
                   kern_act_name((enum kern_act)eo.act));
            const size_t lg = engine_logits_bytes(&eo.ep, hp->n_vocab);
            printf("engine logits:       %.1f MiB (%d rows of %d floats: --max-seqs)\n",
                   (double)lg / 1048576.0, engine_logit_rows(&eo.ep), (int)hp->n_vocab);
            printf("total resident:      ~%.1f MiB%s (weights + packed copy + KV pool when full + "
                   "logits, plus activations)\n",
                   (double)(weights + packed + kv_mem + lg) / 1048576.0, all);
        } else
            printf("total on the GPUs:   ~%.1f MiB%s (each rank's weights, buffers and scratch + "
                   "KV pool when full, plus the runtime)\n",
                   (double)(counted * (size_t)tp + kv_mem) / 1048576.0, all);
    }
    if (!weights_fit)
        LOG_WARN("--mem %.1f MiB per rank does not hold the %.1f MiB of weights%s each rank needs",
                 (double)mem / 1048576.0, (double)counted / 1048576.0,
                 cuda ? ", buffers and scratch" : "");
    else if (!blocks)
        LOG_WARN("a KV pool of %zu bytes holds no block (it takes %zu bytes at least): run and "
                 "bench refuse it",
                 kv_mem, block_need);
    else if (!full_ctx_fits)
        LOG_WARN("a KV pool of %.1f MiB cannot hold one full-context sequence (%d tokens need "
                 "%.1f MiB); long requests will be rejected",
                 (double)kv_mem / 1048576.0, hp->n_ctx_train, (double)ctx_need / 1048576.0);
    kern_backend_free(be);
    engine_model_free(m);
    return RUNNER_EXIT_OK;
}
