/* `quern generate`: one prompt (raw or through the chat template) through the model on the
 * CPU backend; the completion streams to stdout, timings go to stderr. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "kernels/kernels.h"
#include "runner/runner.h"

#define GEN_MAX_STOPS 8
#define GEN_PREFILL_CHUNK 256 /* prompt tokens per forward call */

static const char gen_usage[] =
    "usage: quern generate [options] (--prompt TEXT | --chat TEXT)\n"
    "\n"
    "Generate a completion for one prompt and print it to stdout; timings go to stderr.\n"
    "\n"
    "  --model PATH         GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --prompt TEXT        raw prompt, tokenized as plain text\n"
    "  --chat TEXT          user message, rendered through the model's chat template\n"
    "  --system TEXT        system message for --chat (default: the template's own)\n"
    "  --special            let --prompt text contain special tokens like <|im_start|>\n"
    "  --max-tokens N       tokens to generate at most (default 256)\n"
    "  --temperature T      0 = greedy (default 0.8)\n"
    "  --top-k K            keep the K most likely tokens, 0 = off (default 40)\n"
    "  --top-p P            nucleus sampling mass, 1 = off (default 0.95)\n"
    "  --min-p P            drop tokens below P x the top probability (default 0)\n"
    "  --repeat-penalty R   llama.cpp-style repetition penalty, 1 = off (default 1)\n"
    "  --frequency-penalty F, --presence-penalty F   OpenAI-style penalties (default 0)\n"
    "  --stop STR           stop before this string (repeatable, up to 8)\n"
    "  --ignore-eos         keep generating past end-of-generation tokens\n"
    "  --seed N             sampling seed (default 0; the same seed gives the same text)\n"
    "  --threads N          CPU threads (default: all online CPUs)\n"
    "  --isa NAME           auto|scalar|avx2|avx512 (default auto)\n"
    "  --matmul MODE        exact: f32 activations (default); q16: 16-bit activations\n"
    "                       with exact integer sums (Q4_0/Q4_1/Q8_0 weights; ~2x exact's\n"
    "                       batch throughput on AVX-512, near-exact logits); q8: 8-bit\n"
    "                       activations as llama.cpp, fastest, visibly less accurate\n"
    "  -h, --help           this help\n";

struct gen_opts {
    const char *model;                  /* model path */
    const char *prompt;                 /* --prompt text */
    const char *chat;                   /* --chat user message */
    const char *system;                 /* --system message */
    const char *isa;                    /* --isa */
    int act;                            /* --matmul: enum kern_act */
    int special;                        /* --special */
    int ignore_eos;                     /* --ignore-eos */
    long max_tokens;                    /* --max-tokens */
    long threads;                       /* --threads */
    struct engine_sampling sp;          /* sampling parameters */
    const char *stops[GEN_MAX_STOPS];   /* --stop strings */
    size_t n_stops;                     /* how many */
};

enum { OPT_MODEL = 256, OPT_PROMPT, OPT_CHAT, OPT_SYSTEM, OPT_SPECIAL, OPT_MAXTOK, OPT_TEMP,
       OPT_TOPK, OPT_TOPP, OPT_MINP, OPT_REP, OPT_FREQ, OPT_PRES, OPT_STOP, OPT_IGNORE_EOS,
       OPT_SEED, OPT_THREADS, OPT_ISA, OPT_MATMUL };

static int parse_opts(int argc, char **argv, struct gen_opts *o)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, OPT_MODEL},
        {"prompt", required_argument, 0, OPT_PROMPT},
        {"chat", required_argument, 0, OPT_CHAT},
        {"system", required_argument, 0, OPT_SYSTEM},
        {"special", no_argument, 0, OPT_SPECIAL},
        {"max-tokens", required_argument, 0, OPT_MAXTOK},
        {"temperature", required_argument, 0, OPT_TEMP},
        {"top-k", required_argument, 0, OPT_TOPK},
        {"top-p", required_argument, 0, OPT_TOPP},
        {"min-p", required_argument, 0, OPT_MINP},
        {"repeat-penalty", required_argument, 0, OPT_REP},
        {"frequency-penalty", required_argument, 0, OPT_FREQ},
        {"presence-penalty", required_argument, 0, OPT_PRES},
        {"stop", required_argument, 0, OPT_STOP},
        {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
        {"seed", required_argument, 0, OPT_SEED},
        {"threads", required_argument, 0, OPT_THREADS},
        {"isa", required_argument, 0, OPT_ISA},
        {"matmul", required_argument, 0, OPT_MATMUL},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    memset(o, 0, sizeof(*o));
    o->model = RUNNER_DEFAULT_MODEL;
    o->max_tokens = 256;
    o->threads = runner_default_threads();
    engine_sampling_default(&o->sp);
    o->sp.temperature = 0.8f;
    o->sp.top_k = 40;
    o->sp.top_p = 0.95f;
    long l;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case OPT_MODEL: o->model = optarg; break;
        case OPT_PROMPT: o->prompt = optarg; break;
        case OPT_CHAT: o->chat = optarg; break;
        case OPT_SYSTEM: o->system = optarg; break;
        case OPT_SPECIAL: o->special = 1; break;
        case OPT_IGNORE_EOS: o->ignore_eos = 1; break;
        case OPT_ISA: o->isa = optarg; break;
        case OPT_MATMUL:
            if (!runner_parse_matmul("generate", optarg, &o->act))
                return 0;
            break;
        case OPT_MAXTOK:
            if (!runner_parse_long("generate", "max-tokens", optarg, 1, 1 << 24, &o->max_tokens))
                return 0;
            break;
        case OPT_THREADS:
            if (!runner_parse_long("generate", "threads", optarg, 1, 256, &o->threads))
                return 0;
            break;
        case OPT_TOPK:
            if (!runner_parse_long("generate", "top-k", optarg, 0, 1 << 24, &l))
                return 0;
            o->sp.top_k = (int32_t)l;
            break;
        case OPT_TEMP:
            if (!runner_parse_float("generate", "temperature", optarg, 0, 100, &o->sp.temperature))
                return 0;
            break;
        case OPT_TOPP:
            if (!runner_parse_float("generate", "top-p", optarg, 1e-9, 1, &o->sp.top_p))
                return 0;
            break;
        case OPT_MINP:
            if (!runner_parse_float("generate", "min-p", optarg, 0, 1, &o->sp.min_p))
                return 0;
            break;
        case OPT_REP:
            if (!runner_parse_float("generate", "repeat-penalty", optarg, 0.01, 100,
                                    &o->sp.repeat_penalty))
                return 0;
            break;
        case OPT_FREQ:
            if (!runner_parse_float("generate", "frequency-penalty", optarg, -2, 2,
                                    &o->sp.frequency_penalty))
                return 0;
            break;
        case OPT_PRES:
            if (!runner_parse_float("generate", "presence-penalty", optarg, -2, 2,
                                    &o->sp.presence_penalty))
                return 0;
            break;
        case OPT_SEED:
            if (!runner_parse_u64("generate", "seed", optarg, &o->sp.seed))
                return 0;
            break;
        case OPT_STOP:
            if (o->n_stops == GEN_MAX_STOPS || !*optarg) {
                fprintf(stderr, "quern generate: --stop must be non-empty, at most %d times\n",
                        GEN_MAX_STOPS);
                return 0;
            }
            o->stops[o->n_stops++] = optarg;
            break;
        case 'h': fputs(gen_usage, stdout); exit(RUNNER_EXIT_OK);
        default: fputs(gen_usage, stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern generate: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (!o->prompt == !o->chat) {
        fprintf(stderr, "quern generate: give exactly one of --prompt or --chat\n%s", gen_usage);
        return 0;
    }
    if (o->system && !o->chat) {
        fprintf(stderr, "quern generate: --system needs --chat\n");
        return 0;
    }
    return 1;
}

/* Everything a generation holds; freed by gen_free. */
struct gen {
    struct kern_backend *be;    /* CPU backend */
    struct engine_model *model; /* weights */
    struct engine_tok *tok;     /* tokenizer */
    struct engine_chat *chat;   /* chat template (--chat only) */
    struct engine_kv *kv;       /* KV cache for one sequence */
    struct engine_sampler *smp; /* sampler scratch */
    struct engine_stop *stop;   /* stop strings (NULL when none) */
    int32_t *ids;               /* prompt then generated tokens */
    float *logits;              /* n_vocab */
    char *text;                 /* pending output bytes */
};

static void gen_free(struct gen *g)
{
    engine_stop_free(g->stop);
    engine_sampler_free(g->smp);
    engine_kv_free(g->kv);
    engine_chat_free(g->chat);
    engine_tok_free(g->tok);
    engine_model_free(g->model);
    kern_cpu_backend_free(g->be);
    free(g->ids);
    free(g->logits);
    free(g->text);
}

/* Tokenize the prompt into g->ids (grown to hold max_tokens more). */
static enum status tokenize_prompt(struct gen *g, const struct gen_opts *o, size_t *n_prompt,
                                   struct err_detail *err)
{
    enum status st;
    int32_t *ids = NULL;
    size_t n = 0;
    if (o->chat) {
        struct engine_chat_msg msgs[2];
        size_t nm = 0;
        if (o->system)
            msgs[nm++] = (struct engine_chat_msg){"system", o->system};
        msgs[nm++] = (struct engine_chat_msg){"user", o->chat};
        st = engine_chat_tokenize(g->chat, g->tok, msgs, nm, 1, 0, &ids, &n, err);
    } else {
        st = engine_tok_encode(g->tok, o->prompt, strlen(o->prompt),
                               ENGINE_TOK_ADD_BOS | (o->special ? ENGINE_TOK_PARSE_SPECIAL : 0),
                               &ids, &n, err);
    }
    if (st)
        return st;
    if (n == 0) {
        free(ids);
        return err_set(err, ST_ERR_INVALID_ARG, "the prompt is empty");
    }
    int32_t *grown = realloc(ids, sizeof(int32_t) * (n + (size_t)o->max_tokens));
    if (!grown) {
        free(ids);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    g->ids = grown;
    *n_prompt = n;
    return ST_OK;
}

/* Output side of a generation: bytes pass through the stop matcher (when there is one),
 * which may hold some back until they can no longer start a stop string. */
struct gen_out {
    struct engine_stop *stop; /* NULL = no stop strings */
    char *pend;               /* bytes the matcher still holds (owned) */
    size_t n_pend;            /* bytes in pend */
    size_t cap;               /* capacity of pend */
};

static void out_write(const char *s, size_t n)
{
    if (!n)
        return;
    fwrite(s, 1, n, stdout);
    fflush(stdout);
}

/* Feed generated bytes; returns 1 when a stop string completed (output then ends before it). */
static int out_push(struct gen_out *o, const char *s, size_t n)
{
    if (!o->stop) {
        out_write(s, n);
        return 0;
    }
    if (o->n_pend + n > o->cap) {
        size_t cap = (o->n_pend + n) * 2 + 64;
        char *np = realloc(o->pend, cap);
        if (!np)
            abort(); /* a few KB at most: out of memory here is fatal */
        o->pend = np;
        o->cap = cap;
    }
    memcpy(o->pend + o->n_pend, s, n);
    o->n_pend += n;
    size_t ok = 0;
    int hit = engine_stop_push(o->stop, s, n, &ok);
    out_write(o->pend, ok);
    memmove(o->pend, o->pend + ok, o->n_pend - ok);
    o->n_pend -= ok;
    return hit;
}

/* End without a stop match: everything held is final. */
static void out_finish(struct gen_out *o, int stopped)
{
    if (!stopped)
        out_write(o->pend, o->n_pend);
    o->n_pend = 0;
    free(o->pend);
}

static int run(const struct gen_opts *o)
{
    struct gen g = {0};
    struct err_detail err = {0};
    enum status st;
    int rc = RUNNER_EXIT_ERROR;
    double t_load = runner_now();

    struct kern_cpu_opts ko = {(int)o->threads, o->isa, (enum kern_act)o->act};
    if ((st = kern_cpu_backend_init(&g.be, &ko, &err)) ||
        (st = engine_model_load(&g.model, o->model, g.be, &err)) ||
        (st = engine_tok_load(&g.tok, g.model->gguf, &err)) ||
        (o->chat && (st = engine_chat_init(&g.chat, g.model->gguf, &err))) ||
        (st = engine_sampling_validate(&o->sp, &err)) ||
        (st = engine_sampler_init(&g.smp, g.model->hp.n_vocab, &err)) ||
        (o->n_stops && (st = engine_stop_init(&g.stop, o->stops, o->n_stops, &err)))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    size_t n_prompt = 0;
    if ((st = tokenize_prompt(&g, o, &n_prompt, &err))) {
        LOG_ERROR("prompt: %s", err.msg);
        goto out;
    }
    const int n_ctx = g.model->hp.n_ctx_train;
    if (n_prompt >= (size_t)n_ctx) {
        LOG_ERROR("prompt is %zu tokens; the model's context is %d", n_prompt, n_ctx);
        goto out;
    }
    long max_new = o->max_tokens;
    if ((long)n_prompt + max_new > n_ctx) {
        max_new = n_ctx - (long)n_prompt;
        LOG_WARN("--max-tokens lowered to %ld to fit the %d-token context", max_new, n_ctx);
    }
    int32_t n_total = (int32_t)(n_prompt + (size_t)max_new);
    g.logits = malloc(sizeof(float) * (size_t)g.model->hp.n_vocab);
    size_t text_cap = ENGINE_TOK_STREAM_OUT_MAX(engine_tok_max_piece(g.tok)) + 4;
    g.text = malloc(text_cap);
    if (!g.logits || !g.text) {
        LOG_ERROR("no memory");
        goto out;
    }
    if ((st = engine_model_kv_init(g.model, &g.kv, n_total, 1, 16, &err)) ||
        (st = engine_kv_reserve(g.kv, 0, n_total, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    LOG_INFO("model %s: %d layers, %d-dim, vocab %d; ISA %s, %ld threads; prompt %zu tokens",
             o->model, g.model->hp.n_layer, g.model->hp.n_embd, g.model->hp.n_vocab,
             kern_cpu_backend_isa(g.be), o->threads, n_prompt);

    struct engine_rng rng;
    engine_rng_seed(&rng, o->sp.seed, "generate", 8);
    int32_t pos[GEN_PREFILL_CHUNK], seq[GEN_PREFILL_CHUNK] = {0};
    double t0 = runner_now();
    for (size_t i = 0; i < n_prompt; i += GEN_PREFILL_CHUNK) {
        int n = (int)(n_prompt - i < GEN_PREFILL_CHUNK ? n_prompt - i : GEN_PREFILL_CHUNK);
        for (int j = 0; j < n; j++)
            pos[j] = (int32_t)(i + (size_t)j);
        struct engine_batch b = {n, g.ids + i, pos, seq, NULL};
        if ((st = engine_model_forward(g.model, g.kv, &b, g.logits, &err))) {
            LOG_ERROR("%s", err.msg);
            goto out;
        }
    }
    double t1 = runner_now();
    struct engine_tok_stream ts = {0};
    struct gen_out go = {g.stop, NULL, 0, 0};
    int stopped = 0;
    size_t n_ids = n_prompt;
    long n_gen = 0;
    const char *why = "length";
    for (;;) {
        int32_t id = engine_sample(g.smp, &o->sp, &rng, g.logits, g.ids, n_ids, NULL);
        n_gen++;
        if (!o->ignore_eos && engine_tok_is_eog(g.tok, id)) {
            why = "eos";
            break;
        }
        g.ids[n_ids++] = id;
        size_t n = engine_tok_stream_push(g.tok, &ts, id, g.text, text_cap);
        if (out_push(&go, g.text, n)) {
            stopped = 1;
            why = "stop";
            break;
        }
        if (n_gen >= max_new)
            break;
        int32_t p = (int32_t)(n_ids - 1);
        struct engine_batch b = {1, &id, &p, seq, NULL};
        if ((st = engine_model_forward(g.model, g.kv, &b, g.logits, &err))) {
            LOG_ERROR("%s", err.msg);
            free(go.pend);
            goto out;
        }
    }
    if (!stopped) {
        size_t n = engine_tok_stream_flush(&ts, g.text, text_cap);
        stopped = out_push(&go, g.text, n);
    }
    out_finish(&go, stopped);
    double t2 = runner_now();
    fputc('\n', stdout);
    fflush(stdout);
    fprintf(stderr,
            "quern generate: load %.2f s; prompt %zu tokens in %.3f s (%.1f tok/s); generated %ld "
            "tokens in %.3f s (%.1f tok/s); finish: %s\n",
            t0 - t_load, n_prompt, t1 - t0, (double)n_prompt / (t1 - t0), n_gen, t2 - t1,
            (double)n_gen / (t2 - t1), why);
    rc = RUNNER_EXIT_OK;
out:
    gen_free(&g);
    return rc;
}

int runner_cmd_generate(int argc, char **argv)
{
    struct gen_opts o;
    if (!parse_opts(argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    return run(&o);
}
