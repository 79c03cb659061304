/* `quern bench`: offline throughput of the continuous-batching engine on a model, in the
 * style of vLLM's benchmark_throughput: N requests arrive at once, each generates a fixed
 * number of tokens (EOS ignored); prints one JSON object with throughput, latency
 * percentiles, batch and KV statistics, peak RSS and efficiency against the CPU's int8 peak. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/pool.h"
#include "common/version.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "jobs/json.h"
#include "jobs/request.h"
#include "kernels/kernels.h"
#include "runner/engine_opts.h"
#include "runner/runner.h"

static const char bench_usage[] =
    "usage: quern bench [options]\n"
    "\n"
    "Offline throughput benchmark: all requests arrive at once and each generates exactly\n"
    "--output-len tokens (end-of-generation tokens are ignored). Prints JSON on stdout.\n"
    "A request that cannot fit (prompt + --output-len longer than the model context or the KV\n"
    "pool) is skipped with a warning and counted in rejected_requests; if all are, it fails\n"
    "(at once, before any prompt is made, when --input-len + --output-len exceed the context).\n"
    "peak_rss_mb is in MiB; cpu_s is the CPU time of the measured part (all threads).\n"
    "\n"
    "  --model PATH           GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --prompts N            requests (default 256 synthetic ones; with --input, the\n"
    "                         file's prompts, cycled to N when given)\n"
    "  --input-len L          tokens per synthetic prompt (default 128; random ids; not\n"
    "                         with --input)\n"
    "  --output-len M         tokens generated per request (default 128)\n"
    "  --input FILE.jsonl     real prompts instead: request lines as `quern submit` takes\n"
    "                         them (short forms or OpenAI Batch; only their prompt is used)\n"
    "  --chat-template NAME   with --input: chat lines in this format (" ENGINE_CHAT_NAMES ")\n"
    "                         instead of the model's recognised template\n"
    "  --seed N               seed for synthetic prompts and for sampling (default 1)\n"
    "  --temperature T        sampling temperature, 0 = greedy (default 0)\n"
    "  --top-p P              nucleus sampling: keep the most likely tokens holding P of\n"
    "                         the probability (default 1 = off; with --temperature > 0)\n"
    "  --top-k K              keep the K most likely tokens (default 0 = off)\n"
    "  --logprobs K           every request asks for each token's log-probability and K\n"
    "                         (0-20) alternatives, as `logprobs` does (default: off)\n"
    "  --peak-seconds S       length of each peak microbenchmark (the kernels' int8 instruction;\n"
    "                         AMX int8 and bf16 tiles too where the CPU has them), 0 = skip\n"
    "                         (default 1; with --tp above 1 not measured: a warning when given).\n"
    "                         fraction_of_*_peak = the model FLOPs the requests\n"
    "                         needed (matmuls; attention excluded) per second / that peak;\n"
    "                         ..._with_attention also counts attention's q.k and weighted-value\n"
    "                         FLOPs (attention_flops_s)\n";

static double cpu_seconds(const struct rusage *r)
{
    return (double)r->ru_utime.tv_sec + 1e-6 * (double)r->ru_utime.tv_usec +
           (double)r->ru_stime.tv_sec + 1e-6 * (double)r->ru_stime.tv_usec;
}

static void usage(FILE *f)
{
    fputs(bench_usage, f);
    runner_engine_help(f, RUNNER_EO_ALL | RUNNER_EO_SPEC | RUNNER_EO_DUMMY);
    fputs("  -h, --help             this help\n", f);
}

struct bench_opts {
    const char *model;          /* --model */
    const char *input;          /* --input */
    const char *chat_template;  /* --chat-template, or NULL */
    long prompts;               /* --prompts */
    int prompts_set;            /* --prompts given */
    long input_len;             /* --input-len */
    int input_len_set;          /* --input-len given */
    long output_len;            /* --output-len */
    uint64_t seed;              /* --seed */
    float peak_seconds;         /* --peak-seconds */
    int peak_given;             /* --peak-seconds was given (not the default) */
    float temperature;          /* --temperature */
    float top_p;                /* --top-p */
    int top_k;                  /* --top-k */
    int logprobs;               /* --logprobs: alternatives per token, -1 = off */
    struct runner_engine_opts eo; /* engine and backend flags */
};

enum {
    B_MODEL = 256,
    B_PROMPTS,
    B_INLEN,
    B_OUTLEN,
    B_INPUT,
    B_SEED,
    B_PEAK,
    B_TEMP,
    B_TOPP,
    B_TOPK,
    B_LOGPROBS,
    B_CHAT_TEMPLATE
};

static int parse_bench(int argc, char **argv, struct bench_opts *o)
{
    static const struct option own[] = {
        {"model", required_argument, 0, B_MODEL},
        {"prompts", required_argument, 0, B_PROMPTS},
        {"input-len", required_argument, 0, B_INLEN},
        {"output-len", required_argument, 0, B_OUTLEN},
        {"input", required_argument, 0, B_INPUT},
        {"chat-template", required_argument, 0, B_CHAT_TEMPLATE},
        {"seed", required_argument, 0, B_SEED},
        {"peak-seconds", required_argument, 0, B_PEAK},
        {"temperature", required_argument, 0, B_TEMP},
        {"top-p", required_argument, 0, B_TOPP},
        {"top-k", required_argument, 0, B_TOPK},
        {"logprobs", required_argument, 0, B_LOGPROBS},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    struct option longopts[sizeof(own) / sizeof(own[0]) + RUNNER_EO_MAX_LONGOPTS];
    runner_engine_longopts(longopts, sizeof(longopts) / sizeof(longopts[0]), own, RUNNER_EO_ALL | RUNNER_EO_SPEC | RUNNER_EO_DUMMY);
    memset(o, 0, sizeof(*o));
    runner_engine_opts_default(&o->eo);
    o->model = RUNNER_DEFAULT_MODEL;
    o->prompts = 256;
    o->input_len = 128;
    o->output_len = 128;
    o->seed = 1;
    o->peak_seconds = 1;
    o->top_p = 1;
    o->logprobs = -1;
    int c, e;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if ((e = runner_engine_opt("bench", c, optarg, &o->eo)) != 0) {
            if (e < 0)
                return 0;
            continue;
        }
        switch (c) {
        case B_MODEL: o->model = optarg; break;
        case B_INPUT: o->input = optarg; break;
        case B_CHAT_TEMPLATE:
            if (!runner_chat_template_ok("bench", optarg))
                return 0;
            o->chat_template = optarg;
            break;
        case B_PROMPTS:
            if (!runner_parse_long("bench", "prompts", optarg, 1, 1 << 24, &o->prompts))
                return 0;
            o->prompts_set = 1;
            break;
        case B_INLEN:
            if (!runner_parse_long("bench", "input-len", optarg, 1, 1 << 20, &o->input_len))
                return 0;
            o->input_len_set = 1;
            break;
        case B_OUTLEN:
            if (!runner_parse_long("bench", "output-len", optarg, 1, 1 << 20, &o->output_len))
                return 0;
            break;
        case B_SEED:
            if (!runner_parse_u64("bench", "seed", optarg, &o->seed))
                return 0;
            break;
        case B_PEAK:
            if (!runner_parse_float("bench", "peak-seconds", optarg, 0, 60, &o->peak_seconds))
                return 0;
            o->peak_given = 1;
            break;
        case B_TEMP:
            if (!runner_parse_float("bench", "temperature", optarg, 0, 2, &o->temperature))
                return 0;
            break;
        case B_TOPP:
            if (!runner_parse_float("bench", "top-p", optarg, 1e-6, 1, &o->top_p))
                return 0;
            break;
        case B_TOPK: {
            long k;
            if (!runner_parse_long("bench", "top-k", optarg, 0, INT32_MAX, &k))
                return 0;
            o->top_k = (int)k;
            break;
        }
        case B_LOGPROBS: {
            long k;
            if (!runner_parse_long("bench", "logprobs", optarg, 0, ENGINE_TOP_LOGPROBS_MAX, &k))
                return 0;
            o->logprobs = (int)k;
            break;
        }
        case 'h':
            usage(stdout);
            runner_help_exit();
        default: usage(stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern bench: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (o->chat_template && !o->input) {
        fputs("quern bench: --chat-template is for --input's chat lines\n", stderr);
        return 0;
    }
    if (o->input && o->input_len_set) {
        fputs("quern bench: --input-len is for synthetic prompts, not with --input\n", stderr);
        return 0;
    }
    return runner_engine_opts_check("bench", &o->eo);
}

struct prompt_set {
    int32_t **ids; /* per prompt (owned) */
    size_t *n;     /* lengths */
    size_t count;  /* prompts */
};

static void prompts_free(struct prompt_set *ps)
{
    for (size_t i = 0; i < ps->count; i++)
        free(ps->ids[i]);
    free(ps->ids);
    free(ps->n);
}

static int prompts_push(struct prompt_set *ps, int32_t *ids, size_t n, size_t *cap)
{
    if (ps->count == *cap) {
        size_t nc = *cap ? *cap * 2 : 256;
        int32_t **ni = realloc(ps->ids, sizeof(*ni) * nc);
        if (ni)
            ps->ids = ni;
        size_t *nn = realloc(ps->n, sizeof(*nn) * nc);
        if (nn)
            ps->n = nn;
        if (!ni || !nn)
            return 0;
        *cap = nc;
    }
    ps->ids[ps->count] = ids;
    ps->n[ps->count++] = n;
    return 1;
}

/* Synthetic prompts: random ids among normal (non-control) tokens that the model has (a dummy's
 * vocabulary may be smaller than its tokenizer's), distinct per request. */
static int prompts_synthetic(struct prompt_set *ps, const struct bench_opts *o,
                             const struct engine_tok *tok, int32_t model_vocab)
{
    size_t cap = 0;
    struct engine_rng rng;
    engine_rng_seed(&rng, o->seed, "bench", 5);
    int32_t nv = engine_tok_n_vocab(tok);
    if (model_vocab < nv)
        nv = model_vocab;
    for (long i = 0; i < o->prompts; i++) {
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)o->input_len);
        if (!ids)
            return 0;
        for (long j = 0; j < o->input_len; j++) {
            int32_t id;
            char buf[64];
            do
                id = (int32_t)(engine_rng_next(&rng) % (uint64_t)nv);
            while (engine_tok_piece(tok, id, 0, buf, sizeof(buf)) == 0); /* skip control */
            ids[j] = id;
        }
        if (!prompts_push(ps, ids, (size_t)o->input_len, &cap)) {
            free(ids);
            return 0;
        }
    }
    return 1;
}

/* Real prompts from JSONL. */
static int prompts_from_file(struct prompt_set *ps, const char *path, const struct engine_tok *tok,
                             const struct engine_chat *chat)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        LOG_ERROR("cannot open %s: %s", path, strerror(errno));
        return 0;
    }
    char *line = NULL;
    size_t lcap = 0, cap = 0;
    ssize_t len;
    long lineno = 0;
    int ok = 1;
    while (ok && (len = getline(&line, &lcap, f)) >= 0) {
        lineno++;
        if (job_line_blank(line, (size_t)len)) /* skipped, as submit skips it */
            continue;
        /* the line as a job would take it (submit's parser: the same lines accepted, the same
         * errors); only its prompt is used (every request generates --output-len tokens) */
        char id[32];
        snprintf(id, sizeof(id), "line-%ld", lineno);
        struct job_defaults d = {.max_tokens = 1, .default_id = id};
        engine_sampling_default(&d.sampling);
        struct job_request *req = NULL;
        struct job_error je = {0};
        int32_t *ids = NULL;
        size_t n = 0;
        struct err_detail err = {0};
        enum status st = job_request_parse(line, (size_t)len, &d, &req, &je);
        if (st)
            snprintf(err.msg, sizeof(err.msg), "%s", je.message);
        else
            st = job_request_tokens(req, tok, chat, 0, &ids, &n, &err); /* (too long: the
                                                                         * engine skips it) */
        job_request_free(req);
        if (st || !n) {
            LOG_ERROR("%s:%ld: %s", path, lineno, err.msg[0] ? err.msg : "empty prompt");
            ok = 0;
        } else if (!prompts_push(ps, ids, n, &cap)) {
            ok = 0;
        } else {
            ids = NULL;
        }
        free(ids);
    }
    if (ok && ferror(f)) {
        LOG_ERROR("cannot read %s: %s", path, strerror(errno));
        ok = 0;
    }
    free(line);
    fclose(f);
    if (ok && !ps->count) {
        LOG_ERROR("%s holds no prompts", path);
        ok = 0;
    }
    return ok;
}

/* The set's prompts repeated in order until it holds n (n above the count). */
static int prompts_cycle(struct prompt_set *ps, size_t n)
{
    size_t have = ps->count, cap = ps->count;
    for (size_t i = have; i < n; i++) {
        size_t len = ps->n[i % have];
        int32_t *ids = malloc(sizeof(int32_t) * len);
        if (!ids)
            return 0;
        memcpy(ids, ps->ids[i % have], sizeof(int32_t) * len);
        if (!prompts_push(ps, ids, len, &cap)) {
            free(ids);
            return 0;
        }
    }
    return 1;
}

/* 2 x parameters of the layers' matmul weights (body; of a mixture of experts, those a token
 * runs) and of the output projection (head): FLOPs per token, attention excluded. */
static void model_flops(const struct engine_model *m, double *body, double *head)
{
    const struct engine_hparams *hp = engine_model_hparams(m);
    double p = 0;
    for (int l = 0; l < hp->n_layer; l++) {
        const struct kern_tensor *ts[ENGINE_MAX_LAYER_WEIGHTS];
        for (int i = 0, nw = engine_model_weights(m, l, ts); i < nw; i++)
            p += (double)ts[i]->ne0 * (double)ts[i]->ne1;
        const struct kern_tensor *xs = engine_model_experts(m, l);
        for (int i = 0; xs && i < 3 * engine_hp_n_ffns(hp); i++) /* (a shared one: every token) */
            p += (double)xs[i].ne0 * (double)xs[i].ne1 *
                 (i < 3 * hp->n_expert ? (double)hp->n_expert_used / hp->n_expert : 1.0);
    }
    *body = 2 * p;
    const struct kern_tensor *out[ENGINE_MAX_LAYER_WEIGHTS];
    engine_model_weights(m, engine_model_hparams(m)->n_layer, out); /* the output head */
    *head = 2 * (double)out[0]->ne0 * (double)out[0]->ne1;
}

/* The backend's peak rate named name from pk (n entries), or 0. */
static double peak_of(const struct kern_peak *pk, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(pk[i].name, name))
            return pk[i].ops;
    return 0;
}

int runner_cmd_bench(int argc, char **argv)
{
    struct bench_opts o;
    if (!parse_bench(argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    struct err_detail err = {0};
    struct kern_group *grp = NULL;
    struct engine_model *m = NULL, *dm = NULL;
    struct engine_tok *tok = NULL;
    struct engine_chat *chat = NULL;
    struct engine *e = NULL;
    struct prompt_set ps = {0};
    double *ttft = NULL, *tpot = NULL;
    int rc = RUNNER_EXIT_ERROR;
    struct kern_backend_opts ko = runner_engine_backend(&o.eo);
    enum status st;
    if ((st = kern_group_open(&grp, &ko, &err)) ||
        (st = runner_model_load(&m, o.model, &o.eo, grp, &err)) ||
        (st = engine_tok_load(&tok, engine_model_gguf(m), &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    if (o.input) {
        if (engine_chat_init_named(&chat, engine_model_gguf(m), o.chat_template, &err))
            LOG_WARN("no usable chat template (%s); \"messages\" lines will fail", err.msg);
        if (!prompts_from_file(&ps, o.input, tok, chat))
            goto out;
        if (o.prompts_set && (size_t)o.prompts < ps.count) {
            for (size_t i = (size_t)o.prompts; i < ps.count; i++)
                free(ps.ids[i]);
            ps.count = (size_t)o.prompts;
        } else if (o.prompts_set && !prompts_cycle(&ps, (size_t)o.prompts)) {
            LOG_ERROR("no memory for prompts");
            goto out;
        }
    } else if (o.input_len + o.output_len > engine_model_hparams(m)->n_ctx_train) {
        /* (before, every prompt was made first: 100 x 1M tokens took 617 MB, then each was
         * refused) */
        LOG_ERROR("--input-len %ld + --output-len %ld is longer than the model's context (%d "
                  "tokens): every request would be refused",
                  o.input_len, o.output_len, engine_model_hparams(m)->n_ctx_train);
        goto out;
    } else if (!prompts_synthetic(&ps, &o, tok, engine_model_hparams(m)->n_vocab)) {
        LOG_ERROR("no memory for prompts");
        goto out;
    }
    if ((st = runner_draft_load(&dm, &o.eo, grp, &err)) ||
        (st = engine_init(&e, m, tok, &o.eo.ep, &err)) || (st = engine_warmup(e, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    ttft = calloc(ps.count, sizeof(double));
    tpot = calloc(ps.count, sizeof(double));
    if (!ttft || !tpot)
        goto out;
    struct rusage ru0;
    getrusage(RUSAGE_SELF, &ru0);
    double t0 = runner_now();
    size_t rejected = 0; /* requests the engine refused (too long for the context): skipped */
    for (size_t i = 0; i < ps.count; i++) {
        struct engine_request r = {0};
        char id[32];
        snprintf(id, sizeof(id), "bench-%zu", i);
        r.prompt = ps.ids[i];
        r.n_prompt = ps.n[i];
        engine_sampling_default(&r.sampling);
        r.sampling.temperature = o.temperature;
        r.sampling.top_p = o.top_p;
        r.sampling.top_k = o.top_k;
        r.logprobs = o.logprobs >= 0;
        r.top_logprobs = o.logprobs > 0 ? o.logprobs : 0;
        r.sampling.seed = o.seed;
        r.max_tokens = (int32_t)o.output_len;
        r.ignore_eos = 1;
        r.request_id = id;
        if ((st = engine_add_request(e, &r, NULL, &err))) {
            if (st != ST_ERR_RANGE && st != ST_ERR_CAPACITY) { /* only what does not fit */
                LOG_ERROR("request %zu: %s", i, err.msg);
                goto out;
            }
            LOG_WARN("request %zu skipped: %s", i, err.msg);
            rejected++;
        }
    }
    if (rejected == ps.count) {
        LOG_ERROR("every request was rejected: nothing to measure");
        goto out;
    }
    size_t done = 0;
    uint64_t in_tok = 0, out_tok = 0, cached = 0;
    double attn_keys = 0; /* sum over forwarded tokens of the keys each attends to */
    while (engine_pending(e)) {
        if ((st = engine_step(e, &err))) {
            LOG_ERROR("%s", err.msg);
            goto out;
        }
        struct engine_output outs[64];
        size_t k;
        while ((k = engine_poll(e, outs, 64)) > 0)
            for (size_t i = 0; i < k; i++, done++) {
                ttft[done] = 1e3 * (outs[i].t_first - outs[i].t_arrival);
                tpot[done] = outs[i].n_tokens > 1 ? 1e3 * (outs[i].t_finish - outs[i].t_first) /
                                                        (double)(outs[i].n_tokens - 1)
                                                  : 0;
                in_tok += outs[i].n_prompt;
                out_tok += outs[i].n_tokens;
                cached += outs[i].n_cached;
                /* positions n_cached .. n_prompt + n_tokens - 2 were forwarded; position p
                 * attends to p + 1 keys */
                const double last = (double)(outs[i].n_prompt + outs[i].n_tokens) - 1;
                const double first = (double)outs[i].n_cached;
                if (last > first)
                    attn_keys += (last * (last + 1) - first * (first + 1)) / 2;
            }
    }
    double elapsed = runner_now() - t0;
    const struct engine_stats *es = engine_get_stats(e);
    const struct engine_kv *kv = engine_get_kv(e);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    struct kern_peak pk[8];
    /* the machine's peak: rank 0's backend measures on all the threads when there is one rank */
    struct kern_backend *be = grp->be[0];
    if (o.peak_given && o.peak_seconds > 0 && grp->size > 1)
        LOG_WARN("--peak-seconds: no peak measured with --tp %d (the ranks' threads share the "
                 "machine: measure with --tp 1)",
                 grp->size);
    int n_pk = o.peak_seconds > 0 && grp->size == 1 && be->ops->peaks
                   ? be->ops->peaks(be, o.peak_seconds, pk, 8)
                   : 0;
    /* the device memory in use now, the engine's buffers and KV pool still held */
    struct kern_mem_info mi;
    const size_t mem_used =
        be->ops->mem_info && be->ops->mem_info(be, &mi) ? mi.total - mi.avail : 0;
    double peak = peak_of(pk, n_pk, "int8");
    double amx_peak = peak_of(pk, n_pk, "amx_int8");
    double bf16_peak = peak_of(pk, n_pk, "amx_bf16");
    double body, head;
    model_flops(m, &body, &head);
    double total_tps = (double)(in_tok + out_tok) / elapsed;
    /* the model FLOPs the requests needed: every prompt token not served from the prefix cache
     * and every generated token but each request's last goes through the layers; the output
     * projection runs once per generated token */
    double achieved = ((double)(in_tok - cached + out_tok - done) * body + (double)out_tok * head) /
                      elapsed;
    /* attention's products, q.k and the weighted values: 2 x 2 x n_head x head_dim FLOPs per key
     * per layer */
    double attn = attn_keys * 4.0 * engine_model_hparams(m)->n_head * engine_model_hparams(m)->head_dim * engine_model_hparams(m)->n_layer / elapsed;

    cJSON *j = cJSON_CreateObject();
    char label[512];
    job_json_add_text(j, "model", runner_model_label(o.model, &o.eo, label, sizeof(label)));
    cJSON_AddStringToObject(j, "isa", kern_backend_describe(be));
    cJSON_AddStringToObject(j, "quern", quern_version());
    cJSON_AddNumberToObject(j, "tp", (double)grp->size);
    cJSON_AddNumberToObject(j, "threads", (double)o.eo.threads);
    cJSON_AddStringToObject(j, "matmul", kern_act_name((enum kern_act)o.eo.act));
    cJSON_AddNumberToObject(j, "requests", (double)(ps.count - rejected));
    cJSON_AddNumberToObject(j, "rejected_requests", (double)rejected);
    if (o.input)
        job_json_add_text(j, "input", o.input);
    else
        cJSON_AddNumberToObject(j, "input_len", (double)o.input_len);
    cJSON_AddNumberToObject(j, "output_len", (double)o.output_len);
    cJSON_AddNumberToObject(j, "temperature", o.temperature);
    cJSON_AddNumberToObject(j, "top_p", o.top_p);
    cJSON_AddNumberToObject(j, "top_k", o.top_k);
    cJSON_AddNumberToObject(j, "logprobs", o.logprobs);
    cJSON_AddNumberToObject(j, "max_seqs", o.eo.ep.max_seqs);
    cJSON_AddNumberToObject(j, "max_batch_tokens", o.eo.ep.max_batch_tokens);
    cJSON_AddNumberToObject(j, "kv_block", o.eo.ep.kv_block);
    cJSON_AddStringToObject(
        j, "kv_dtype", /* as stored: f16 is bf16 in the CPU's bf16 mode */
        kern_kv_dtype_name((enum kern_kv_dtype)engine_kv_layer(kv, 0, 0).dtype));
    cJSON_AddNumberToObject(j, "kv_blocks", engine_kv_n_blocks(kv));
    cJSON_AddNumberToObject(j, "kv_window_blocks", engine_kv_pool_blocks(kv, 1));
    cJSON_AddNumberToObject(j, "elapsed_s", elapsed);
    /* CPU seconds of the measured part (all threads): steadier than elapsed_s on a shared
     * machine, for comparing runs of the same work */
    cJSON_AddNumberToObject(j, "cpu_s", cpu_seconds(&ru) - cpu_seconds(&ru0));
    cJSON_AddNumberToObject(j, "input_tokens", (double)in_tok);
    cJSON_AddNumberToObject(j, "output_tokens", (double)out_tok);
    cJSON_AddNumberToObject(j, "output_tok_s", (double)out_tok / elapsed);
    cJSON_AddNumberToObject(j, "total_tok_s", total_tps);
    cJSON_AddNumberToObject(j, "requests_s", (double)done / elapsed);
    runner_add_percentiles(j, "ttft_ms", ttft, done);
    runner_add_percentiles(j, "tpot_ms", tpot, done);
    cJSON_AddNumberToObject(j, "steps", (double)es->steps);
    cJSON_AddNumberToObject(j, "mean_batch_seqs",
                            es->steps ? (double)es->batch_seqs / (double)es->steps : 0);
    cJSON_AddNumberToObject(j, "mean_batch_tokens",
                            es->steps ? (double)es->batch_tokens / (double)es->steps : 0);
    cJSON_AddNumberToObject(j, "peak_kv_util", (double)es->peak_blocks_used / engine_kv_n_blocks(kv));
    /* prompt tokens found in the prefix cache when each request was first admitted (the KV
     * pool's own block counts also count admissions retried for room and re-admissions after
     * a preemption, which inflated this) */
    cJSON_AddNumberToObject(j, "cached_tokens", (double)cached);
    cJSON_AddNumberToObject(j, "prefix_hit_rate", in_tok ? (double)cached / (double)in_tok : 0);
    cJSON_AddNumberToObject(j, "preemptions", (double)es->preemptions);
    cJSON_AddNumberToObject(j, "nucleus_fast", (double)es->nucleus_fast);
    cJSON_AddNumberToObject(j, "nucleus_full", (double)es->nucleus_full);
    cJSON_AddNumberToObject(j, "sampled_backend", (double)es->sampled_backend);
    cJSON_AddNumberToObject(j, "sampled_host", (double)es->sampled_host);
    cJSON_AddNumberToObject(j, "sampled_epilogue", (double)es->sampled_epilogue);
    runner_add_spec_json(j, es, o.eo.ep.spec != 0);
    cJSON_AddNumberToObject(j, "peak_rss_mb", (double)ru.ru_maxrss / 1024.0);
    if (mem_used)
        cJSON_AddNumberToObject(j, "device_mem_used_bytes", (double)mem_used);
    long g_cap, g_rep;
    engine_model_graph_counts(m, &g_cap, &g_rep);
    cJSON_AddNumberToObject(j, "graph_captures", (double)g_cap);
    cJSON_AddNumberToObject(j, "graph_replays", (double)g_rep);
    cJSON_AddNumberToObject(j, "model_flops_per_token", body + head);
    cJSON_AddNumberToObject(j, "model_flops_s", achieved);
    cJSON_AddNumberToObject(j, "attention_flops_s", attn);
    if (peak > 0) {
        cJSON_AddNumberToObject(j, "int8_peak_ops_s", peak);
        cJSON_AddNumberToObject(j, "ceiling_tok_s", peak / (body + head));
        cJSON_AddNumberToObject(j, "fraction_of_int8_peak", achieved / peak);
        cJSON_AddNumberToObject(j, "fraction_of_int8_peak_with_attention", (achieved + attn) / peak);
    }
    if (amx_peak > 0) {
        cJSON_AddNumberToObject(j, "amx_int8_peak_ops_s", amx_peak);
        cJSON_AddNumberToObject(j, "fraction_of_amx_int8_peak", achieved / amx_peak);
    }
    if (bf16_peak > 0) {
        cJSON_AddNumberToObject(j, "amx_bf16_peak_flops_s", bf16_peak);
        cJSON_AddNumberToObject(j, "fraction_of_amx_bf16_peak", achieved / bf16_peak);
    }
    char *s = cJSON_Print(j);
    if (s)
        puts(s);
    free(s);
    cJSON_Delete(j);
    rc = RUNNER_EXIT_OK;
out:
    free(ttft);
    free(tpot);
    engine_free(e);
    prompts_free(&ps);
    engine_chat_free(chat);
    engine_tok_free(tok);
    engine_model_free(m);
    engine_model_free(dm);
    kern_group_free(grp);
    return rc;
}
