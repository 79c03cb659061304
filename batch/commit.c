/* The shard writer and the exactly-once commit protocol (see batch/batch.h): records are
 * appended to a shard's buffer; a commit writes one zstd frame and fsyncs it, then ONE queue
 * transaction marks those items done or failed and stores the shard's committed length. Also
 * the recovery of shards dead runs left open: cut back to their committed length, sealed. */
#include "batch/batch.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/sha256.h"
#include "io/shard.h"

/* A record appended and not yet committed. */
struct pend {
    int64_t item_id;    /* queue item */
    char *line;         /* the record (owned) */
    char *err_code;     /* NULL for results; error code for errors (owned) */
    char *err_msg;      /* error message (owned) */
    int64_t ptok, ctok; /* usage */
    double ttft, tpot;  /* latencies (ms), <= 0 unknown */
};

/* One of the two shards a writer keeps open. */
struct oshard {
    enum queue_shard_kind kind; /* results or errors */
    struct io_shard *sh;        /* open writer, or NULL until the first record */
    int64_t id;                 /* queue shard id */
    char path[4096];            /* file */
    struct pend *pend;          /* records appended since the last commit (owned) */
    size_t n_pend, cap;         /* count, capacity */
};

struct batch_out {
    struct batch_out_spec spec; /* job_dir points at dir */
    char dir[4096];             /* OUT/<job> */
    int dir_held;               /* a shard of this writer's is recorded in dir: the job's
                                 * output is there (batch_job_dir_check need not run again) */
    struct oshard res, errs;    /* output shards */
    int64_t *live;              /* items held: claimed and not yet committed (for release) */
    size_t n_live, cap_live;    /* count, capacity */
    int64_t n_done, n_failed;   /* items committed */
    int64_t n_discarded;        /* records dropped at a commit: their lease was lost */
};

static void pend_free(struct pend *p)
{
    free(p->line);
    free(p->err_code);
    free(p->err_msg);
}

static void live_remove(struct batch_out *w, int64_t id)
{
    for (size_t i = 0; i < w->n_live; i++)
        if (w->live[i] == id) {
            w->live[i] = w->live[--w->n_live];
            return;
        }
}

/* 1 when the path fits */
static int shard_path(const struct batch_out *w, enum queue_shard_kind kind, int64_t seq,
                      char *path, size_t cap)
{
    return (size_t)snprintf(path, cap, "%s/%s-%05lld.jsonl.zst", w->dir,
                            kind == QUEUE_SHARD_RESULTS ? "results" : "errors",
                            (long long)seq) < cap;
}

/* The files this run's first shards will get must not be there yet: a queue older than its
 * output (restored from a backup, an idle copy, its -wal deleted after a kill) computed the
 * whole job and then failed at its first shard ("a file is already there"), every run again.
 * (A file that appears between the two reads of the next number is another run's new shard.) */
static enum status check_next_shards(const struct batch_out *w, struct err_detail *err)
{
    for (int k = 0; k < 2; k++) {
        enum queue_shard_kind kind = k ? QUEUE_SHARD_ERRORS : QUEUE_SHARD_RESULTS;
        int64_t seq = 0, again = 0;
        char path[4200];
        struct stat sb;
        enum status st = queue_shard_next_seq(w->spec.q, w->spec.job_id, kind, &seq, err);
        if (st)
            return st;
        if (!shard_path(w, kind, seq, path, sizeof(path)) || lstat(path, &sb))
            continue;
        if ((st = queue_shard_next_seq(w->spec.q, w->spec.job_id, kind, &again, err)))
            return st;
        if (again == seq)
            return err_set(err, ST_ERR_EXISTS,
                           "%s is there but the queue has no record of it: the queue is older "
                           "than the job's output (restored from a backup, a copy, or its -wal "
                           "deleted?); nothing was computed. (If this queue is the only one and "
                           "lost its last commits in a system crash, the file's items are still "
                           "queued: move the file away and run again.)",
                           path);
    }
    return ST_OK;
}

enum status batch_out_open(struct batch_out **out, const struct batch_out_spec *spec,
                           struct err_detail *err)
{
    *out = NULL;
    struct batch_out *w = calloc(1, sizeof(*w));
    if (!w)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    w->spec = *spec;
    if ((size_t)snprintf(w->dir, sizeof(w->dir), "%s", spec->job_dir) >= sizeof(w->dir)) {
        free(w);
        return err_set(err, ST_ERR_RANGE, "path too long: %.200s", spec->job_dir);
    }
    w->spec.job_dir = w->dir;
    w->res.kind = QUEUE_SHARD_RESULTS;
    w->errs.kind = QUEUE_SHARD_ERRORS;
    enum status st = check_next_shards(w, err);
    if (st) {
        free(w);
        return st;
    }
    *out = w;
    return ST_OK;
}

void batch_out_free(struct batch_out *w)
{
    if (!w)
        return;
    for (int k = 0; k < 2; k++) {
        struct oshard *s = k ? &w->errs : &w->res;
        io_shard_close(s->sh);
        for (size_t i = 0; i < s->n_pend; i++)
            pend_free(&s->pend[i]);
        free(s->pend);
    }
    free(w->live);
    free(w);
}

enum status batch_out_hold(struct batch_out *w, int64_t item_id, struct err_detail *err)
{
    if (w->n_live == w->cap_live) {
        size_t cap = w->cap_live ? w->cap_live * 2 : 256;
        int64_t *n = realloc(w->live, sizeof(*n) * cap);
        if (!n)
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        w->live = n;
        w->cap_live = cap;
    }
    w->live[w->n_live++] = item_id;
    return ST_OK;
}

int batch_out_holds(const struct batch_out *w, int64_t item_id)
{
    for (size_t i = 0; i < w->n_live; i++)
        if (w->live[i] == item_id)
            return 1;
    return 0;
}

void batch_out_drop(struct batch_out *w, int64_t item_id)
{
    live_remove(w, item_id);
}

void batch_out_get_counts(const struct batch_out *w, struct batch_out_counts *c)
{
    c->held = w->n_live;
    c->pending_results = w->res.n_pend;
    c->pending_errors = w->errs.n_pend;
    c->done = w->n_done;
    c->failed = w->n_failed;
    c->discarded = w->n_discarded;
}

/* Start the next shard of s's kind: its row first, then its file. */
static enum status shard_start(struct batch_out *w, struct oshard *s, struct err_detail *err)
{
    struct queue *q = w->spec.q;
    int64_t seq;
    enum status st;
    if ((st = queue_tx_begin(q, err)))
        return st;
    /* (in the transaction: another run cannot make the job's first shard elsewhere meanwhile) */
    if ((!w->dir_held && (st = batch_job_dir_check(q, w->spec.job_id, w->dir, err))) ||
        (st = queue_shard_next_seq(q, w->spec.job_id, s->kind, &seq, err)))
        goto fail;
    if (!shard_path(w, s->kind, seq, s->path, sizeof(s->path))) {
        st = err_set(err, ST_ERR_INVALID_ARG, "output path too long under %s", w->dir);
        goto fail;
    }
    if ((st = queue_shard_create(q, w->spec.run_id, w->spec.job_id, s->kind, seq, s->path, &s->id,
                                 err)) ||
        (st = queue_tx_commit(q, err)))
        goto fail;
    w->dir_held = 1;
    /* the row first, then the file, exclusively: a file already there is never overwritten;
     * the row is then closed empty at once, so an open row's file is always its run's own */
    if ((st = io_shard_create(&s->sh, s->path, 3, err)) == ST_ERR_EXISTS) {
        char sha[SHA256_HEX_LEN];
        struct err_detail e2 = {0};
        sha256_buf_hex("", 0, sha);
        if (queue_shard_close(q, w->spec.run_id, s->id, sha, &e2))
            LOG_WARN("closing shard row %lld: %s", (long long)s->id, e2.msg);
    }
    return st;
fail:
    queue_tx_rollback(q);
    return st;
}

/* Mark a shard closed with the sha256 of its committed bytes. A shard that never committed
 * anything (its run died or stopped before the first flush) is closed empty and its file
 * removed, so the output directory holds only shards with records (an open row's file was
 * created by its run, see shard_start; anything but a regular file is left alone). */
static enum status shard_seal(struct queue *q, int64_t run_id, int64_t id, const char *path,
                              uint64_t bytes, struct err_detail *err)
{
    char sha[SHA256_HEX_LEN];
    enum status st;
    if (bytes == 0) {
        struct stat sb;
        if (!lstat(path, &sb) && S_ISREG(sb.st_mode) && unlink(path) && errno != ENOENT)
            return err_set(err, ST_ERR_IO, "cannot remove empty shard %s: %s", path,
                           strerror(errno));
        sha256_buf_hex("", 0, sha);
        st = ST_OK;
    } else {
        st = sha256_file(path, bytes, sha, err);
    }
    if (!st)
        st = queue_shard_close(q, run_id, id, sha, err);
    return st;
}

/* Close the shard: hash its committed bytes and mark it closed in the queue. */
static enum status shard_finish(struct batch_out *w, struct oshard *s, struct err_detail *err)
{
    if (!s->sh)
        return ST_OK;
    uint64_t bytes = io_shard_committed_bytes(s->sh);
    io_shard_close(s->sh);
    s->sh = NULL;
    return shard_seal(w->spec.q, w->spec.run_id, s->id, s->path, bytes, err);
}

static enum status shard_append(struct batch_out *w, struct oshard *s, int64_t item, char *line,
                                const char *code, const char *msg, int64_t ptok, int64_t ctok,
                                double ttft, double tpot, struct err_detail *err)
{
    enum status st;
    if (!line)
        return err_set(err, ST_ERR_NOMEM, "out of memory building a record");
    if (!s->sh && (st = shard_start(w, s, err))) {
        free(line);
        return st;
    }
    if (s->n_pend == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        struct pend *n = realloc(s->pend, sizeof(*n) * cap);
        if (!n) {
            free(line);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        s->pend = n;
        s->cap = cap;
    }
    if ((st = io_shard_append(s->sh, line, strlen(line), err))) {
        free(line);
        return st;
    }
    struct pend *p = &s->pend[s->n_pend++];
    p->item_id = item;
    p->line = line;
    p->err_code = code ? strdup(code) : NULL;
    p->err_msg = msg ? strdup(msg) : NULL;
    p->ptok = ptok;
    p->ctok = ctok;
    p->ttft = ttft;
    p->tpot = tpot;
    return ST_OK;
}

enum status batch_out_result(struct batch_out *w, int64_t item_id, char *line,
                             int64_t prompt_tokens, int64_t completion_tokens, double ttft_ms,
                             double tpot_ms, struct err_detail *err)
{
    return shard_append(w, &w->res, item_id, line, NULL, NULL, prompt_tokens, completion_tokens,
                        ttft_ms, tpot_ms, err);
}

enum status batch_out_error(struct batch_out *w, int64_t item_id, char *line, const char *code,
                            const char *msg, struct err_detail *err)
{
    return shard_append(w, &w->errs, item_id, line, code, msg, 0, 0, -1, -1, err);
}

/* Flush + commit the shard's pending records. If the queue refuses some items (re-claimed
 * by another run after our lease expired, or cancelled), the file is cut back to its
 * committed length and only the others are written again. If the shard itself is no longer
 * ours (another run took this one for dead and adopted it), the shard ends here: its file is
 * cut back to what we committed, and the records go to a new shard. A commit that still
 * fails after that is an error: nothing is ever reported committed that is not. */
static enum status shard_commit(struct batch_out *w, struct oshard *s, struct err_detail *err)
{
    enum status st = ST_OK;
    for (int attempt = 0; s->n_pend; attempt++) {
        if (attempt == 4)
            return err_set(err, ST_ERR_CONFLICT, "%s: could not commit %zu records (%s)", s->path,
                           s->n_pend, err->msg);
        uint64_t old = io_shard_committed_bytes(s->sh), bytes, records;
        struct queue_done *done = calloc(s->n_pend, sizeof(*done));
        bool *lost = calloc(s->n_pend, sizeof(*lost));
        if (!done || !lost) {
            free(done);
            free(lost);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        for (size_t i = 0; i < s->n_pend; i++) {
            done[i].item_id = s->pend[i].item_id;
            done[i].error_code = s->pend[i].err_code;
            done[i].error_msg = s->pend[i].err_msg;
            done[i].prompt_tokens = s->pend[i].ptok;
            done[i].completion_tokens = s->pend[i].ctok;
            done[i].ttft_ms = s->pend[i].ttft;
            done[i].tpot_ms = s->pend[i].tpot;
        }
        st = io_shard_flush(s->sh, &bytes, &records, err);
        if (!st)
            st = queue_commit_shard(w->spec.q, w->spec.run_id, s->id, bytes, records, done,
                                    s->n_pend, lost, err);
        free(done);
        if (st == ST_OK) {
            for (size_t i = 0; i < s->n_pend; i++) {
                live_remove(w, s->pend[i].item_id);
                if (s->kind == QUEUE_SHARD_RESULTS)
                    w->n_done++;
                else
                    w->n_failed++;
                pend_free(&s->pend[i]);
            }
            s->n_pend = 0;
            free(lost);
            break;
        }
        if (st != ST_ERR_CONFLICT) {
            free(lost);
            return st;
        }
        size_t n_lost = 0;
        for (size_t i = 0; i < s->n_pend; i++)
            n_lost += lost[i];
        w->n_discarded += (int64_t)n_lost;
        struct err_detail e2 = {0};
        if (n_lost == 0) { /* the shard is not ours any more */
            LOG_WARN("%s: %s; ending this shard and writing its %zu pending records to a new one",
                     s->path, err->msg, s->n_pend);
            st = io_shard_abandon(s->sh, old, &e2);
            s->sh = NULL;
            if (st) {
                free(lost);
                return err_set(err, st, "%s", e2.msg);
            }
            if ((st = shard_start(w, s, err))) {
                free(lost);
                return st;
            }
        } else { /* drop the lost records: reopen at the committed length, rewrite the rest */
            LOG_WARN("%s: %zu items were taken over by another run or cancelled; rewriting",
                     s->path, n_lost);
            io_shard_close(s->sh);
            s->sh = NULL;
            if ((st = io_shard_open(&s->sh, s->path, old, 3, err))) {
                free(lost);
                return st;
            }
        }
        size_t k = 0;
        for (size_t i = 0; i < s->n_pend; i++) {
            if (lost[i]) {
                live_remove(w, s->pend[i].item_id);
                pend_free(&s->pend[i]);
                continue;
            }
            s->pend[k++] = s->pend[i];
        }
        s->n_pend = k;
        free(lost);
        for (size_t i = 0; i < s->n_pend && !st; i++)
            st = io_shard_append(s->sh, s->pend[i].line, strlen(s->pend[i].line), err);
        if (st)
            return st;
    }
    /* rotate */
    if (s->sh && (io_shard_committed_bytes(s->sh) >= w->spec.shard_bytes ||
                  io_shard_records_total(s->sh) >= w->spec.shard_records))
        st = shard_finish(w, s, err);
    return st;
}

enum status batch_out_commit(struct batch_out *w, struct err_detail *err)
{
    enum status st = shard_commit(w, &w->res, err);
    if (!st)
        st = shard_commit(w, &w->errs, err);
    return st;
}

enum status batch_out_release(struct batch_out *w, int64_t *released, struct err_detail *err)
{
    if (released)
        *released = 0;
    if (!w->n_live)
        return ST_OK;
    enum status st = queue_release(w->spec.q, w->spec.run_id, w->live, w->n_live, released, err);
    if (!st)
        w->n_live = 0;
    return st;
}

enum status batch_out_close(struct batch_out *w, struct err_detail *err)
{
    enum status st = shard_finish(w, &w->res, err);
    if (!st)
        st = shard_finish(w, &w->errs, err);
    return st;
}

/* ---- recovery ---- */

/* A dead run's open shard is cut back to what this queue says was committed; but when the
 * job's manifest lists the file closed with more bytes, another copy of the queue committed
 * them (this one is a backup or a copy that ran behind it): cutting would destroy records
 * that copy counts done. */
static enum status check_manifest_bytes(const char *path, uint64_t committed,
                                        struct err_detail *err)
{
    char man[4200];
    const char *slash = strrchr(path, '/');
    if (!slash)
        return ST_OK;
    snprintf(man, sizeof(man), "%.*s/manifest.json", (int)(slash - path), path);
    cJSON *m = batch_json_file(man);
    const cJSON *e;
    uint64_t listed = 0;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(m, "shards"))
    {
        const cJSON *f = cJSON_GetObjectItem(e, "file"), *b = cJSON_GetObjectItem(e, "bytes");
        if (cJSON_IsString(f) && cJSON_IsNumber(b) && !strcmp(f->valuestring, slash + 1))
            listed = (uint64_t)b->valuedouble;
    }
    cJSON_Delete(m);
    if (listed <= committed)
        return ST_OK;
    return err_set(err, ST_ERR_CONFLICT,
                   "%s: the job's manifest lists it closed with %llu bytes, this queue only %llu "
                   "committed: another copy of the queue went on with this job (this one is a "
                   "backup or a copy); left as it is",
                   path, (unsigned long long)listed, (unsigned long long)committed);
}

enum status batch_recover_shards(struct queue *q, int64_t job_id, int64_t run_id, int64_t stale_ms,
                                 struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    enum status st = queue_shard_list(q, job_id, &sh, &n, err);
    for (size_t i = 0; !st && i < n; i++) {
        if (sh[i].state != QUEUE_SHARD_OPEN || sh[i].run_id == run_id)
            continue;
        char path[4096];
        if ((st = queue_resolve_path(q, sh[i].path, path, sizeof(path), err)))
            break;
        if (io_shard_locked(path) == 1) {
            LOG_INFO("%s: still written by run %lld (its file is locked); left open", path,
                     (long long)sh[i].run_id);
            continue;
        }
        struct err_detail e2 = {0};
        if (queue_shard_adopt(q, sh[i].id, run_id, stale_ms, &e2))
            continue;                /* a live run still writes it */
        if ((st = check_manifest_bytes(path, sh[i].committed_bytes, err)))
            break;
        if (sh[i].committed_bytes) { /* cut the uncommitted tail */
            struct io_shard *w;
            if ((st = io_shard_open(&w, path, sh[i].committed_bytes, 3, err)))
                break;
            io_shard_close(w);
        }
        st = shard_seal(q, run_id, sh[i].id, path, sh[i].committed_bytes, err);
        LOG_INFO("recovered shard %s at %llu committed bytes", path,
                 (unsigned long long)sh[i].committed_bytes);
    }
    queue_shard_list_free(sh, n);
    return st;
}

enum status batch_count_open_shards(struct queue *q, int64_t job_id, int64_t *open,
                                    struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    enum status st = queue_shard_list(q, job_id, &sh, &n, err);
    *open = 0;
    for (size_t i = 0; !st && i < n; i++)
        *open += sh[i].state == QUEUE_SHARD_OPEN;
    queue_shard_list_free(sh, n);
    return st;
}
