/* A run (batch/batch.h): open the queue, take over dead runs, choose the jobs, then drain each
 * job through the engine: claim items in chunks under a lease, admit them (parse, render,
 * tokenize, engine_add_request), step the engine, collect finished outputs into records for
 * the shard writer (batch/commit.c), commit them every flush_secs or flush_records, renew the
 * leases, and on a stop (signal, max_runtime) let in-flight requests finish for `grace`
 * seconds, release the rest, commit, seal the shards and write the manifest. */
#include "batch/batch.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "batch/batch_internal.h"
#include "common/fault.h"
#include "common/log.h"
#include "common/version.h"
#include "jobs/record.h"

double batch_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int64_t batch_unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int batch_run_signals(const struct batch_run *r)
{
    return r->o->signals ? (int)*r->o->signals : 0;
}

static void inflight_free(struct batch_inflight *inf)
{
    for (int i = 0; inf->choices && i < inf->n_choices; i++) {
        struct job_choice *c = &inf->choices[i];
        free((void *)c->text);
        free((void *)c->tokens);
        free((void *)c->logprobs);
        free((void *)c->top_ids);
        free((void *)c->top_lps);
    }
    free(inf->choices);
    free(inf->custom_id);
    free(inf);
}

/* Take a request the engine no longer holds off r->inflight and free it. */
static void inflight_retire(struct batch_run *r, struct batch_inflight *inf)
{
    if (inf->prev)
        inf->prev->next = inf->next;
    else
        r->inflight = inf->next;
    if (inf->next)
        inf->next->prev = inf->prev;
    inflight_free(inf);
    r->n_inflight--;
}

/* Fold the writer's commit counts into the run's totals. */
static void count_commits(struct batch_run *r)
{
    struct batch_out_counts c;
    batch_out_get_counts(r->out, &c);
    r->stats.items_done = r->done_base + c.done;
    r->stats.items_failed = r->failed_base + c.failed;
    r->stats.records_discarded = r->discarded_base + c.discarded;
}

static enum status flush_all(struct batch_run *r, struct err_detail *err)
{
    enum status st = batch_out_commit(r->out, err);
    count_commits(r);
    r->t_flush = batch_now();
    return st;
}

/* Write an error record for an item that could not run: status 400 (the request's fault; param:
 * the field at fault, or NULL) or 500 (quern's: a server_error). */
static enum status item_error(struct batch_run *r, int64_t item, const char *custom_id, int status,
                              const char *code, const char *msg, const char *param,
                              struct err_detail *err)
{
    char *line = job_record_invalid(r->job.id, custom_id, status, code, msg, param);
    return batch_out_error(r->out, item, line, code, msg, err);
}

/* ---- admission ---- */

#define BATCH_GRAMMARS 64

static void grammars_free(struct batch_run *r)
{
    while (r->grammars) {
        struct batch_grammar *n = r->grammars->next;
        engine_grammar_unref(r->grammars->g);
        free(r->grammars->schema);
        free(r->grammars);
        r->grammars = n;
    }
}

/* The compiled grammar of req's response_format (a borrowed pointer; the engine takes its own
 * reference), compiled once per distinct schema and job while it stays among the
 * BATCH_GRAMMARS most recently used. */
static enum status request_grammar(struct batch_run *r, const struct job_request *req,
                                   struct engine_grammar **out, struct err_detail *err)
{
    struct batch_grammar **p = &r->grammars, *bg;
    int n = 0;
    for (; (bg = *p) != NULL; p = &bg->next, n++)
        if (bg->format == req->format &&
            (bg->schema == req->schema || (bg->schema && req->schema && !strcmp(bg->schema, req->schema)))) {
            *p = bg->next; /* to the front */
            bg->next = r->grammars;
            r->grammars = bg;
            *out = bg->g;
            return ST_OK;
        }
    if (n >= BATCH_GRAMMARS) { /* drop the least recently used */
        for (p = &r->grammars; (*p)->next; p = &(*p)->next)
            ;
        engine_grammar_unref((*p)->g);
        free((*p)->schema);
        free(*p);
        *p = NULL;
    }
    bg = calloc(1, sizeof(*bg));
    if (!bg || (req->schema && !(bg->schema = strdup(req->schema)))) {
        free(bg);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    bg->format = req->format;
    enum status st = job_schema_grammar_text(req->format, req->schema, &bg->g, err);
    if (st) {
        free(bg->schema);
        free(bg);
        return st;
    }
    bg->next = r->grammars;
    r->grammars = bg;
    *out = bg->g;
    return ST_OK;
}

static enum status admit(struct batch_run *r, const struct queue_claimed *c, struct err_detail *err)
{
    /* Our own item again: this run stalled past its --lease, another run's claim put its
     * expired leases back in the queue, and this claim took one back. Its request is still in
     * flight here or its record waits for the commit, which the lease now covers again:
     * computing it a second time would give the commit two records of one item. */
    if (batch_out_holds(r->out, c->id))
        return ST_OK;
    enum status st = batch_out_hold(r->out, c->id, err);
    if (st)
        return st;
    /* a line rejected at submit: its error record, as submit found it, however many runs died
     * holding it (it cannot be what crashed them: the attempts guard is not for it; before,
     * three kill -9s turned its reason into attempts_exhausted and its custom_id into null) */
    if (!c->payload) {
        const char *code = c->error_code ? c->error_code : "invalid_request";
        const char *msg = c->error_msg ? c->error_msg : "the line was rejected at submit";
        char *line = job_record_rejected(r->job.id, c->id, c->custom_id, c->source, c->line_no,
                                         code, msg, c->error_param);
        return batch_out_error(r->out, c->id, line, code, msg, err);
    }
    if (c->max_attempts > 0 && c->attempts > c->max_attempts) {
        char msg[128];
        /* (runs that died holding the item after it was exhausted counted more claims) */
        snprintf(msg, sizeof(msg), "gave up after %d attempts", c->max_attempts);
        return item_error(r, c->id, c->custom_id, 500, "attempts_exhausted", msg, NULL, err);
    }
    struct job_request *req = NULL;
    struct job_error je = {0};
    st = job_request_parse(c->payload, strlen(c->payload), &r->defaults, &req, &je);
    if (st == ST_ERR_NOMEM)
        return err_set(err, st, "out of memory");
    if (st)
        return item_error(r, c->id, c->custom_id, 400, job_err_code_str(je.code), je.message,
                          je.field[0] ? je.field : NULL, err);
    int32_t *ids = NULL;
    size_t n = 0;
    struct err_detail e2 = {0};
    st = job_request_tokens(req, r->tok, r->chat, engine_model_hparams(r->m)->n_ctx_train, &ids, &n,
                            &e2);
    struct batch_inflight *inf = NULL;
    int32_t max_eff = req->max_tokens; /* what the engine is asked for */
    if (!st) {
        inf = calloc(1, sizeof(*inf));
        if (!inf || !(inf->custom_id = strdup(req->custom_id)) ||
            !(inf->choices = calloc((size_t)req->n, sizeof(*inf->choices)))) {
            if (inf)
                free(inf->custom_id);
            free(inf);
            free(ids);
            job_request_free(req);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        inf->item_id = c->id;
        inf->kind = req->kind;
        inf->n_choices = req->n;
        inf->n_prompt = (int32_t)n;
        struct engine_request er = {0};
        er.prompt = ids;
        er.n_prompt = n;
        er.sampling = req->sampling;
        er.max_tokens = req->max_tokens;
        /* a line without max_tokens gets the job's default, or what the context leaves when
         * that is less (as OpenAI's default is the rest of the context) */
        int n_ctx = engine_model_hparams(r->m)->n_ctx_train;
        if (req->max_tokens_default && n < (size_t)n_ctx && er.max_tokens > n_ctx - (int)n)
            er.max_tokens = n_ctx - (int32_t)n;
        max_eff = er.max_tokens;
        er.stop = (const char *const *)req->stop;
        er.n_stop = req->n_stop;
        er.request_id = req->custom_id;
        er.user = inf;
        er.n_choices = req->n;
        er.logprobs = req->logprobs;
        if (req->format != JOB_FORMAT_TEXT)
            st = request_grammar(r, req, &er.grammar, &e2);
        if (st == ST_ERR_NOMEM) {
            inflight_free(inf);
            free(ids);
            job_request_free(req);
            return err_set(err, ST_ERR_NOMEM, "out of memory compiling a response format");
        }
        er.top_logprobs = req->top_logprobs;
        if (!st)
            st = engine_add_request(r->e, &er, NULL, &e2);
    }
    free(ids);
    const int tokenized = inf != NULL;
    if (!st && inf) { /* the engine holds it now */
        inf->next = r->inflight;
        if (r->inflight)
            r->inflight->prev = inf;
        r->inflight = inf;
        r->n_inflight++;
    }
    if (st) {
        if (inf)
            inflight_free(inf);
        /* (a KV pool too small for a request the model's context holds is this run's limit,
         * not the request's: a 500 "kv_cache_too_small" that `retry --failed` with a larger
         * --kv-mem answers) */
        const char *code = st == ST_ERR_RANGE      ? "context_length_exceeded"
                           : st == ST_ERR_NOMEM    ? "out_of_memory"
                           : st == ST_ERR_CAPACITY ? "kv_cache_too_small"
                                                   : "invalid_request";
        if (st == ST_ERR_CAPACITY)
            err_prefix(&e2, "this run's KV cache is too small for the request");
        /* a context error names the prompt, as OpenAI's does (even when max_tokens is what
         * pushed it over) */
        const char *param = NULL;
        if (st == ST_ERR_RANGE &&
            (!tokenized /* (job_request_tokens: too many bytes) */ ||
             n + (size_t)max_eff > (size_t)engine_model_hparams(r->m)->n_ctx_train))
            param = req->kind == JOB_KIND_CHAT ? "messages" : "prompt";
        st = item_error(r, c->id, req->custom_id,
                        st == ST_ERR_NOMEM || st == ST_ERR_CAPACITY ? 500 : 400, code, e2.msg,
                        param, err);
    }
    job_request_free(req);
    return st;
}

/* The engine's gate on the requests a step computes for the first time
 * (engine_set_start_gate): their items are marked started in the queue, in one transaction,
 * before the step, so a crash from then on counts their attempts and one before does not
 * (queue_mark_started). Where steps come faster than BATCH_MARK_GAP_S (a GPU), a transaction
 * per step would cost (a part's rollback journal syncs at each commit; on NFS that is
 * milliseconds): a mark that comes sooner than that after the last also marks the next
 * requests that wait (oldest first), twice as many each time up to --max-seqs, half as many
 * after a quiet spell; so marks stay a few per second, and a crash charges at most those few
 * that had not begun yet. */
#define BATCH_MARK_GAP_S 0.25
static enum status start_gate(void *ctx, const void *const *users, int n, struct err_detail *err)
{
    struct batch_run *r = ctx;
    int due = 0;
    for (int i = 0; i < n; i++)
        due += users[i] && !((const struct batch_inflight *)users[i])->started;
    if (!due)
        return ST_OK;
    const double now = batch_now();
    if (r->t_mark > 0 && now - r->t_mark < BATCH_MARK_GAP_S)
        r->mark_ahead = r->mark_ahead ? 2 * r->mark_ahead : 4;
    else if (now - r->t_mark > 4 * BATCH_MARK_GAP_S)
        r->mark_ahead /= 2;
    if (r->mark_ahead > r->o->engine.max_seqs)
        r->mark_ahead = r->o->engine.max_seqs;
    r->t_mark = now;
    struct batch_inflight **pick = calloc((size_t)(n + r->mark_ahead), sizeof(*pick));
    int64_t *ids = calloc((size_t)(n + r->mark_ahead), sizeof(*ids));
    enum status st = pick && ids ? ST_OK : err_set(err, ST_ERR_NOMEM, "out of memory");
    size_t k = 0;
    for (int i = 0; !st && i < n; i++) {
        struct batch_inflight *inf = (struct batch_inflight *)users[i];
        if (inf && !inf->started) {
            inf->started = 2; /* (picked: a request's choices once) */
            pick[k++] = inf;
        }
    }
    struct batch_inflight *t = r->inflight; /* newest first: the oldest from its tail */
    while (t && t->next)
        t = t->next;
    for (int a = 0; !st && t && a < r->mark_ahead; t = t->prev)
        if (!t->started) {
            t->started = 2;
            pick[k++] = t;
            a++;
        }
    for (size_t i = 0; !st && i < k; i++)
        ids[i] = pick[i]->item_id;
    if (!st)
        st = queue_mark_started(r->q, r->stats.run_id, ids, k, 1, err);
    for (size_t i = 0; pick && i < k; i++)
        pick[i]->started = !st;
    free(pick);
    free(ids);
    return st;
}

/* Claim more items while the engine has room. Returns 1 when the job has nothing queued. */
static int fill(struct batch_run *r, struct err_detail *err, enum status *st)
{
    size_t target = (size_t)r->o->engine.max_seqs * 2;
    while (engine_pending(r->e) < target) {
        struct queue_claimed *items = NULL;
        size_t n = 0;
        size_t want = target - engine_pending(r->e);
        if (want > (size_t)r->o->claim)
            want = (size_t)r->o->claim;
        *st = queue_claim(r->q, r->job.id, r->stats.run_id, (int)want,
                          (int64_t)(r->o->lease * 1000), &items, &n, err);
        if (*st)
            return 0;
        if (n && r->interruptible) { /* leases held: from now on waits are waited out */
            queue_set_interrupt(r->q, NULL);
            r->interruptible = 0;
        }
        /* the claim marked them started (parsing or tokenizing one may crash the run); once
         * admitted, none has (those waiting in the engine: start_gate marks them again, those
         * answered with an error record: nothing more to compute), but for this run's own
         * items claimed again, which may be running here */
        int64_t *ids = n ? malloc(n * sizeof(*ids)) : NULL;
        size_t k = 0;
        if (n && !ids)
            *st = err_set(err, ST_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < n && !*st; i++) {
            if (!batch_out_holds(r->out, items[i].id))
                ids[k++] = items[i].id;
            *st = admit(r, &items[i], err);
        }
        queue_claimed_free(items, n);
        if (!*st)
            *st = queue_mark_started(r->q, r->stats.run_id, ids, k, 0, err);
        free(ids);
        if (*st)
            return 0;
        if (n < want)
            return 1;
    }
    return 0;
}

/* Keep the request's latencies for the summary (dropped when memory runs out). */
static void note_latency(struct batch_run *r, const struct engine_output *o)
{
    struct batch_stats *s = &r->stats;
    double ttft = 1e3 * (o->t_first - o->t_arrival);
    double tpot =
        o->n_tokens > 1 ? 1e3 * (o->t_finish - o->t_first) / (double)(o->n_tokens - 1) : 0;
    r->n_lat_seen++;
    if (s->n_lat == BATCH_LATENCY_KEEP) {
        /* memory stays bounded over a run of millions of requests: a uniform sample of them
         * (reservoir sampling, a fixed seed) from here on */
        r->lat_rng = r->lat_rng * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t j = (r->lat_rng >> 11) % r->n_lat_seen;
        if (j < BATCH_LATENCY_KEEP) {
            s->ttft_ms[j] = ttft;
            s->tpot_ms[j] = tpot;
        }
        return;
    }
    if (s->n_lat == r->cap_lat) {
        size_t cap = r->cap_lat ? r->cap_lat * 2 : 1024;
        double *a = realloc(s->ttft_ms, sizeof(double) * cap);
        if (a)
            s->ttft_ms = a;
        double *b = realloc(s->tpot_ms, sizeof(double) * cap);
        if (b)
            s->tpot_ms = b;
        if (a && b)
            r->cap_lat = cap;
    }
    if (s->n_lat < r->cap_lat) {
        s->ttft_ms[s->n_lat] = ttft;
        s->tpot_ms[s->n_lat] = tpot;
        s->n_lat++;
    }
}

/* A copy of n elements of size sz at p (NULL when n is 0 or p is NULL); *oom set on failure. */
static void *dup_array(const void *p, size_t n, size_t sz, int *oom)
{
    if (!p || !n)
        return NULL;
    void *q = malloc(n * sz);
    if (!q)
        *oom = 1;
    else
        memcpy(q, p, n * sz);
    return q;
}

/* Keep choice o of its request until every choice is in (the engine's output lives only until
 * the next poll). ST_ERR_NOMEM when a copy fails. */
static enum status keep_choice(struct batch_inflight *inf, const struct engine_output *o)
{
    struct job_choice *c = &inf->choices[o->choice];
    int oom = 0;
    const size_t nt = o->n_tokens, k = (size_t)o->top_logprobs;
    char *text = malloc(o->text_len + 1);
    if (text) {
        memcpy(text, o->text, o->text_len);
        text[o->text_len] = 0;
    }
    c->text = text;
    c->text_len = o->text_len;
    c->finish_reason = o->finish == ENGINE_FINISH_LENGTH ? "length" : "stop";
    c->completion_tokens = (int32_t)nt;
    if (o->logprobs) {
        c->tokens = dup_array(o->tokens, nt, sizeof(int32_t), &oom);
        c->logprobs = nt ? dup_array(o->logprobs, nt, sizeof(float), &oom) : malloc(1);
        c->top_logprobs = o->top_logprobs;
        c->top_ids = dup_array(o->top_ids, nt * k, sizeof(int32_t), &oom);
        c->top_lps = dup_array(o->top_lps, nt * k, sizeof(float), &oom);
        oom |= !c->logprobs;
    }
    inf->n_got++;
    inf->grammar_stuck |= o->finish == ENGINE_FINISH_GRAMMAR;
    return !text || oom ? ST_ERR_NOMEM : ST_OK;
}

/* The success record of a request whose choices are all in; gen: their tokens. */
static enum status write_result(struct batch_run *r, struct batch_inflight *inf, int64_t gen,
                                struct err_detail *err)
{
    struct job_result jr = {0};
    jr.custom_id = inf->custom_id;
    jr.kind = inf->kind;
    jr.model = r->model_name; /* the model that ran, as OpenAI's (not the request's "model") */
    jr.choices = inf->choices;
    jr.n_choices = (size_t)inf->n_choices;
    jr.prompt_tokens = inf->n_prompt;
    jr.cached_tokens = inf->n_cached;
    jr.created = (int64_t)time(NULL);
    jr.job_id = r->job.id;
    jr.tok = r->tok;
    jr.fingerprint = r->fingerprint[0] ? r->fingerprint : NULL;
    double tpot = inf->decode_tokens ? inf->decode_ms / (double)inf->decode_tokens : 0;
    return batch_out_result(r->out, inf->item_id, job_record_success(&jr),
                            (int64_t)inf->n_prompt, gen, inf->ttft_ms, tpot, err);
}

/* Finished requests out of the engine, as result records for the writer: a request's record
 * is written when its last choice finishes. */
static enum status take_outputs(struct batch_run *r, struct err_detail *err)
{
    struct engine_output o[64];
    size_t k;
    enum status st = ST_OK;
    while (!st && (k = engine_poll(r->e, o, 64)) > 0)
        for (size_t i = 0; i < k; i++) {
            struct batch_inflight *inf = o[i].user;
            note_latency(r, &o[i]);
            double ttft = 1e3 * (o[i].t_first - o[i].t_arrival);
            if (o[i].n_tokens > 0 && (inf->ttft_ms <= 0 || ttft < inf->ttft_ms))
                inf->ttft_ms = ttft;
            if (o[i].n_tokens > 1) {
                inf->decode_ms += 1e3 * (o[i].t_finish - o[i].t_first);
                inf->decode_tokens += (int64_t)o[i].n_tokens - 1;
            }
            if (o[i].choice == 0)
                inf->n_cached = (int32_t)o[i].n_cached;
            if (!st && keep_choice(inf, &o[i]))
                st = err_set(err, ST_ERR_NOMEM, "out of memory keeping an output");
            if (st || inf->n_got < inf->n_choices)
                continue;
            int64_t gen = 0;
            for (int c = 0; c < inf->n_choices; c++)
                gen += inf->choices[c].completion_tokens;
            r->stats.prompt_tokens += (int64_t)inf->n_prompt;
            r->stats.completion_tokens += gen;
            r->n_out++;
            if (inf->grammar_stuck) /* an output that cannot be completed is no answer */
                st = item_error(r, inf->item_id, inf->custom_id, 400, "grammar_too_ambiguous",
                                "the request's grammar allowed no next token (more than "
                                "4096 parses alive at once, a token mask past its work bound, "
                                "or none that a token can spell); simplify it (nested "
                                "repetitions like (x+)+ or (x?{100}){40} multiply parses)",
                                NULL, err);
            else
                st = write_result(r, inf, gen, err);
            inflight_retire(r, inf);
        }
    return st;
}

/* ---- job lifecycle ---- */

/* Add an engine's speculation counters to the run's. */
static void add_engine_stats(struct engine_stats *sum, const struct engine_stats *s)
{
    sum->steps += s->steps;
    sum->preemptions += s->preemptions;
    sum->spec_steps += s->spec_steps;
    sum->spec_skipped += s->spec_skipped;
    sum->spec_drafted += s->spec_drafted;
    sum->spec_accepted += s->spec_accepted;
    for (int i = 0; i < ENGINE_SPEC_MAX_K; i++) {
        sum->spec_tried_at[i] += s->spec_tried_at[i];
        sum->spec_acc_at[i] += s->spec_acc_at[i];
    }
    sum->spec_draft_s += s->spec_draft_s;
    sum->spec_model_tokens += s->spec_model_tokens;
    sum->spec_model_cached += s->spec_model_cached;
    sum->spec_model_drawn += s->spec_model_drawn;
    sum->spec_model_argmax += s->spec_model_argmax;
    sum->spec_ece = s->spec_ece;
}

/* Free the loaded model and what comes with it (job_close keeps them for the next job). */
static void model_release(struct batch_run *r)
{
    engine_chat_free(r->chat);
    engine_tok_free(r->tok);
    engine_model_free(r->m);
    engine_model_free(r->draft);
    kern_group_free(r->group);
    r->chat = NULL;
    r->tok = NULL;
    r->m = NULL;
    r->draft = NULL;
    r->group = NULL;
    free(r->model_loaded);
    r->model_loaded = NULL;
    r->model_sha[0] = 0;
}

/* The job's model, checked against its sha256 and loaded with its tokenizer, chat template and
 * the draft model; the previous job's when it names the same file and the file is unchanged. */
static enum status model_open(struct batch_run *r, struct err_detail *err)
{
    const char *path = r->job.model_path;
    struct file_version before, after;
    if (file_version_get(path, &before))
        return err_set(err, ST_ERR_IO, "model %s: %s", path, strerror(errno));
    const char *want = r->job.model_sha256 && *r->job.model_sha256 ? r->job.model_sha256 : NULL;
    int kept = r->m && r->model_loaded && !strcmp(r->model_loaded, path) &&
               file_version_same(&before, &r->model_id) && (!want || r->model_sha[0]);
    if (!kept) {
        model_release(r);
        int cached = 0;
        if (want) {
            enum status st = queue_model_sha(r->q, path, r->model_sha, &cached, err);
            if (st)
                return st;
            if (cached)
                LOG_INFO("model %s: unchanged since it was hashed (sha256 recorded in the queue)",
                         path);
        }
    }
    if (want && strcmp(r->model_sha, want)) {
        enum status st = err_set(err, ST_ERR_INVALID_ARG,
                                 "model %s changed since the job was submitted (sha256 %s, job "
                                 "has %s)",
                                 path, r->model_sha, want);
        model_release(r);
        return st;
    }
    if (kept) {
        LOG_INFO("job %s: model %s still loaded", r->job.name, path);
        return ST_OK;
    }
    enum status st;
    fault_hit("run.model_load"); /* (QUERN_FAULT=run.model_load:1:sleep=S: a slow load) */
    if ((st = kern_group_open(&r->group, &r->o->backend, err)) ||
        (st = engine_model_load_group(&r->m, path, r->group, err)) ||
        (st = engine_tok_load(&r->tok, engine_model_gguf(r->m), err)))
        return st;
    if ((r->o->engine.spec & ENGINE_SPEC_MODEL) &&
        (st = engine_model_load_group(&r->draft, r->o->draft_model, r->group, err))) {
        err_prefix(err, "--draft-model %s", r->o->draft_model);
        return st;
    }
    struct err_detail e2 = {0};
    if (engine_chat_init_named(&r->chat, engine_model_gguf(r->m), r->o->chat_template, &e2))
        LOG_WARN("%s: %s; chat requests will fail", path, e2.msg);
    /* kept for the next job only if the file did not change while it was hashed and loaded */
    if (!fault_hit("run.model_changed") && !file_version_get(path, &after) &&
        file_version_same(&before, &after) && (r->model_loaded = strdup(path)))
        r->model_id = before;
    else
        r->model_sha[0] = 0;
    return ST_OK;
}

static void job_close(struct batch_run *r)
{
    batch_progress_loading_stop(r);
    if (r->e)
        add_engine_stats(&r->stats.engine, engine_get_stats(r->e));
    engine_free(r->e);
    r->e = NULL;
    while (r->inflight) { /* requests a stop left in the engine */
        struct batch_inflight *next = r->inflight->next;
        inflight_free(r->inflight);
        r->inflight = next;
    }
    r->n_inflight = 0;
    grammars_free(r);
    if (r->out) {
        count_commits(r);
        r->done_base = r->stats.items_done;
        r->failed_base = r->stats.items_failed;
        r->discarded_base = r->stats.records_discarded;
        batch_out_free(r->out);
        r->out = NULL;
    }
    queue_job_free(&r->job);
    memset(&r->job, 0, sizeof(r->job));
}

static enum status recover_shards(struct batch_run *r, struct err_detail *err)
{
    return batch_recover_shards(r->q, r->job.id, r->stats.run_id, (int64_t)(r->o->lease * 1000),
                                err);
}

static int stop_requested(struct batch_run *r)
{
    int sig = batch_run_signals(r);
    if (sig || (r->o->max_runtime > 0 && batch_now() - r->stats.t_start >= r->o->max_runtime)) {
        if (!r->t_stop) {
            r->t_stop = batch_now();
            /* an orderly stop from here on: its writes (commit, give-back, the run's end) wait
             * for a lock as long as they must */
            queue_set_interrupt(r->q, NULL);
            r->interruptible = 0;
            LOG_INFO("stopping: %s; in-flight requests get %.0f s to finish",
                     sig ? "signal received" : "--max-runtime reached", (double)r->o->grace);
        }
        /* recorded in the queue (tried again until it is): killed during the grace, this run
         * costs its items no attempt */
        if (!r->stop_recorded) {
            struct err_detail e2 = {0};
            enum status st = queue_run_stopping(r->q, r->stats.run_id, &e2);
            if (!st)
                r->stop_recorded = 1;
            else if (st != ST_ERR_BUSY && !r->stop_warned++)
                LOG_WARN("recording this run's stop in the queue: %s", e2.msg);
        }
        return 1;
    }
    return 0;
}

/* Renew our leases and heartbeat when a third of the lease has passed (before any claim, so a
 * run that stalled is seen alive again before it takes more work). */
static enum status beat(struct batch_run *r, int force, struct err_detail *err)
{
    double now = batch_now();
    if (!force && now - r->t_beat < r->o->lease / 3)
        return ST_OK;
    int64_t held = 0;
    struct batch_out_counts c;
    batch_out_get_counts(r->out, &c);
    enum status st =
        queue_lease_extend(r->q, r->stats.run_id, (int64_t)(r->o->lease * 1000), &held, err);
    if (!st && (size_t)held < c.held) {
        LOG_WARN("run %lld holds %lld leases, %zu expected: some were taken over (this run was "
                 "silent past its --lease) or cancelled; their records will not be committed",
                 (long long)r->stats.run_id, (long long)held, c.held);
        r->t_lease_check = 0; /* drop_lost at once */
    }
    r->t_beat = now;
    return st;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Requests whose leases this run has lost (their job was cancelled, or another run took them
 * over after this one was silent past its --lease) leave the engine at once: their records
 * could never be committed, so computing them would only keep the machine from other work.
 * Every BATCH_LEASE_CHECK_S (one read of the run's leases), and at once after a beat found
 * leases missing or a part's cancel request was acted on. */
static enum status drop_lost(struct batch_run *r, struct err_detail *err)
{
    r->t_lease_check = batch_now();
    if (!r->inflight)
        return ST_OK;
    struct batch_out_counts c;
    batch_out_get_counts(r->out, &c);
    int64_t *ids;
    size_t n, dropped = 0;
    enum status st = queue_lease_list(r->q, r->stats.run_id, &ids, &n, err);
    if (st)
        return st;
    for (struct batch_inflight *inf = r->inflight, *next; n < c.held && inf; inf = next) {
        next = inf->next;
        if (n && bsearch(&inf->item_id, ids, n, sizeof(*ids), cmp_i64))
            continue;
        engine_cancel(r->e, inf);
        batch_out_drop(r->out, inf->item_id);
        inflight_retire(r, inf);
        dropped++;
    }
    free(ids);
    if (dropped) {
        r->stats.items_dropped += (int64_t)dropped;
        LOG_INFO("job %s: %zu unfinished requests dropped: their leases are gone (cancelled, or "
                 "taken over by another run)",
                 r->job.name, dropped);
    }
    return ST_OK;
}

/* A stop's grace is for the requests that run: those the engine has not started yet go back to
 * the queue at once (queue_release: no attempt counted), where another run may take them, rather
 * than start during the grace, take compute from the ones finishing and be cut at its end. */
static enum status give_back_unstarted(struct batch_run *r, struct err_detail *err)
{
    r->unstarted_back = 1;
    size_t cap = engine_pending(r->e);
    if (!cap)
        return ST_OK;
    const void **users = malloc(cap * sizeof(*users));
    int64_t *ids = malloc(cap * sizeof(*ids));
    enum status st = ST_OK;
    if (!users || !ids) { /* (only saves work, as below) */
        LOG_WARN("giving back the requests not started yet: out of memory");
        goto out;
    }
    size_t n = 0, m = engine_unstarted(r->e, users, cap);
    for (size_t i = 0; i < m; i++) {
        const struct batch_inflight *inf = users[i];
        if (!inf->n_got) /* (a choice of it finished: it has started) */
            users[n] = inf, ids[n++] = inf->item_id;
    }
    int64_t released = 0;
    struct err_detail e2 = {0};
    if (!n)
        goto out;
    if (queue_release(r->q, r->stats.run_id, ids, n, &released, &e2)) {
        /* (only saves work: they start in the grace, and what is left goes back at its end) */
        LOG_WARN("giving back the requests not started yet: %s", e2.msg);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        struct batch_inflight *inf = (struct batch_inflight *)users[i];
        engine_cancel(r->e, inf);
        batch_out_drop(r->out, inf->item_id);
        inflight_retire(r, inf);
    }
    r->stats.items_returned += released;
    LOG_INFO("job %s: %lld requests not started yet went back to the queue; %zu run on in the "
             "grace",
             r->job.name, (long long)released, engine_pending(r->e));
out:
    free(users);
    free(ids);
    return st;
}

/* Sleep up to secs, waking early on a stop signal. */
static void nap(const struct batch_run *r, double secs)
{
    double until = batch_now() + secs;
    while (!batch_run_signals(r) && batch_now() < until) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* A job whose items are all finished (or that was cancelled) but whose output is not sealed:
 * close the shards dead runs
 * left open and write the manifest (in OUT/<name>, out_flag as for batch_job_dir), complete when
 * nothing is open any more (a shard of a run that still looks alive keeps it incomplete until a
 * later run closes it). */
static int close_done_job(struct batch_run *r, const char *out_flag, struct err_detail *err)
{
    int64_t open = 0;
    if (batch_job_dir(r->q, &r->job, out_flag, 1, r->job_dir, sizeof(r->job_dir), err) ||
        recover_shards(r, err) || batch_count_open_shards(r->q, r->job.id, &open, err) ||
        batch_manifest_write(r->q, &r->job, r->job_dir, err))
        return -1;
    LOG_INFO("job %s: %s earlier; manifest %s", r->job.name,
             r->job.state == QUEUE_JOB_CANCELLED ? "cancelled" : "done",
             open ? "still incomplete (a run that looks alive holds a shard open)"
                  : "written, complete");
    return 1;
}

/* What can change this run's outputs (docs/ARCHITECTURE.md, "Provenance"), as the JSON object
 * stored in its row (queue_run_set_engine), kept in r->engine_json for a part's progress file
 * and listed by manifests and `quern status`; logged once per job. Not in it: the thread count
 * and the tensor-parallel ranks (outputs do not depend on them: README "Devices"), nor
 * speculative decoding (lossless). */
static enum status record_engine(struct batch_run *r, const struct engine_params *ep,
                                 struct err_detail *err)
{
    cJSON *o = cJSON_CreateObject();
    const char *device = kern_backend_describe(r->group->be[0]);
    const char *matmul = kern_act_name(r->o->backend.act);
    /* as stored (f16 is bfloat16 in the CPU's bf16 mode on AMX: the tiles' attention) */
    const char *kv =
        kern_kv_dtype_name((enum kern_kv_dtype)engine_kv_layer(engine_get_kv(r->e), 0, 0).dtype);
    if (!o || !cJSON_AddStringToObject(o, "quern", quern_version()) ||
        !cJSON_AddStringToObject(o, "device", device) ||
        !cJSON_AddStringToObject(o, "matmul", matmul) ||
        !cJSON_AddStringToObject(o, "kv_dtype", kv) ||
        !cJSON_AddNumberToObject(o, "kv_block", ep->kv_block) ||
        (r->o->chat_template && /* chat prompts rendered otherwise than by the model's own */
         !cJSON_AddStringToObject(o, "chat_template", r->o->chat_template))) {
        cJSON_Delete(o);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!text)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    const int32_t blocks = engine_kv_n_blocks(engine_get_kv(r->e));
    LOG_INFO("run %lld: %s, %d rank(s), matmul %s, KV %s in blocks of %d (a pool of %.0f MiB%s "
             "for %lld tokens), quern %s",
             (long long)r->stats.run_id, device, r->group->size, matmul, kv, ep->kv_block,
             (double)engine_kv_pool_bytes(r->e) / 1048576.0, ep->kv_mem ? "" : ", --kv-mem auto",
             (long long)blocks * ep->kv_block, quern_version());
    free(r->engine_json);
    r->engine_json = text;
    io_manifest_fingerprint(text, r->fingerprint);
    return queue_run_set_engine(r->q, r->stats.run_id, text, err);
}

/* The job's parameters, model (checked against its sha256), engine and shard writer. */

static enum status job_open(struct batch_run *r, struct err_detail *err)
{
    enum status st;
    if ((st = batch_job_dir(r->q, &r->job, r->o->out, 1, r->job_dir, sizeof(r->job_dir), err)) ||
        (st = batch_check_shard_files(r->q, r->job.id, err))) /* (before any work) */
        return st;
    const char *base = strrchr(r->job.model_path, '/');
    snprintf(r->model_name, sizeof(r->model_name), "%s", base ? base + 1 : r->job.model_path);
    char *dot = strstr(r->model_name, ".gguf");
    if (dot)
        *dot = 0;
    engine_sampling_default(&r->defaults.sampling);
    r->defaults.max_tokens = 256;
    r->defaults.default_id = NULL;
    if ((st = job_params_from_json(r->job.params_json, &r->defaults, err)))
        return st;
    if ((st = model_open(r, err)))
        return st;
    if (r->chat) /* a template's "today" is the day the job was submitted, on every run of it */
        engine_chat_set_date(r->chat, r->job.created / 1000);
    struct engine_params ep = r->o->engine;
    ep.draft_model = r->draft;
    char why[128];
    if ((ep.spec & ENGINE_SPEC_MODEL) && r->draft &&
        !engine_model_same_vocab(r->m, r->draft, why, sizeof(why))) {
        /* one job of another vocabulary does not stop the run's other jobs: it goes without
         * the draft model (speculation never changes outputs) */
        LOG_WARN("job %s: the draft model's vocabulary is not the job's model's (%s): this job "
                 "runs without --spec model",
                 r->job.name, why);
        ep.spec &= ~ENGINE_SPEC_MODEL;
        ep.draft_model = NULL;
    }
    if ((st = engine_init(&r->e, r->m, r->tok, &ep, err)) || (st = record_engine(r, &ep, err)))
        return st;
    if ((st = engine_set_start_gate(r->e, start_gate, r, err)))
        return st;
    r->t_mark = 0;
    r->mark_ahead = 0;
    struct batch_out_spec spec = {r->q,
                                  r->stats.run_id,
                                  r->job.id,
                                  r->job_dir,
                                  (uint64_t)r->o->shard_bytes,
                                  (uint64_t)r->o->shard_records};
    return batch_out_open(&r->out, &spec, err);
}

/* Process one job: 1 every item finished, 0 stopped (signal, max_runtime), 2 items are
 * still leased by other live runs and no_wait was given, -1 failed. */
static int run_job(struct batch_run *r, struct err_detail *err)
{
    enum status st;
    batch_progress_loading_start(r); /* (stopped by job_close too) */
    if (job_open(r, err) || recover_shards(r, err) || engine_warmup(r->e, err))
        return -1;
    batch_progress_loading_stop(r);
    int drained = 0, remains = 0, waiting = 0;
    r->t_flush = r->t_beat = batch_now();
    batch_progress_start(r);
    for (;;) {
        int stopping = stop_requested(r);
        if (stopping && (batch_run_signals(r) > 1 || batch_now() - r->t_stop >= r->o->grace))
            break;
        if (stopping && !r->unstarted_back && (st = give_back_unstarted(r, err)))
            return -1;
        if ((st = beat(r, 0, err)))
            return -1;
        if (batch_now() - r->t_lease_check >= BATCH_LEASE_CHECK_S) {
            struct err_detail e2 = {0}; /* only saves work: a failed check is tried again */
            if (drop_lost(r, &e2))
                LOG_WARN("checking this run's leases: %s", e2.msg);
        }
        if (!stopping && !drained) {
            drained = fill(r, err, &st);
            if (st)
                return -1;
        }
        if (!engine_pending(r->e) && stopping)
            break;
        if (!engine_pending(r->e) && drained) {
            /* nothing queued for us: finished, or other runs hold the rest */
            if ((st = take_outputs(r, err)) || (st = flush_all(r, err)))
                return -1;
            int64_t queued = 0, leased = 0; /* (every second while waiting: through an index) */
            if ((st = queue_job_unfinished(r->q, r->job.id, &queued, &leased, err)))
                return -1;
            if (queued + leased == 0)
                break;
            if (r->o->no_wait) {
                LOG_INFO("job %s: %lld items are leased by other runs; --no-wait: leaving them",
                         r->job.name, (long long)leased);
                remains = 1;
                break;
            }
            if (!waiting++)
                LOG_INFO("job %s: waiting for %lld items leased by other runs (taken over if "
                         "their run dies; --no-wait exits 75 instead)",
                         r->job.name, (long long)leased);
            double t_nap = batch_now();
            nap(r, 1.0);
            r->stats.waited_s += batch_now() - t_nap;
            int64_t reaped = 0;
            if ((st = queue_reap_dead(r->q, &r->self, &reaped, err)) || (st = beat(r, 1, err)))
                return -1;
            if (reaped)
                LOG_INFO("%lld dead run(s) (processes gone on this host, or any other host's in a "
                         "part this run holds): their items are queued again",
                         (long long)reaped);
            drained = 0;
            batch_progress_tick(r);
            continue;
        }
        fault_hit("run.step"); /* (QUERN_FAULT=run.step:N:kill: a crash before the Nth step) */
        if ((st = engine_step(r->e, err)) || (st = take_outputs(r, err)))
            return -1;
        double now = batch_now();
        struct batch_out_counts oc;
        batch_out_get_counts(r->out, &oc);
        size_t pending = oc.pending_results + oc.pending_errors;
        if (pending >= (size_t)r->o->flush_records ||
            (pending && now - r->t_flush >= r->o->flush_secs))
            if ((st = flush_all(r, err)))
                return -1;
        batch_progress_tick(r);
    }
    if ((st = take_outputs(r, err)) || (st = flush_all(r, err)))
        return -1;
    struct batch_out_counts oc;
    batch_out_get_counts(r->out, &oc);
    if (oc.held) { /* stopped: give back what did not finish */
        int64_t released = 0;
        if ((st = batch_out_release(r->out, &released, err)))
            return -1;
        r->stats.items_returned += released;
        LOG_INFO("released %lld unfinished items back to the queue", (long long)released);
    }
    if ((st = batch_out_close(r->out, err)))
        return -1;
    /* shards of runs that died while we ran are closed now; one whose run still looks alive
     * may hold records, so the manifest is not complete until a later run has closed it */
    int64_t open = 0, queued = 0, leased = 0;
    if ((st = recover_shards(r, err)) ||
        (st = batch_count_open_shards(r->q, r->job.id, &open, err)) ||
        (st = queue_job_unfinished(r->q, r->job.id, &queued, &leased, err)))
        return -1;
    int complete = queued == 0 && leased == 0;
    if (complete && open) {
        LOG_WARN("job %s: %lld shard(s) still open by a run that looks alive (its heartbeat is "
                 "within --lease %g s); the manifest says complete once a later run has closed "
                 "them",
                 r->job.name, (long long)open, (double)r->o->lease);
        complete = 0;
    }
    struct queue_job now; /* a cancel while the run worked: the manifest says so */
    if ((st = queue_job_get(r->q, r->job.id, &now, err)))
        return -1;
    r->job.state = now.state;
    queue_job_free(&now);
    if ((st = batch_manifest_write(r->q, &r->job, r->job_dir, err)))
        return -1;
    LOG_INFO("job %s: shards and manifest.json in %s/", r->job.name, r->job_dir);
    batch_progress_end(r);
    if (complete)
        return 1;
    return r->t_stop ? 0 : remains ? 2 : 1;
}

/* ---- the run ---- */

/* The queue's ready jobs that r->job_ids lacks, appended to it (finished ones too with
 * finished); *added says how many. */
static enum status add_jobs(struct batch_run *r, int finished, size_t *added,
                            struct err_detail *err)
{
    struct queue_job *jobs;
    size_t n;
    *added = 0;
    enum status st = queue_job_list(r->q, &jobs, &n, err);
    if (st)
        return st;
    for (size_t i = 0; i < n && !st; i++) {
        int known = !jobs[i].ready || (!finished && (jobs[i].state == QUEUE_JOB_DONE ||
                                                     jobs[i].state == QUEUE_JOB_CANCELLED));
        for (size_t k = 0; k < r->n_jobs && !known; k++)
            known = r->job_ids[k] == jobs[i].id;
        if (known)
            continue;
        int64_t *ids = realloc(r->job_ids, sizeof(int64_t) * (r->n_jobs + 1));
        if (!ids) {
            st = err_set(err, ST_ERR_NOMEM, "out of memory");
            break;
        }
        r->job_ids = ids;
        r->job_ids[r->n_jobs++] = jobs[i].id;
        (*added)++;
    }
    queue_job_list_free(jobs, n);
    return st;
}

/* The jobs to work on, into r->job_ids. */
static enum status choose_jobs(struct batch_run *r, struct err_detail *err)
{
    enum status st;
    if (r->o->job) {
        struct queue_job j;
        if ((st = queue_job_find(r->q, r->o->job, &j, err)))
            return st;
        if (!j.ready) {
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "job '%s' is still being submitted; run it once its submit has finished",
                         j.name);
            queue_job_free(&j);
            return st;
        }
        r->job_ids = malloc(sizeof(int64_t));
        if (r->job_ids)
            r->job_ids[r->n_jobs++] = j.id;
        queue_job_free(&j);
        return r->job_ids ? ST_OK : err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    size_t added; /* (done and cancelled jobs too: batch_run_jobs checks their output is sealed) */
    return add_jobs(r, 1, &added, err);
}

enum status batch_run_open(struct batch_run **out, const struct batch_opts *o,
                           struct err_detail *err)
{
    struct batch_run *r = calloc(1, sizeof(*r));
    *out = r;
    if (!r)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    r->o = o;
    r->stats.t_start = batch_now();
    proc_identity_self(&r->self);
    char worker[64];
    const char *slurm = getenv("SLURM_JOB_ID");
    snprintf(worker, sizeof(worker), "%s", o->worker ? o->worker : slurm ? slurm : "");
    /* the whole file is checked once (a corrupt queue is an error before any work), and a
     * missing one is an error unless create: a mistyped --db must not look like "drained" */
    /* until the run first holds leases (fill) or notices a stop, a stop signal ends a wait for
     * another process's lock at once: there is nothing to commit or give back yet */
    struct queue_options qo = {
        .must_exist = !o->create, .check_integrity = true, .interrupt = o->signals};
    enum status st;
    if (o->parts)
        st = batch_parts_open(o->parts, o->part, o->busy_ms, BATCH_PART_CHECK, &r->q, err);
    else
        st = queue_open_opts(&r->q, o->db, &qo, err);
    if (st)
        return st;
    queue_set_interrupt(r->q, o->signals); /* (a part's file is opened without it) */
    r->interruptible = 1;
    /* runs and submits on this host whose process is gone: items back, half-submitted jobs
     * deleted, before anything is chosen */
    int64_t reaped = 0;
    if ((st = queue_reap_dead(r->q, &r->self, &reaped, err)) ||
        (st = queue_jobs_gc(r->q, &r->self, QUEUE_DEFAULT_SUBMIT_STALE_MS, NULL, err)) ||
        (st = choose_jobs(r, err)))
        return st;
    struct queue_run_spec rs = {0};
    rs.job_id = o->job ? r->job_ids[0] : 0;
    rs.worker_id = worker[0] ? worker : NULL;
    rs.host = r->self.host;
    rs.pid = r->self.pid;
    rs.boot_id = r->self.boot_id;
    rs.pid_ns = r->self.pid_ns;
    rs.pstart = r->self.start_ticks;
    if ((st = queue_run_start(r->q, &rs, &r->stats.run_id, err)))
        return st;
    queue_reserve_keep(r->q);
    if (reaped)
        LOG_INFO("%lld dead run(s) (processes gone on this host, or any other host's in a part "
                 "this run holds): their items and open shards are taken over",
                 (long long)reaped);
    return ST_OK;
}

/* How many shards the current job has. */
static enum status job_shard_count(struct batch_run *r, int64_t *n_shards, struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    enum status st = queue_shard_list(r->q, r->job.id, &sh, &n, err);
    queue_shard_list_free(sh, n);
    *n_shards = (int64_t)n;
    return st;
}

/* 1 when r->job's output directory holds a manifest.json. */
static int manifest_written(struct batch_run *r)
{
    char dir[4096], path[4200];
    struct stat sb;
    struct err_detail e = {0};
    if (batch_job_dir(r->q, &r->job, NULL, 0, dir, sizeof(dir), &e))
        return 0;
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    return !stat(path, &sb);
}

/* A job that failed (its model missing, its output directory full or gone, ...) in a run over
 * several jobs: its items go back to the queue uncounted and the run goes on with the others
 * (before, every run stopped at that job and never reached the rest); 1 when it may go on, 0
 * when even the give-back failed (the queue itself: the run ends as before). */
static int job_failed_go_on(struct batch_run *r, const struct err_detail *err)
{
    int64_t released = 0;
    struct err_detail e2 = {0};
    if (r->o->job || r->o->parts || (r->out && batch_out_release(r->out, &released, &e2))) {
        if (e2.msg[0])
            LOG_WARN("job %s: giving back its items: %s", r->job.name, e2.msg);
        return 0;
    }
    char back[96] = "";
    r->stats.items_returned += released;
    if (released)
        snprintf(back, sizeof(back), "; its %lld unfinished items are back in the queue, uncounted",
                 (long long)released);
    LOG_ERROR("job %s failed: %s%s; going on with the other jobs (this run exits 1)", r->job.name,
              err->msg, back);
    return 1;
}

enum batch_end batch_run_jobs(struct batch_run *r, struct err_detail *err)
{
    int result = 1, remains = 0, n_failed = 0;
    struct err_detail first = {0}; /* the first failed job's error */
    size_t i = 0, added = 0;
    do {
        for (; i < r->n_jobs && (result == 1 || result == 2); i++) {
            if (queue_job_get(r->q, r->job_ids[i], &r->job, err)) {
                result = -1;
                break;
            }
            int64_t shards = 1;
            int part = 0, parts = 0;
            if (r->job.state == QUEUE_JOB_QUEUED && r->job.n_items == 0) {
                /* a job without items (an older quern left such parts queued): done */
                queue_job_free(&r->job);
                if (queue_job_finish_empty(r->q, r->job_ids[i], err) ||
                    queue_job_get(r->q, r->job_ids[i], &r->job, err)) {
                    memset(&r->job, 0, sizeof(r->job));
                    result = -1;
                    break;
                }
            }
            int finished = r->job.state == QUEUE_JOB_DONE || r->job.state == QUEUE_JOB_CANCELLED;
            if (finished &&
                (job_shard_count(r, &shards, err) || batch_parts_which(r->q, &part, &parts, err)))
                result = -1;
            /* cancelled before any output: nothing to seal, except in a part, whose manifest
             * (empty) the job's combined one waits for to be complete, or where a stopped run
             * wrote one already (it says complete: false until sealed) */
            if (result >= 0 && r->job.state == QUEUE_JOB_CANCELLED && !shards && !parts &&
                !manifest_written(r))
                shards = -1;
            if (result < 0 || shards < 0) {
                queue_job_free(&r->job);
                memset(&r->job, 0, sizeof(r->job));
                continue;
            }
            if (finished) {
                /* finished or cancelled earlier: make sure its output is sealed (a dead run's open
                 * shard cut back to what was committed and closed) and its manifest current; one
                 * without output or manifest yet (a part that got no lines, done at submit) writes
                 * it where this run's --out says, as its first shard would */
                const char *out_flag = shards || manifest_written(r) ? NULL : r->o->out;
                int64_t open = 0;
                result = 1;
                if (batch_count_open_shards(r->q, r->job.id, &open, err) ||
                    batch_job_dir(r->q, &r->job, out_flag, 0, r->job_dir, sizeof(r->job_dir), err))
                    result = -1;
                else if (open || !batch_manifest_current(r->q, &r->job, r->job_dir))
                    result = close_done_job(r, out_flag, err);
                else if (batch_manifest_combined(r->q, r->job_dir, err))
                    result = -1; /* (a run killed between a part's manifest and the combined one) */
                job_close(r);
                continue;
            }
            LOG_INFO("run %lld: job %lld '%s' (%s)", (long long)r->stats.run_id,
                     (long long)r->job.id, r->job.name, r->job.model_path);
            result = run_job(r, err);
            if (result < 0 && !batch_run_signals(r) && job_failed_go_on(r, err)) {
                if (!n_failed++)
                    err_set(&first, err->status, "job %s: %s", r->job.name, err->msg);
                result = 1;
            }
            remains |= result == 2;
            job_close(r);
        }
        /* without --job, jobs submitted while this run worked are worked too before it says it
         * drained the queue (it exited 0 "drained" with them queued) */
        added = 0;
        if (!r->o->job && (result == 1 || result == 2) && !batch_run_signals(r)) {
            if (add_jobs(r, 0, &added, err)) /* (submitted since: not finished ones) */
                result = -1;
            else if (added)
                LOG_INFO("%zu job(s) submitted while this run worked: working them too", added);
        }
    } while (added);
    if (result < 0)
        return BATCH_END_FAILED;
    if (n_failed) { /* the others done (or stopped): the run still says it failed */
        if (n_failed > 1)
            err_set(err, first.status, "%s (and %d more jobs failed: see above)", first.msg,
                    n_failed - 1);
        else
            err_set(err, first.status, "%s", first.msg);
        return BATCH_END_FAILED;
    }
    if (result == 0)
        return BATCH_END_STOPPED;
    return remains ? BATCH_END_REMAINS : BATCH_END_DRAINED;
}

enum status batch_run_end(struct batch_run *r, const char *reason, const char *summary_json,
                          struct err_detail *err)
{
    int64_t requeued = 0, released = 0;
    int room = 0; /* queue_make_room tried */
    /* (none to give back after an orderly stop, nor when it never held any: interruptible) */
    if ((!strcmp(reason, "error") || !strcmp(reason, "signal")) && !r->interruptible) {
        struct err_detail e2 = {0}; /* failing, the items go back counted, below */
        enum status st = queue_release(r->q, r->stats.run_id, NULL, 0, &released, &e2);
        if (st == ST_ERR_IO && (room = 1, !queue_make_room(r->q, &e2))) {
            /* a full disk (the usual I/O error): the WAL made room, try once more; without
             * it the next run would find the items a dead run's, their attempts spent */
            LOG_WARN("giving back this run's items: %s; checkpointed the WAL, trying again",
                     e2.msg);
            st = queue_release(r->q, r->stats.run_id, NULL, 0, &released, &e2);
        }
        if (st)
            LOG_WARN("giving back this run's items: %s", e2.msg);
        else if (released)
            LOG_INFO("%lld unfinished items given back to the queue", (long long)released);
    }
    enum status st = queue_run_end(r->q, r->stats.run_id, reason, summary_json, &requeued, err);
    if (st == ST_ERR_IO && !room && !queue_make_room(r->q, &(struct err_detail){0}))
        st = queue_run_end(r->q, r->stats.run_id, reason, summary_json, &requeued, err);
    /* (SQLite's own checkpoints, and the one at close, swallow their errors: a failing disk's
     * EIO went unsaid, exit 0) */
    if (!st && (st = queue_checkpoint(r->q, err)))
        err_prefix(err, "recorded, and its work is in the queue's WAL (read back by the next "
                        "run), but the disk failed");
    return st;
}

int batch_run_interruptible(const struct batch_run *r)
{
    return r && r->interruptible;
}

const struct batch_stats *batch_run_stats(struct batch_run *r)
{
    return &r->stats;
}

void batch_run_free(struct batch_run *r)
{
    if (!r)
        return;
    job_close(r);
    model_release(r);
    free(r->job_ids);
    free(r->engine_json);
    free(r->stats.ttft_ms);
    free(r->stats.tpot_ms);
    queue_close(r->q);
    free(r);
}
