/* Progress numbers of a job, their published JSON and rates sampled from growing counts
 * (batch/batch.h), and a run's bookkeeping of them: snapshot, publish, show. */
#include "batch/batch.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "batch/batch_internal.h"
#include "common/log.h"
#include "io/shard.h"
#include "jobs/json.h"

int64_t batch_progress_left(const struct batch_progress *p)
{
    int64_t left = p->total - p->done - p->failed - p->cancelled;
    return left > 0 ? left : 0;
}

void batch_progress_eta(struct batch_progress *p)
{
    int64_t left = batch_progress_left(p);
    if (!left) {
        p->eta_s = 0;
        return;
    }
    /* requests, not sequences (mean_out counts every choice of one): those in flight, running
     * or waiting in the engine (older documents: the running sequences). mean_out is the
     * finished items' mean length, and the first to finish are the short ones: until as many
     * have finished as are running, it says too little about those still running (the ETA is
     * unknown rather than far too short) */
    const int64_t flight = p->in_flight > 0 ? p->in_flight : p->running;
    const int64_t running = p->running < flight ? p->running : flight;
    if (p->mean_out <= 0 || p->gen_tok_s <= 0 || p->done + p->failed < running) {
        p->eta_s = -1;
        return;
    }
    /* an unfinished request's tokens so far are a lower bound on its length: the mean over the
     * finished and in-flight ones together is the least the mean can be */
    double mean = p->mean_out;
    const double run = (double)flight;
    if (flight > 0) {
        const double floor =
            ((double)p->done * p->mean_out + p->inflight_tokens) / ((double)p->done + run);
        mean = floor > mean ? floor : mean;
    }
    /* the items not in flight at that mean; those in flight the rest of it, one more token
     * each at least */
    const double queued = (double)left > run ? (double)left - run : 0;
    double running_left = run * mean - p->inflight_tokens;
    running_left = running_left > run ? running_left : run;
    p->eta_s = (queued * mean + running_left) / p->gen_tok_s;
}

void batch_progress_add_json(cJSON *o, const struct batch_progress *p)
{
    cJSON_AddNumberToObject(o, "job_id", (double)p->job_id);
    cJSON_AddStringToObject(o, "job", p->job);
    cJSON_AddNumberToObject(o, "total", (double)p->total);
    cJSON_AddNumberToObject(o, "done", (double)p->done);
    cJSON_AddNumberToObject(o, "failed", (double)p->failed);
    cJSON_AddNumberToObject(o, "cancelled", (double)p->cancelled);
    cJSON_AddNumberToObject(o, "gen_tokens", (double)p->gen_tokens);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)p->prompt_tokens);
    cJSON_AddNumberToObject(o, "gen_tok_s", p->gen_tok_s);
    cJSON_AddNumberToObject(o, "prompt_tok_s", p->prompt_tok_s);
    cJSON_AddNumberToObject(o, "mean_out", p->mean_out);
    cJSON_AddNumberToObject(o, "inflight_tokens", p->inflight_tokens);
    cJSON_AddNumberToObject(o, "running", (double)p->running);
    cJSON_AddNumberToObject(o, "in_flight", (double)p->in_flight);
    cJSON_AddNumberToObject(o, "waiting", (double)p->waiting);
    cJSON_AddNumberToObject(o, "kv_used", (double)p->kv_used);
    cJSON_AddNumberToObject(o, "kv_total", (double)p->kv_total);
    if (p->spec_drafted) {
        cJSON_AddNumberToObject(o, "spec_drafted", (double)p->spec_drafted);
        cJSON_AddNumberToObject(o, "spec_accepted", (double)p->spec_accepted);
    }
    cJSON_AddNumberToObject(o, "elapsed_s", p->elapsed_s);
    if (p->eta_s >= 0)
        cJSON_AddNumberToObject(o, "eta_s", p->eta_s);
    else
        cJSON_AddNullToObject(o, "eta_s");
}

char *batch_progress_to_json(const struct batch_progress *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    batch_progress_add_json(o, p);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static double num(const cJSON *o, const char *key, double dflt)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) ? v->valuedouble : dflt;
}

int batch_progress_from_json(const char *json, struct batch_progress *p)
{
    memset(p, 0, sizeof(*p));
    p->eta_s = -1;
    cJSON *o = json ? cJSON_Parse(json) : NULL;
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return 0;
    }
    const cJSON *name = cJSON_GetObjectItem(o, "job");
    if (cJSON_IsString(name) && name->valuestring)
        snprintf(p->job, sizeof(p->job), "%s", name->valuestring);
    p->job_id = (int64_t)num(o, "job_id", 0);
    p->total = (int64_t)num(o, "total", 0);
    p->done = (int64_t)num(o, "done", 0);
    p->failed = (int64_t)num(o, "failed", 0);
    p->cancelled = (int64_t)num(o, "cancelled", 0);
    p->gen_tokens = (int64_t)num(o, "gen_tokens", 0);
    p->prompt_tokens = (int64_t)num(o, "prompt_tokens", 0);
    p->gen_tok_s = num(o, "gen_tok_s", 0);
    p->prompt_tok_s = num(o, "prompt_tok_s", 0);
    p->mean_out = num(o, "mean_out", 0);
    p->inflight_tokens = num(o, "inflight_tokens", 0);
    p->spec_drafted = (int64_t)num(o, "spec_drafted", 0);
    p->spec_accepted = (int64_t)num(o, "spec_accepted", 0);
    p->running = (int64_t)num(o, "running", 0);
    p->in_flight = (int64_t)num(o, "in_flight", 0);
    p->waiting = (int64_t)num(o, "waiting", 0);
    p->kv_used = (int64_t)num(o, "kv_used", 0);
    p->kv_total = (int64_t)num(o, "kv_total", 0);
    p->elapsed_s = num(o, "elapsed_s", 0);
    p->eta_s = num(o, "eta_s", -1);
    p->runs = 1;
    cJSON_Delete(o);
    return 1;
}

void batch_rate_reset(struct batch_rate *r)
{
    memset(r, 0, sizeof(*r));
}

void batch_rate_add(struct batch_rate *r, double t, double v)
{
    /* a sample less than a second after the one before the newest replaces the newest, so the
     * window stays ~10 s however often this is called */
    if (r->n >= 2) {
        int prev = (r->head + BATCH_RATE_SAMPLES - 1) % BATCH_RATE_SAMPLES;
        if (t - r->t[prev] < 1.0) {
            r->t[r->head] = t;
            r->v[r->head] = v;
            return;
        }
    }
    r->head = r->n ? (r->head + 1) % BATCH_RATE_SAMPLES : 0;
    r->t[r->head] = t;
    r->v[r->head] = v;
    if (r->n < BATCH_RATE_SAMPLES)
        r->n++;
}

double batch_rate_get(const struct batch_rate *r)
{
    if (r->n < 2)
        return 0;
    int old = (r->head + BATCH_RATE_SAMPLES - (r->n - 1)) % BATCH_RATE_SAMPLES;
    double dt = r->t[r->head] - r->t[old];
    return dt > 0 ? (r->v[r->head] - r->v[old]) / dt : 0;
}

/* ---- a run's progress (struct batch_run, batch/batch_internal.h) ---- */

/* The job's live numbers: its counts in the queue (read at most once a second, less often
 * when reading them is slow) plus what this run finished since, committed or not, and the
 * engine's token counts (unfinished requests included) and load. */
static void snapshot(struct batch_run *r, double now, struct batch_progress *p)
{
    if (!r->t_counts || now - r->t_counts >= fmax(1.0, 20 * r->counts_cost)) {
        struct queue_counts c;
        struct err_detail err = {0};
        if (!queue_job_counts(r->q, r->job.id, &c, &err)) {
            r->counts = c;
            r->done_at_counts = r->stats.items_done;
            r->failed_at_counts = r->stats.items_failed;
        }
        r->counts_cost = batch_now() - now;
        r->t_counts = now;
    }
    struct batch_out_counts oc = {0};
    if (r->out)
        batch_out_get_counts(r->out, &oc);
    const struct queue_counts *c = &r->counts;
    memset(p, 0, sizeof(*p));
    p->job_id = r->job.id;
    snprintf(p->job, sizeof(p->job), "%s", r->job.name ? r->job.name : "");
    p->total = c->total;
    p->cancelled = c->items[QUEUE_ITEM_CANCELLED];
    p->done = c->items[QUEUE_ITEM_DONE] + (r->stats.items_done - r->done_at_counts) +
              (int64_t)oc.pending_results;
    p->failed = c->items[QUEUE_ITEM_FAILED] + (r->stats.items_failed - r->failed_at_counts) +
                (int64_t)oc.pending_errors;
    if (p->done + p->failed + p->cancelled > p->total) /* a commit by another run since */
        p->done = p->total - p->failed - p->cancelled;
    const struct engine_stats *es = engine_get_stats(r->e);
    struct engine_load ld;
    engine_get_load(r->e, &ld);
    p->gen_tokens = (int64_t)es->gen_tokens;
    p->prompt_tokens = (int64_t)es->prompt_tokens;
    batch_rate_add(&r->gen_rate, now, (double)es->gen_tokens);
    batch_rate_add(&r->prompt_rate, now, (double)es->prompt_tokens);
    p->gen_tok_s = batch_rate_get(&r->gen_rate);
    p->prompt_tok_s = batch_rate_get(&r->prompt_rate);
    p->running = ld.running;
    p->in_flight = r->n_inflight;
    p->waiting = (int64_t)ld.waiting;
    p->kv_used = ld.kv_used;
    p->kv_total = ld.kv_total;
    p->spec_drafted = (int64_t)es->spec_drafted;
    p->spec_accepted = (int64_t)es->spec_accepted;
    p->runs = 1;
    int64_t outs = r->n_out - r->job_out0, toks = r->stats.completion_tokens - r->job_tok0;
    if (outs > 0)
        p->mean_out = (double)toks / (double)outs;
    else if (c->items[QUEUE_ITEM_DONE] > 0) /* finished by earlier runs */
        p->mean_out = (double)c->completion_tokens / (double)c->items[QUEUE_ITEM_DONE];
    /* tokens of requests still running: not those of finished ones, nor of dropped ones */
    p->inflight_tokens = fmax(0, (double)(p->gen_tokens - toks - (int64_t)es->cancelled_tokens));
    p->elapsed_s = now - r->t_job;
    batch_progress_eta(p);
}

/* A part's progress document for processes that cannot open the part while this run holds
 * it: p's numbers and the run's identity (updated_ms set when it is written). */
static cJSON *part_doc(const struct batch_run *r, const struct batch_progress *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    batch_progress_add_json(o, p);
    cJSON_AddNumberToObject(o, "part", r->o->part);
    cJSON_AddNumberToObject(o, "run_id", (double)r->stats.run_id);
    job_json_add_text(o, "host", r->self.host);
    cJSON_AddNumberToObject(o, "pid", (double)r->self.pid);
    cJSON_AddNumberToObject(o, "updated_ms", 0);
    return o;
}

static void part_doc_name(int part, char name[64])
{
    snprintf(name, 64, "part-%04d.progress.json", part);
}

/* Replace dir/name (part_doc_name) with doc, its updated_ms now. */
static void part_doc_write(const char *dir, const char *name, cJSON *doc)
{
    cJSON_ReplaceItemInObject(doc, "updated_ms", cJSON_CreateNumber((double)batch_unix_ms()));
    char *text = cJSON_PrintUnformatted(doc);
    struct err_detail err = {0};
    if (text && io_file_replace(dir, name, text, strlen(text), NULL, &err))
        LOG_DEBUG("publishing progress: %s", err.msg);
    free(text);
}

/* The part's progress file, with the run's engine. */
static void publish_part(struct batch_run *r, const struct batch_progress *p)
{
    cJSON *o = part_doc(r, p);
    if (!o)
        return;
    cJSON *eng = r->engine_json ? cJSON_Parse(r->engine_json) : NULL;
    if (eng)
        cJSON_AddItemToObject(o, "engine", eng);
    char name[64];
    part_doc_name(r->o->part, name);
    part_doc_write(r->o->parts->dir, name, o);
    cJSON_Delete(o);
}

/* ---- a part's progress while its run loads the job's model ---- */

struct batch_loading {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int stop;
    cJSON *doc;     /* the progress document (part_doc; only the thread touches it) */
    char dir[4096]; /* the parts' directory */
    char name[64];  /* part-NNNN.progress.json */
};

static void *loading_main(void *arg)
{
    struct batch_loading *l = arg;
    pthread_mutex_lock(&l->lock);
    while (!l->stop) {
        pthread_mutex_unlock(&l->lock);
        part_doc_write(l->dir, l->name, l->doc);
        pthread_mutex_lock(&l->lock);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        while (!l->stop && pthread_cond_timedwait(&l->wake, &l->lock, &until) == 0)
            ;
    }
    pthread_mutex_unlock(&l->lock);
    return NULL;
}

void batch_progress_loading_start(struct batch_run *r)
{
    if (!r->o->parts || r->loading)
        return;
    struct queue_counts c = {0};
    struct err_detail err = {0};
    if (queue_job_counts(r->q, r->job.id, &c, &err))
        LOG_DEBUG("counting the job's items: %s", err.msg);
    struct batch_progress p;
    memset(&p, 0, sizeof(p));
    p.job_id = r->job.id;
    snprintf(p.job, sizeof(p.job), "%s", r->job.name ? r->job.name : "");
    p.total = c.total;
    p.done = c.items[QUEUE_ITEM_DONE];
    p.failed = c.items[QUEUE_ITEM_FAILED];
    p.cancelled = c.items[QUEUE_ITEM_CANCELLED];
    p.runs = 1;
    p.eta_s = -1;
    struct batch_loading *l = calloc(1, sizeof(*l));
    cJSON *o = part_doc(r, &p);
    if (!l || !o) {
        free(l);
        cJSON_Delete(o);
        return;
    }
    cJSON_AddBoolToObject(o, "loading", 1);
    l->doc = o;
    snprintf(l->dir, sizeof(l->dir), "%s", r->o->parts->dir);
    part_doc_name(r->o->part, l->name);
    pthread_mutex_init(&l->lock, NULL);
    pthread_cond_init(&l->wake, NULL);
    if (pthread_create(&l->thread, NULL, loading_main, l)) {
        LOG_WARN("cannot start a thread to publish this part's progress while the model loads");
        pthread_mutex_destroy(&l->lock);
        pthread_cond_destroy(&l->wake);
        cJSON_Delete(o);
        free(l);
        return;
    }
    r->loading = l;
}

void batch_progress_loading_stop(struct batch_run *r)
{
    struct batch_loading *l = r->loading;
    if (!l)
        return;
    pthread_mutex_lock(&l->lock);
    l->stop = 1;
    pthread_cond_signal(&l->wake);
    pthread_mutex_unlock(&l->lock);
    pthread_join(l->thread, NULL);
    pthread_mutex_destroy(&l->lock);
    pthread_cond_destroy(&l->wake);
    cJSON_Delete(l->doc);
    free(l);
    r->loading = NULL;
}

/* A cancel request left beside the part (`quern cancel` could not open it): cancel the job
 * here, through this run's own connection, and remove the request. */
static void part_cancel_request(struct batch_run *r)
{
    char path[4200];
    batch_parts_path(r->o->parts, r->o->part, ".cancel", path, sizeof(path));
    if (access(path, F_OK) != 0 || !r->job.id)
        return;
    int64_t n = 0;
    struct err_detail err = {0};
    if (queue_job_cancel(r->q, r->job.id, &n, &err)) {
        LOG_WARN("job %s: cancel requested (%s): %s", r->job.name, path, err.msg);
        return;
    }
    unlink(path);
    r->t_lease_check = 0; /* its requests leave the engine at the run's next turn */
    LOG_INFO("job %s: cancelled on request (%s): %lld items cancelled; stopping", r->job.name, path,
             (long long)n);
}

/* Append a label value to buf with Prometheus' escapes (backslash, quote, newline). */
static void prom_escape(char *buf, size_t cap, const char *v)
{
    size_t n = strlen(buf);
    for (; *v && n + 3 < cap; v++) {
        if (*v == '\\' || *v == '"' || *v == '\n') {
            buf[n++] = '\\';
            buf[n++] = *v == '\n' ? 'n' : *v;
        } else {
            buf[n++] = *v;
        }
    }
    buf[n] = 0;
}

/* The run's numbers in Prometheus' text format (one HELP and TYPE per metric, labels job,
 * part, run, host), replaced atomically in o->metrics_file. */
static void write_metrics(struct batch_run *r, const struct batch_progress *p)
{
    const struct engine_stats *es = engine_get_stats(r->e);
    char lab[512] = "job=\"", run[32];
    prom_escape(lab, sizeof(lab), r->job.name ? r->job.name : "");
    if (r->o->parts)
        snprintf(lab + strlen(lab), sizeof(lab) - strlen(lab), "\",part=\"%d", r->o->part);
    snprintf(run, sizeof(run), "%lld", (long long)r->stats.run_id);
    strcat(lab, "\",run=\"");
    strcat(lab, run);
    strcat(lab, "\",host=\"");
    prom_escape(lab, sizeof(lab), r->self.host);
    strcat(lab, "\"");
    const struct {
        const char *name, *type, *help;
        double v;
    } m[] = {
        {"quern_items_done", "gauge", "Items of the job finished with a result.", (double)p->done},
        {"quern_items_failed", "gauge", "Items of the job finished with an error record.",
         (double)p->failed},
        {"quern_items_cancelled", "gauge", "Items of the job cancelled.", (double)p->cancelled},
        {"quern_items", "gauge", "Items in the job.", (double)p->total},
        {"quern_generated_tokens_total", "counter", "Tokens generated by this run for the job.",
         (double)es->gen_tokens},
        {"quern_prompt_tokens_total", "counter", "Prompt tokens computed by this run for the job.",
         (double)es->prompt_tokens},
        {"quern_cached_prompt_tokens_total", "counter",
         "Prompt tokens found in the prefix cache by this run for the job.",
         (double)es->cached_tokens},
        {"quern_steps_total", "counter", "Forward steps.", (double)es->steps},
        {"quern_batch_tokens_total", "counter", "Tokens over all forward steps.",
         (double)es->batch_tokens},
        {"quern_spec_draft_tokens_total", "counter", "Draft tokens verified.",
         (double)es->spec_drafted},
        {"quern_spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
         (double)es->spec_accepted},
        {"quern_generation_tokens_per_second", "gauge", "Tokens generated per second, recently.",
         p->gen_tok_s},
        {"quern_running_sequences", "gauge", "Sequences running.", (double)p->running},
        {"quern_waiting_requests", "gauge", "Requests waiting to run.", (double)p->waiting},
        {"quern_kv_blocks_used", "gauge", "KV cache blocks in use.", (double)p->kv_used},
        {"quern_kv_blocks", "gauge", "KV cache blocks in the pool.", (double)p->kv_total},
        {"quern_eta_seconds", "gauge", "Estimated seconds until the job is finished (-1: unknown).",
         p->eta_s},
        {"quern_last_update_seconds", "gauge", "When these numbers were written (unix time).",
         (double)batch_unix_ms() / 1000.0},
    };
    size_t cap = 8192, len = 0;
    char *text = malloc(cap);
    for (size_t i = 0; text && len < cap && i < sizeof(m) / sizeof(m[0]); i++)
        len += (size_t)snprintf(text + len, cap - len, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %.17g\n",
                                m[i].name, m[i].help, m[i].name, m[i].type, m[i].name, lab, m[i].v);
    if (!text || len >= cap) {
        free(text);
        return;
    }
    const char *path = r->o->metrics_file, *slash = strrchr(path, '/');
    char dir[4096] = ".";
    if (slash)
        snprintf(dir, sizeof(dir), "%.*s", slash == path ? 1 : (int)(slash - path), path);
    struct err_detail err = {0};
    if (io_file_replace(dir, slash ? slash + 1 : path, text, len, NULL, &err))
        LOG_WARN("--metrics-file: %s", err.msg);
    free(text);
}

/* One sample of the run's time series for the job (queue/queue.h, "Time series"). */
static void record_sample(struct batch_run *r, const struct batch_progress *p, double now)
{
    const struct engine_stats *es = engine_get_stats(r->e);
    struct queue_sample smp = {0};
    smp.run_id = r->stats.run_id;
    smp.job_id = r->job.id;
    smp.v[QUEUE_SAMPLE_DONE] = p->done;
    smp.v[QUEUE_SAMPLE_FAILED] = p->failed;
    smp.v[QUEUE_SAMPLE_GEN_TOKENS] = (int64_t)es->gen_tokens;
    smp.v[QUEUE_SAMPLE_PROMPT_TOKENS] = (int64_t)es->prompt_tokens;
    smp.v[QUEUE_SAMPLE_CACHED_TOKENS] = (int64_t)es->cached_tokens;
    smp.v[QUEUE_SAMPLE_RUNNING] = p->running;
    smp.v[QUEUE_SAMPLE_WAITING] = p->waiting;
    smp.v[QUEUE_SAMPLE_KV_USED] = p->kv_used;
    smp.v[QUEUE_SAMPLE_KV_TOTAL] = p->kv_total;
    smp.v[QUEUE_SAMPLE_STEPS] = (int64_t)es->steps;
    smp.v[QUEUE_SAMPLE_BATCH_TOKENS] = (int64_t)es->batch_tokens;
    smp.v[QUEUE_SAMPLE_SPEC_DRAFTED] = (int64_t)es->spec_drafted;
    smp.v[QUEUE_SAMPLE_SPEC_ACCEPTED] = (int64_t)es->spec_accepted;
    struct err_detail err = {0};
    if (queue_sample_add(r->q, &smp, &err))
        LOG_DEBUG("recording a sample: %s", err.msg);
    r->t_sample = now;
}

/* Store the numbers in the queue for `quern status` (a heartbeat too), and every
 * BATCH_SAMPLE_S a sample of the time series. */
static void publish(struct batch_run *r, const struct batch_progress *p, double now)
{
    if (now - r->t_sample >= BATCH_SAMPLE_S) {
        record_sample(r, p, now);
        if (r->o->metrics_file)
            write_metrics(r, p);
    }
    char *js = batch_progress_to_json(p);
    struct err_detail err = {0};
    if (js && queue_run_progress(r->q, r->stats.run_id, js, &err))
        LOG_DEBUG("publishing progress: %s", err.msg);
    free(js);
    if (r->o->parts) {
        publish_part(r, p);
        part_cancel_request(r);
    }
    r->t_pub = now;
}

void batch_progress_start(struct batch_run *r)
{
    r->t_job = batch_now();
    batch_rate_reset(&r->gen_rate);
    batch_rate_reset(&r->prompt_rate);
    batch_rate_add(&r->gen_rate, r->t_job, 0);
    batch_rate_add(&r->prompt_rate, r->t_job, 0);
    r->t_draw = r->t_job; /* at once */
    r->t_pub = 0;
    r->t_sample = -BATCH_SAMPLE_S; /* the first sample at the first publish */
    r->t_counts = 0;
    r->job_out0 = r->n_out;
    r->job_tok0 = r->stats.completion_tokens;
}

void batch_progress_tick(struct batch_run *r)
{
    double now = batch_now();
    int draw = now >= r->t_draw, pub = now - r->t_pub >= BATCH_PROGRESS_PUBLISH_S;
    if (!draw && !pub)
        return;
    struct batch_progress p;
    snapshot(r, now, &p);
    if (pub)
        publish(r, &p, now);
    if (!draw)
        return;
    double period = r->o->show_period;
    r->t_draw += period;
    if (r->t_draw <= now)
        r->t_draw = now + period;
    if (r->o->show)
        r->o->show(r->o->show_user, &p, BATCH_SHOW_LIVE);
}

void batch_progress_end(struct batch_run *r)
{
    double now = batch_now();
    struct batch_progress p;
    r->t_counts = 0; /* exact counts */
    snapshot(r, now, &p);
    r->t_sample = -BATCH_SAMPLE_S; /* the job's last word is a sample too */
    publish(r, &p, now);
    if (r->o->show)
        r->o->show(r->o->show_user, &p, BATCH_SHOW_FINAL);
}
