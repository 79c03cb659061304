/* `quern perplexity`: the perplexity of a model on a text file, in windows of --ctx tokens run
 * many at once (engine_score): llama.cpp's method by default (non-overlapping windows, the first
 * token replaced by BOS when the model adds one, each window's second half scored), or sliding
 * windows with --stride S (every token after the first scored once, each with at least
 * ctx - S tokens of context, a window's first token replaced by BOS likewise). Prints the
 * perplexity, the mean negative log-likelihood and their standard errors, tokens scored and the
 * throughput; --json for a JSON object. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpus.h"
#include "common/log.h"
#include "common/utf8.h"
#include "engine/model.h"
#include "engine/score.h"
#include "engine/tokenizer.h"
#include "kernels/kernels.h"
#include "runner/engine_opts.h"
#include "runner/runner.h"

static const char ppl_usage[] =
    "usage: quern perplexity --file TEXT [options]\n"
    "\n"
    "Perplexity of the model on a UTF-8 text: exp(mean negative log-likelihood of its tokens).\n"
    "Default: llama.cpp's method (llama-perplexity): the tokens cut into non-overlapping\n"
    "windows of --ctx (the first token of each replaced by BOS when the model adds one), each\n"
    "window's second half scored. With --stride S (< ctx): the first window scores all but its\n"
    "first token, then each next window of --ctx tokens ends S tokens further and scores those S\n"
    "(at least ctx - S tokens of context each; the first of each window's tokens replaced by\n"
    "BOS when the model adds one): every token after the first, once.\n"
    "Windows run many at a time (as many as --max-seqs and --kv-mem allow) through the batched\n"
    "forward pass; the result does not depend on how they are batched. A step holds at least a\n"
    "token of each window in flight: --max-batch-tokens below that many is raised to it.\n"
    "\n"
    "  --file PATH            the text (UTF-8)\n"
    "  --ctx N                window length in tokens (default 512; at most the model's context)\n"
    "  --stride S             sliding windows advancing by S tokens (1..ctx-1)\n"
    "  --model PATH           GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --json                 one JSON object on stdout instead of text\n"
    "  --progress SECS        a progress line on stderr at most this often (default 10)\n";

static void usage(FILE *f)
{
    fputs(ppl_usage, f);
    runner_engine_help(f, (RUNNER_EO_ALL & ~RUNNER_EO_PREFIX) | RUNNER_EO_DUMMY);
    fputs("  -h, --help             this help\n", f);
}

struct ppl_opts {
    const char *file;             /* --file */
    const char *model;            /* --model */
    long ctx;                     /* --ctx */
    int ctx_given;                /* --ctx was given (else 512, or the model's context if less) */
    long stride;                  /* --stride, 0 = llama.cpp's method */
    int json;                     /* --json */
    float progress;               /* --progress seconds */
    struct runner_engine_opts eo; /* engine and backend flags */
};

enum { P_FILE = 256, P_CTX, P_STRIDE, P_MODEL, P_JSON, P_PROGRESS };

static int parse_opts(int argc, char **argv, struct ppl_opts *o)
{
    static const struct option own[] = {
        {"file", required_argument, 0, P_FILE},     {"ctx", required_argument, 0, P_CTX},
        {"stride", required_argument, 0, P_STRIDE}, {"model", required_argument, 0, P_MODEL},
        {"json", no_argument, 0, P_JSON},           {"progress", required_argument, 0, P_PROGRESS},
        {"help", no_argument, 0, 'h'},              {0, 0, 0, 0},
    };
    struct option longopts[sizeof(own) / sizeof(own[0]) + RUNNER_EO_MAX_LONGOPTS];
    runner_engine_longopts(longopts, sizeof(longopts) / sizeof(longopts[0]), own,
                           (RUNNER_EO_ALL & ~RUNNER_EO_PREFIX) | RUNNER_EO_DUMMY);
    memset(o, 0, sizeof(*o));
    runner_engine_opts_default(&o->eo);
    o->model = RUNNER_DEFAULT_MODEL;
    o->ctx = 512;
    o->progress = 10;
    int c, e;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if ((e = runner_engine_opt("perplexity", c, optarg, &o->eo)) != 0) {
            if (e < 0)
                return 0;
            continue;
        }
        switch (c) {
        case P_FILE: o->file = optarg; break;
        case P_MODEL: o->model = optarg; break;
        case P_JSON: o->json = 1; break;
        case P_CTX:
            if (!runner_parse_long("perplexity", "ctx", optarg, 4, 1 << 20, &o->ctx))
                return 0;
            o->ctx_given = 1;
            break;
        case P_STRIDE:
            if (!runner_parse_long("perplexity", "stride", optarg, 1, 1 << 20, &o->stride))
                return 0;
            break;
        case P_PROGRESS:
            if (!runner_parse_float("perplexity", "progress", optarg, 0.1, 1e6, &o->progress))
                return 0;
            break;
        case 'h':
            usage(stdout);
            runner_help_exit();
        default: usage(stderr); return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern perplexity: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (!o->file) {
        fprintf(stderr, "quern perplexity: --file is required\n");
        usage(stderr);
        return 0;
    }
    if (o->stride >= o->ctx) {
        fprintf(stderr, "quern perplexity: --stride %ld must be shorter than --ctx %ld (a window "
                "needs a token of context before its first target)\n", o->stride, o->ctx);
        return 0;
    }
    return 1; /* (its batch rule: --max-batch-tokens raised to the windows in flight) */
}

/* The text, checked to be UTF-8 (a bad byte is an error naming its offset). Caller frees. */
static char *read_text(const char *path, size_t *len, struct err_detail *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        err_set(err, ST_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                buf = NULL;
            }
            buf = nb;
        }
    }
    const int bad_read = ferror(f), read_errno = errno;
    fclose(f);
    if (!buf || bad_read) {
        free(buf);
        err_set(err, bad_read ? ST_ERR_IO : ST_ERR_NOMEM, "cannot read %s: %s", path,
                bad_read ? strerror(read_errno) : "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n;) {
        enum utf8_err why;
        const size_t k = utf8_decode((const unsigned char *)buf + i, n - i, NULL, &why);
        if (!k) {
            err_set(err, ST_ERR_FORMAT, "%s is not UTF-8: byte %zu (%s)", path, i,
                    utf8_err_str(why));
            free(buf);
            return NULL;
        }
        i += k;
    }
    *len = n;
    return buf;
}

/* Progress line state. */
struct ppl_progress {
    float every;    /* seconds between lines */
    double t0;      /* start */
    double last;    /* last line */
    int n_win;      /* windows in all */
    long total_tok; /* tokens to run in all */
};

static void on_progress(void *ctx, int windows_done, long tokens_run)
{
    struct ppl_progress *p = ctx;
    const double now = runner_now();
    if (now - p->last < p->every)
        return;
    p->last = now;
    LOG_INFO("perplexity: %d/%d windows, %ld/%ld tokens, %.0f tok/s", windows_done, p->n_win,
             tokens_run, p->total_tok, (double)tokens_run / (now - p->t0));
}

int runner_cmd_perplexity(int argc, char **argv)
{
    struct ppl_opts o;
    if (!parse_opts(argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    struct err_detail err = {0};
    struct kern_group *grp = NULL;
    struct engine_model *m = NULL;
    struct engine_tok *tok = NULL;
    int32_t *ids = NULL, *bos_copy = NULL;
    struct engine_score_window *win = NULL;
    double *nll = NULL;
    int rc = RUNNER_EXIT_ERROR;
    size_t len = 0, n_ids = 0;
    char *text = read_text(o.file, &len, &err);
    if (!text) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    const double t_load = runner_now();
    struct kern_backend_opts ko = runner_engine_backend(&o.eo);
    enum status st;
    if ((st = kern_group_open(&grp, &ko, &err)) ||
        (st = runner_model_load(&m, o.model, &o.eo, grp, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    const int n_ctx_train = engine_model_hparams(m)->n_ctx_train;
    if (!o.ctx_given && o.ctx > n_ctx_train) /* the default, for a model of a shorter context */
        o.ctx = n_ctx_train;
    if (o.ctx > n_ctx_train || o.stride >= o.ctx) { /* (its block tables end there) */
        if (o.ctx > n_ctx_train)
            LOG_ERROR("--ctx %ld is longer than the model's context (%d tokens)", o.ctx,
                      n_ctx_train);
        else
            LOG_ERROR("--stride %ld must be shorter than the window, the model's context (%d "
                      "tokens)",
                      o.stride, n_ctx_train);
        rc = RUNNER_EXIT_USAGE;
        goto out;
    }
    if ((st = engine_tok_load(&tok, engine_model_gguf(m), &err)) ||
        (st = engine_tok_encode(tok, text, len, ENGINE_TOK_ADD_BOS, &ids, &n_ids, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    const int ctx = (int)o.ctx, stride = (int)o.stride;
    const int32_t bos = engine_tok_bos(tok);
    const int add_bos = n_ids > 0 && bos >= 0 && ids[0] == bos;
    int n_win = 0;
    if (!stride) {
        n_win = (int)(n_ids / (size_t)ctx);
        if (n_win < 1 || ctx / 2 + 1 >= ctx) {
            LOG_ERROR("%s: %zu tokens, too short for one window of --ctx %d", o.file, n_ids, ctx);
            goto out;
        }
    } else {
        if (n_ids < 2 || (size_t)ctx > n_ids) {
            LOG_ERROR("%s: %zu tokens, too short for one window of --ctx %d", o.file, n_ids, ctx);
            goto out;
        }
        n_win = 1 + (int)((n_ids - (size_t)ctx + (size_t)stride - 1) / (size_t)stride);
    }
    win = calloc((size_t)n_win, sizeof(*win));
    bos_copy = malloc(sizeof(int32_t) * (size_t)(stride ? 1 : n_win) * (size_t)ctx);
    if (!win || !bos_copy) {
        LOG_ERROR("no memory");
        goto out;
    }
    size_t n_scored = 0;
    long total_tok = 0;
    for (int w = 0; w < n_win; w++) {
        if (!stride) { /* llama.cpp: window w's tokens, the first replaced by BOS if any */
            int32_t *t = bos_copy + (size_t)w * (size_t)ctx;
            memcpy(t, ids + (size_t)w * (size_t)ctx, sizeof(int32_t) * (size_t)ctx);
            if (add_bos)
                t[0] = bos;
            win[w] = (struct engine_score_window){t, ctx, ctx / 2 + 1, 0, 0};
        } else if (w == 0) { /* the first ctx tokens, scoring all but the first */
            win[w] = (struct engine_score_window){ids, ctx, 1, 0, 0};
        } else { /* targets [a, b): the next stride tokens, with the ctx - (b - a) before them,
                  * the first replaced by BOS if any, as in the default method (a model that
                  * adds BOS is lost without it: Gemma 3's perplexity was 2.6x the default's) */
            const size_t a = (size_t)ctx + (size_t)(w - 1) * (size_t)stride;
            const size_t b = a + (size_t)stride < n_ids ? a + (size_t)stride : n_ids;
            win[w] = (struct engine_score_window){ids + (b - (size_t)ctx), ctx,
                                                  (int)((size_t)ctx - (b - a)), add_bos, bos};
        }
        n_scored += (size_t)(win[w].n - win[w].from);
        total_tok += win[w].n;
    }
    nll = malloc(sizeof(double) * (n_scored ? n_scored : 1));
    if (!nll) {
        LOG_ERROR("no memory");
        goto out;
    }
    /* windows in flight: --max-seqs, as many as --kv-mem holds, at least one */
    const size_t per_win = engine_model_kv_block_bytes(m, o.eo.ep.kv_block, o.eo.ep.kv_dtype) *
                           (size_t)((ctx + o.eo.ep.kv_block - 1) / o.eo.ep.kv_block);
    size_t kv_mem;
    /* (a scoring batch wants a row of logits for each of its tokens, and samples none) */
    if ((st = engine_kv_mem_resolve(m, &o.eo.ep, o.eo.ep.max_batch_tokens, 0, &kv_mem, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    int in_flight = (int)(kv_mem / (per_win ? per_win : 1));
    if (!in_flight)
        LOG_WARN("a KV pool of %zu bytes holds no window of --ctx %d (%zu bytes): the windows run "
                 "one at a time, each in a pool of that size",
                 kv_mem, ctx, per_win);
    in_flight = in_flight < o.eo.ep.max_seqs ? in_flight : o.eo.ep.max_seqs;
    in_flight = in_flight < n_win ? in_flight : n_win;
    in_flight = in_flight < 1 ? 1 : in_flight;
    struct ppl_progress pr = {o.progress, 0, 0, n_win, total_tok};
    int kv_stored = o.eo.ep.kv_dtype;
    struct engine_score_opts so = {
        in_flight, o.eo.ep.max_batch_tokens, o.eo.ep.kv_block, o.eo.ep.kv_dtype, on_progress, &pr,
        &kv_stored};
    const double load_s = runner_now() - t_load;
    pr.t0 = pr.last = runner_now();
    if ((st = engine_score(m, win, n_win, &so, nll, &err))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    const double secs = runner_now() - pr.t0;
    double sum = 0, sum2 = 0;
    for (size_t i = 0; i < n_scored; i++) {
        if (!isfinite(nll[i])) { /* (a model whose weights load can still overflow) */
            LOG_ERROR("the model's logits for scored token %zu are not finite (NaN or an "
                      "infinity): no perplexity (try --matmul exact)",
                      i);
            goto out;
        }
        sum += nll[i];
        sum2 += nll[i] * nll[i];
    }
    const double mean = sum / (double)n_scored;
    const double var = n_scored > 1 ? (sum2 / (double)n_scored - mean * mean) : 0;
    const double se = n_scored > 1 ? sqrt((var > 0 ? var : 0) / (double)(n_scored - 1)) : 0;
    const double ppl = exp(mean);
    char label[512];
    const char *name = runner_model_label(o.model, &o.eo, label, sizeof(label));
    const char *method = stride ? "sliding" : "llama.cpp";
    if (o.json) {
        char *qfile = runner_json_quote(o.file), *qname = runner_json_quote(name);
        printf("{\"file\": %s, \"model\": %s, \"backend\": \"%s\", \"matmul\": \"%s\", "
               "\"kv_dtype\": \"%s\", \"tp\": %d, \"method\": \"%s\", \"ctx\": %d, "
               "\"stride\": %d, \"text_tokens\": %zu, \"windows\": %d, \"windows_in_flight\": %d, "
               "\"tokens_scored\": %zu, \"mean_nll\": %.9g, \"nll_stderr\": %.9g, "
               "\"perplexity\": %.9g, \"perplexity_stderr\": %.9g, \"tokens_run\": %ld, "
               "\"seconds\": %.3f, \"tok_per_s\": %.1f, \"load_seconds\": %.3f}\n",
               qfile ? qfile : "null", qname ? qname : "null", kern_backend_describe(grp->be[0]),
               kern_act_name((enum kern_act)o.eo.act),
               kern_kv_dtype_name((enum kern_kv_dtype)kv_stored), grp->size, method, ctx, stride,
               n_ids, n_win, in_flight, n_scored, mean, se, ppl, ppl * se, total_tok, secs,
               (double)total_tok / secs, load_s);
        free(qfile);
        free(qname);
    } else {
        printf("perplexity %.4f +/- %.4f  (mean NLL %.6f +/- %.6f nats over %zu tokens)\n", ppl,
               ppl * se, mean, se, n_scored);
        printf("%s: %zu tokens, %d windows of %d (%s), %d at a time; %s, %s, matmul %s, KV %s\n",
               o.file, n_ids, n_win, ctx,
               stride ? "sliding, each scoring its new tokens" : "llama.cpp: second halves",
               in_flight, name, kern_backend_describe(grp->be[0]),
               kern_act_name((enum kern_act)o.eo.act),
               kern_kv_dtype_name((enum kern_kv_dtype)kv_stored));
        printf("%ld tokens through the model in %.2f s: %.0f tok/s\n", total_tok, secs,
               (double)total_tok / secs);
    }
    rc = RUNNER_EXIT_OK;
out:
    free(nll);
    free(win);
    free(bos_copy);
    free(ids);
    free(text);
    engine_tok_free(tok);
    engine_model_free(m);
    kern_group_free(grp);
    return rc;
}
