/* `quern generate`: one prompt (raw or through the chat template) through the engine API as a
 * batch of one (engine_add_request, engine_step, engine_poll); the completion streams to stdout
 * through the request's on_text callback, timings go to stderr. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "kernels/kernels.h"
#include "runner/engine_opts.h"
#include "runner/runner.h"

#define GEN_MAX_STOPS 8
#define GEN_PREFILL_CHUNK 256 /* prompt tokens per forward call */

static const char gen_usage[] =
    "usage: quern generate [options] (--prompt TEXT | --chat TEXT)\n"
    "\n"
    "Generate a completion for one prompt and print it to stdout; timings go to stderr.\n"
    "\n"
    "  --model PATH           GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --prompt TEXT          raw prompt, tokenized as plain text\n"
    "  --chat TEXT            user message, rendered through the model's chat template\n"
    "  --system TEXT          system message for --chat (default: the template's own)\n"
    "  --chat-template NAME   " ENGINE_CHAT_NAMES "\n"
    "                         instead of what the model's tokenizer.chat_template is\n"
    "                         recognised as\n"
    "  --no-thinking          for --chat: enable_thinking false, as a request's\n"
    "                         chat_template_kwargs sets it (Qwen3's template reads it)\n"
    "  --special              let --prompt text contain special tokens like <|im_start|>\n"
    "  --max-tokens N         tokens to generate at most (default 256)\n"
    "  --temperature T        0 = greedy, up to 2 (default 0.8)\n"
    "  --top-k K              keep the K most likely tokens, 0 = off (default 40)\n"
    "  --top-p P              nucleus sampling mass, 1 = off (default 0.95)\n"
    "  --min-p P              drop tokens below P x the top probability (default 0)\n"
    "  --repeat-penalty R     llama.cpp-style repetition penalty, 1 = off (default 1)\n"
    "  --frequency-penalty F, --presence-penalty F   OpenAI-style penalties (default 0)\n"
    "  --stop STR             stop before this string (repeatable, up to 8)\n"
    "  --ignore-eos           keep generating past end-of-generation tokens\n"
    "  --seed N               sampling seed (default 0; the same seed gives the same text)\n";

static void usage(FILE *f)
{
    fputs(gen_usage, f);
    runner_engine_help(f, RUNNER_EO_BACKEND | RUNNER_EO_SPEC | RUNNER_EO_DUMMY);
    fputs("  -h, --help             this help\n", f);
}

struct gen_opts {
    const char *model;                  /* model path */
    const char *prompt;                 /* --prompt text */
    const char *chat;                   /* --chat user message */
    const char *system;                 /* --system message */
    const char *chat_template;          /* --chat-template name, or NULL */
    int special;                        /* --special */
    int no_thinking;                    /* --no-thinking */
    int ignore_eos;                     /* --ignore-eos */
    long max_tokens;                    /* --max-tokens */
    struct runner_engine_opts eo;       /* --device, --threads, --isa, --matmul */
    struct engine_sampling sp;          /* sampling parameters */
    const char *stops[GEN_MAX_STOPS];   /* --stop strings */
    size_t n_stops;                     /* how many */
};

enum {
    OPT_MODEL = 256,
    OPT_PROMPT,
    OPT_CHAT,
    OPT_SYSTEM,
    OPT_SPECIAL,
    OPT_MAXTOK,
    OPT_TEMP,
    OPT_TOPK,
    OPT_TOPP,
    OPT_MINP,
    OPT_REP,
    OPT_FREQ,
    OPT_PRES,
    OPT_STOP,
    OPT_IGNORE_EOS,
    OPT_SEED,
    OPT_CHAT_TEMPLATE,
    OPT_NO_THINKING
};

static int parse_opts(int argc, char **argv, struct gen_opts *o)
{
    static const struct option own[] = {
        {"model", required_argument, 0, OPT_MODEL},
        {"prompt", required_argument, 0, OPT_PROMPT},
        {"chat", required_argument, 0, OPT_CHAT},
        {"system", required_argument, 0, OPT_SYSTEM},
        {"chat-template", required_argument, 0, OPT_CHAT_TEMPLATE},
        {"no-thinking", no_argument, 0, OPT_NO_THINKING},
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
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    struct option longopts[sizeof(own) / sizeof(own[0]) + RUNNER_EO_MAX_LONGOPTS];
    runner_engine_longopts(longopts, sizeof(longopts) / sizeof(longopts[0]), own,
                           RUNNER_EO_BACKEND | RUNNER_EO_SPEC | RUNNER_EO_DUMMY);
    memset(o, 0, sizeof(*o));
    runner_engine_opts_default(&o->eo);
    o->model = RUNNER_DEFAULT_MODEL;
    o->max_tokens = 256;
    engine_sampling_default(&o->sp);
    o->sp.temperature = 0.8f;
    o->sp.top_k = 40;
    o->sp.top_p = 0.95f;
    long l;
    int c, e;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if ((e = runner_engine_opt("generate", c, optarg, &o->eo)) != 0) {
            if (e < 0)
                return 0;
            continue;
        }
        switch (c) {
        case OPT_MODEL: o->model = optarg; break;
        case OPT_PROMPT: o->prompt = optarg; break;
        case OPT_CHAT: o->chat = optarg; break;
        case OPT_SYSTEM: o->system = optarg; break;
        case OPT_CHAT_TEMPLATE: o->chat_template = optarg; break;
        case OPT_NO_THINKING:
            o->no_thinking = 1;
            break;
        case OPT_SPECIAL: o->special = 1; break;
        case OPT_IGNORE_EOS: o->ignore_eos = 1; break;
        case OPT_MAXTOK:
            if (!runner_parse_long("generate", "max-tokens", optarg, 1, 1 << 24, &o->max_tokens))
                return 0;
            break;
        case OPT_TOPK:
            if (!runner_parse_long("generate", "top-k", optarg, 0, 1 << 24, &l))
                return 0;
            o->sp.top_k = (int32_t)l;
            break;
        case OPT_TEMP:
            if (!runner_parse_float("generate", "temperature", optarg, 0, 2, &o->sp.temperature))
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
        case 'h':
            usage(stdout);
            runner_help_exit();
        default: usage(stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern generate: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (!o->prompt == !o->chat) {
        fprintf(stderr, "quern generate: give exactly one of --prompt or --chat\n");
        usage(stderr);
        return 0;
    }
    if (o->system && !o->chat) {
        fprintf(stderr, "quern generate: --system needs --chat\n");
        return 0;
    }
    if ((o->chat_template || o->no_thinking) && !o->chat) {
        fprintf(stderr, "quern generate: --%s needs --chat\n",
                o->chat_template ? "chat-template" : "no-thinking");
        return 0;
    }
    if (o->special && o->chat) {
        fprintf(stderr, "quern generate: --special is for --prompt (a --chat message is plain "
                        "text, as in a job)\n");
        return 0;
    }
    if (o->chat_template && !runner_chat_template_ok("generate", o->chat_template))
        return 0;
    return runner_engine_opts_check("generate", &o->eo);
}

/* Everything a generation holds; freed by gen_free. */
struct gen {
    struct kern_group *grp;     /* backends, one per tensor-parallel rank */
    struct engine_model *model; /* weights */
    struct engine_tok *tok;     /* tokenizer */
    struct engine_chat *chat;   /* chat template (--chat only) */
    struct engine *eng;         /* the batch engine, running this one request */
    struct engine_model *draft; /* --spec model's draft model */
    int32_t *ids;               /* prompt tokens */
};

static void gen_free(struct gen *g)
{
    engine_free(g->eng);
    engine_chat_free(g->chat);
    engine_tok_free(g->tok);
    engine_model_free(g->model);
    engine_model_free(g->draft);
    kern_group_free(g->grp);
    free(g->ids);
}

/* Tokenize the prompt into g->ids. */
static enum status tokenize_prompt(struct gen *g, const struct gen_opts *o, size_t *n_prompt,
                                   struct err_detail *err)
{
    enum status st;
    size_t n = 0;
    if (o->chat) {
        struct engine_chat_msg msgs[2];
        size_t nm = 0;
        if (o->system)
            msgs[nm++] = (struct engine_chat_msg){"system", o->system};
        msgs[nm++] = (struct engine_chat_msg){"user", o->chat};
        st = engine_chat_tokenize(g->chat, g->tok, msgs, nm,
                                  ENGINE_CHAT_GEN_PROMPT |
                                      (o->no_thinking ? ENGINE_CHAT_NO_THINKING : 0),
                                  0, &g->ids, &n, err);
    } else {
        st = engine_tok_encode(g->tok, o->prompt, strlen(o->prompt),
                               ENGINE_TOK_ADD_BOS | (o->special ? ENGINE_TOK_PARSE_SPECIAL : 0),
                               &g->ids, &n, err);
    }
    if (st)
        return st;
    if (n == 0)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "the prompt is empty (and this model adds no BOS token to begin from)");
    *n_prompt = n;
    return ST_OK;
}

/* The engine's streaming callback: final text goes straight to stdout. */
static void print_text(void *user, const char *text, size_t n)
{
    (void)user;
    fwrite(text, 1, n, stdout);
    fflush(stdout);
}

static int run(struct gen_opts *o)
{
    struct gen g = {0};
    struct err_detail err = {0};
    enum status st;
    int rc = RUNNER_EXIT_ERROR;
    double t_load = runner_now();

    struct kern_backend_opts ko = runner_engine_backend(&o->eo);
    if ((st = kern_group_open(&g.grp, &ko, &err)) ||
        (st = runner_model_load(&g.model, o->model, &o->eo, g.grp, &err)) ||
        (st = engine_tok_load(&g.tok, engine_model_gguf(g.model), &err)) ||
        (o->chat && (st = engine_chat_init_named(&g.chat, engine_model_gguf(g.model),
                                                 o->chat_template, &err)))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    size_t n_prompt = 0;
    if ((st = tokenize_prompt(&g, o, &n_prompt, &err))) {
        LOG_ERROR("prompt: %s", err.msg);
        goto out;
    }
    const int n_ctx = engine_model_hparams(g.model)->n_ctx_train;
    if (n_prompt >= (size_t)n_ctx) {
        LOG_ERROR("prompt is %zu tokens; the model's context is %d: it leaves no room for "
                  "output",
                  n_prompt, n_ctx);
        goto out;
    }
    long max_new = o->max_tokens;
    if ((long)n_prompt + max_new > n_ctx) {
        max_new = n_ctx - (long)n_prompt;
        LOG_WARN("--max-tokens lowered to %ld to fit the %d-token context", max_new, n_ctx);
    }
    /* one sequence: a KV pool just large enough for it, prompt chunks of GEN_PREFILL_CHUNK */
    struct engine_params ep;
    engine_params_default(&ep);
    ep.max_seqs = 1;
    ep.max_batch_tokens = GEN_PREFILL_CHUNK;
    ep.prefix_cache = 0;
    ep.spec = o->eo.ep.spec;
    ep.spec_max_k = o->eo.ep.spec_max_k;
    ep.spec_budget = o->eo.ep.spec_budget;
    if ((st = runner_draft_load(&g.draft, &o->eo, g.grp, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    ep.draft_model = g.draft;
    size_t blocks = (n_prompt + (size_t)max_new + (size_t)ep.kv_block - 1) / (size_t)ep.kv_block;
    ep.kv_mem = blocks * engine_model_kv_block_bytes(g.model, ep.kv_block, ep.kv_dtype);
    struct engine_request r = {0};
    r.prompt = g.ids;
    r.n_prompt = n_prompt;
    r.sampling = o->sp;
    r.max_tokens = (int32_t)max_new;
    r.ignore_eos = o->ignore_eos;
    r.stop = o->stops;
    r.n_stop = o->n_stops;
    r.request_id = "generate"; /* with --seed, the same text every time */
    r.on_text = print_text;
    if ((st = engine_init(&g.eng, g.model, g.tok, &ep, &err)) ||
        (ep.spec && (st = engine_warmup(g.eng, &err))) || /* speculation's step costs */
        (st = engine_add_request(g.eng, &r, NULL, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    char label[512], experts[64] = "";
    const struct engine_hparams *hp = engine_model_hparams(g.model);
    if (hp->n_expert)
        snprintf(experts, sizeof(experts), ", %d experts (%d a token)", hp->n_expert,
                 hp->n_expert_used);
    LOG_INFO("model %s: %d layers, %d-dim%s, vocab %d; ISA %s, %ld threads; prompt %zu tokens",
             runner_model_label(o->model, &o->eo, label, sizeof(label)), hp->n_layer, hp->n_embd,
             experts, hp->n_vocab, kern_backend_describe(g.grp->be[0]), o->eo.threads, n_prompt);

    double t0 = runner_now();
    while (engine_pending(g.eng))
        if ((st = engine_step(g.eng, &err))) {
            LOG_ERROR("%s", err.msg);
            goto out;
        }
    struct engine_output res;
    if (engine_poll(g.eng, &res, 1) != 1) {
        LOG_ERROR("the request did not finish");
        goto out;
    }
    fputc('\n', stdout);
    fflush(stdout);
    const char *why = res.finish == ENGINE_FINISH_LENGTH ? "length" : res.stop_string ? "stop" : "eos";
    double t_prompt = res.t_first - t0, t_gen = res.t_finish - res.t_first;
    char rate[96] = ""; /* the tokens after the first, where there were any */
    if (res.n_tokens > 1 && t_gen > 0)
        snprintf(rate, sizeof(rate), " in %.3f s after the first (%.1f tok/s)", t_gen,
                 (double)(res.n_tokens - 1) / t_gen);
    fprintf(stderr,
            "quern generate: load %.2f s; prompt %zu tokens in %.3f s (%.1f tok/s); generated %zu "
            "token%s%s; finish: %s\n",
            t0 - t_load, n_prompt, t_prompt, (double)n_prompt / t_prompt, res.n_tokens,
            res.n_tokens == 1 ? "" : "s", rate, why);
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
