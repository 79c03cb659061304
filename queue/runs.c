/* Runs: start, check, end, heartbeat and progress, the list of live runs, and reaping runs whose
 * process is dead on this host (their leases go back to queued). */
#include "queue/queue_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- runs ------------------------------------------------------------------------------ */

enum status queue_run_start(struct queue *q, const struct queue_run_spec *spec, int64_t *run_id,
                            struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *run_id = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_INSERT, err);
    if (!s)
        return err->status;
    if (spec->job_id)
        sqlite3_bind_int64(s, 1, spec->job_id);
    else
        sqlite3_bind_null(s, 1);
    queue_bind_str(s, 2, spec->worker_id);
    queue_bind_str(s, 3, spec->host);
    sqlite3_bind_int64(s, 4, spec->pid);
    sqlite3_bind_int64(s, 5, queue_now(q));
    queue_bind_str(s, 6, spec->boot_id);
    queue_bind_str(s, 7, spec->pid_ns);
    if (spec->pstart > 0)
        sqlite3_bind_int64(s, 8, spec->pstart);
    else
        sqlite3_bind_null(s, 8);
    queue_bind_str(s, 9, spec->submit ? "submit" : "run");
    enum status st = queue_step_done(q, s, "recording a run", err);
    if (st == ST_OK && sqlite3_changes(q->db) == 0) { /* the job is missing or not ready */
        enum queue_job_state js;
        st = queue_job_state_get(q, spec->job_id, &js, err);
        if (st == ST_OK)
            st = err_set(err, ST_ERR_INVALID_ARG,
                         "run for job %lld: the job is still being submitted",
                         (long long)spec->job_id);
        else if (st == ST_ERR_NOT_FOUND)
            err_set(err, st, "run for job %lld: no such job", (long long)spec->job_id);
        return st;
    }
    if (st == ST_OK)
        *run_id = sqlite3_last_insert_rowid(q->db);
    return st;
}

enum status queue_run_check(struct queue *q, int64_t run_id, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_ENDED, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    int rc = sqlite3_step(s);
    enum status st = ST_OK;
    if (rc == SQLITE_ROW) {
        if (sqlite3_column_int(s, 0))
            st = err_set(err, ST_ERR_INVALID_ARG, "run %lld has ended", (long long)run_id);
    } else if (rc == SQLITE_DONE) {
        st = err_set(err, ST_ERR_INVALID_ARG, "no run with id %lld", (long long)run_id);
    } else {
        st = queue_sql_err(q, rc, "reading a run", err);
    }
    queue_stmt_done(s);
    return st;
}

enum status queue_run_end(struct queue *q, int64_t run_id, const char *exit_reason,
                          const char *summary_json, int64_t *n_requeued, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_requeued)
        *n_requeued = 0;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t requeued = 0;
    st = queue_run_check(q, run_id, err);
    sqlite3_stmt *s = NULL;
    if (st == ST_OK && (s = queue_stmt(q, QS_LEASE_REQUEUE_RUN, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, run_id);
        st = queue_step_done(q, s, "requeueing the run's leases", err);
        requeued = sqlite3_changes(q->db);
    }
    if (st == ST_OK && (s = queue_stmt(q, QS_RUN_END, err)) == NULL)
        st = err->status;
    if (st == ST_OK) {
        sqlite3_bind_int64(s, 1, run_id);
        sqlite3_bind_int64(s, 2, queue_now(q));
        queue_bind_str(s, 3, exit_reason);
        queue_bind_str(s, 4, summary_json);
        st = queue_step_done(q, s, "ending the run", err);
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_requeued)
        *n_requeued = requeued;
    return st;
}

enum status queue_run_mark_ended(struct queue *q, int64_t run_id, const char *exit_reason,
                                 const char *summary_json, struct err_detail *err)
{
    if (!run_id)
        return ST_OK;
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_END, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    sqlite3_bind_int64(s, 2, queue_now(q));
    queue_bind_str(s, 3, exit_reason);
    queue_bind_str(s, 4, summary_json);
    return queue_step_done(q, s, "ending a run", err);
}

/* End one run found dead: its leases go back to queued (attempts kept; less one if it had begun
 * to stop: killed in its grace), ended = its last heartbeat (when it last showed life). */
static enum status end_dead_run(struct queue *q, int64_t run_id, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, QS_LEASE_REQUEUE_RUN, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    enum status st = queue_step_done(q, s, "requeueing a dead run's leases", err);
    if (st != ST_OK || !(s = queue_stmt(q, QS_RUN_END_DEAD, err)))
        return st != ST_OK ? st : err->status;
    sqlite3_bind_int64(s, 1, run_id);
    return queue_step_done(q, s, "ending a dead run", err);
}

/* A run's process identity from the columns of row s that hold its host, boot id, PID
 * namespace, PID and start ticks. */
static void run_identity(sqlite3_stmt *s, int host, int boot, int ns, int pid, int start,
                         struct proc_identity *id)
{
    memset(id, 0, sizeof(*id));
    const unsigned char *t;
    if ((t = sqlite3_column_text(s, host)))
        snprintf(id->host, sizeof(id->host), "%s", (const char *)t);
    if ((t = sqlite3_column_text(s, boot)))
        snprintf(id->boot_id, sizeof(id->boot_id), "%s", (const char *)t);
    if ((t = sqlite3_column_text(s, ns)))
        snprintf(id->pid_ns, sizeof(id->pid_ns), "%s", (const char *)t);
    id->pid = sqlite3_column_int64(s, pid);
    id->start_ticks = sqlite3_column_int64(s, start);
}

enum status queue_reap_dead(struct queue *q, const struct proc_identity *self, int64_t *n_reaped,
                            struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    if (n_reaped)
        *n_reaped = 0;
    if (!self->host[0])
        return ST_OK;
    struct queue_scope sc;
    enum status st = queue_scope_enter(q, &sc, err);
    if (st != ST_OK)
        return st;
    int64_t dead[64];
    size_t n_dead = 0;
    int64_t total = 0;
    bool more = true;
    while (st == ST_OK && more) { /* batches of 64: ids are collected before any update */
        more = false;
        n_dead = 0;
        /* an exclusive file (a part) is used by one process at a time, the one holding it: a
         * run of another host that has not ended is dead as well */
        sqlite3_stmt *s = queue_stmt(q, QS_RUN_ACTIVE, err);
        if (!s) {
            st = err->status;
            break;
        }
        if (!q->exclusive)
            queue_bind_str(s, 1, self->host);
        int rc;
        while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
            struct proc_identity other;
            run_identity(s, 1, 2, 3, 4, 5, &other);
            if (strcmp(other.host, self->host) == 0 ? proc_liveness(self, &other) != PROC_DEAD
                                                    : !q->exclusive)
                continue;
            if (n_dead == sizeof(dead) / sizeof(dead[0])) {
                more = true;
                break;
            }
            dead[n_dead++] = sqlite3_column_int64(s, 0);
        }
        if (rc != SQLITE_ROW && rc != SQLITE_DONE)
            st = queue_sql_err(q, rc, "listing active runs", err);
        queue_stmt_done(s);
        for (size_t i = 0; st == ST_OK && i < n_dead; i++)
            st = end_dead_run(q, dead[i], err);
        total += (int64_t)n_dead;
    }
    st = queue_scope_leave(q, &sc, st, err);
    if (st == ST_OK && n_reaped)
        *n_reaped = total;
    return st;
}

/* Heartbeat (with progress_json when id is QS_RUN_PROGRESS); a run that has ended or is missing
 * is an error, see queue_run_heartbeat. */
static enum status run_touch(struct queue *q, enum queue_stmt_id id, int64_t run_id,
                             const char *progress_json, struct err_detail *err)
{
    sqlite3_stmt *s = queue_stmt(q, id, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    sqlite3_bind_int64(s, 2, queue_now(q));
    if (id == QS_RUN_PROGRESS)
        queue_bind_str(s, 3, progress_json);
    enum status st = queue_step_done(
        q, s, id == QS_RUN_STOPPING ? "recording the run's stop" : "heartbeat", err);
    if (st != ST_OK || sqlite3_changes(q->db) > 0)
        return st;
    /* no row changed: the run is missing, or it has ended */
    if ((s = queue_stmt(q, QS_RUN_ENDED, err)) == NULL)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    int rc = sqlite3_step(s);
    if (rc == SQLITE_ROW)
        st = err_set(err, ST_ERR_CONFLICT, "run %lld has ended (another process took it for dead)",
                     (long long)run_id);
    else if (rc == SQLITE_DONE)
        st = err_set(err, ST_ERR_INVALID_ARG, "no run with id %lld", (long long)run_id);
    else
        st = queue_sql_err(q, rc, "reading a run", err);
    queue_stmt_done(s);
    return st;
}

enum status queue_run_heartbeat(struct queue *q, int64_t run_id, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    return run_touch(q, QS_RUN_HEARTBEAT, run_id, NULL, err);
}

enum status queue_run_stopping(struct queue *q, int64_t run_id, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    static const volatile sig_atomic_t now = 1; /* no wait for a lock */
    const volatile sig_atomic_t *saved = q->interrupt;
    q->interrupt = &now;
    enum status st = run_touch(q, QS_RUN_STOPPING, run_id, NULL, err);
    q->interrupt = saved;
    return st;
}

enum status queue_run_progress(struct queue *q, int64_t run_id, const char *progress_json,
                               struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    return run_touch(q, QS_RUN_PROGRESS, run_id, progress_json, err);
}

/* The array a (cnt used of *cap elements of elem bytes) with room for one more: itself, or
 * grown by doubling; NULL when out of memory (a is left as it was). */
static void *room_for_one(void *a, size_t cnt, size_t *cap, size_t elem)
{
    if (cnt < *cap)
        return a;
    size_t nc = *cap ? *cap * 2 : 8;
    void *na = realloc(a, elem * nc);
    if (na)
        *cap = nc;
    return na;
}

enum status queue_run_set_engine(struct queue *q, int64_t run_id, const char *engine_json,
                                 struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    sqlite3_stmt *s = queue_stmt(q, QS_RUN_ENGINE, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, run_id);
    queue_bind_str(s, 2, engine_json);
    enum status st = queue_step_done(q, s, "recording the run's engine", err);
    if (st == ST_OK && sqlite3_changes(q->db) == 0)
        st = err_set(err, ST_ERR_INVALID_ARG, "no run with id %lld", (long long)run_id);
    return st;
}

void queue_writers_free(struct queue_writer *w, size_t n)
{
    for (size_t i = 0; w && i < n; i++) {
        free(w[i].host);
        free(w[i].engine_json);
    }
    free(w);
}

enum status queue_job_writers(struct queue *q, int64_t job_id, struct queue_writer **w, size_t *n,
                              struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *w = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_JOB_WRITERS, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    struct queue_writer *a = NULL;
    size_t cnt = 0, cap = 0;
    enum status st = ST_OK;
    int rc = SQLITE_DONE;
    while (st == ST_OK && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        struct queue_writer *na = room_for_one(a, cnt, &cap, sizeof(*a));
        if (!na) {
            st = err_set(err, ST_ERR_NOMEM, "out of memory listing a job's writers");
            break;
        }
        a = na;
        struct queue_writer *r = &a[cnt++];
        memset(r, 0, sizeof(*r));
        r->shard_id = sqlite3_column_int64(s, 0);
        r->run_id = sqlite3_column_int64(s, 1);
        r->records = (uint64_t)sqlite3_column_int64(s, 2);
        if ((st = queue_col_dup(s, 3, &r->host, err)) == ST_OK)
            st = queue_col_dup(s, 4, &r->engine_json, err);
    }
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "listing a job's writers", err);
    queue_stmt_done(s);
    if (st != ST_OK) {
        queue_writers_free(a, cnt);
        return st;
    }
    *w = a;
    *n = cnt;
    return ST_OK;
}

void queue_run_info_free(struct queue_run_info *runs, size_t n)
{
    for (size_t i = 0; runs && i < n; i++) {
        free(runs[i].worker_id);
        free(runs[i].host);
        free(runs[i].progress_json);
        free(runs[i].exit_reason);
        free(runs[i].engine_json);
    }
    free(runs);
}

/* The runs statement `which` lists (bound to job_id), into *runs. */
static enum status list_runs(struct queue *q, enum queue_stmt_id which, int64_t job_id,
                             struct queue_run_info **runs, size_t *n, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *runs = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, which, err);
    if (!s)
        return err->status;
    if (which == QS_RUN_LIST_JOB)
        sqlite3_bind_int64(s, 1, job_id);
    int64_t now = queue_now(q);
    struct proc_identity self;
    proc_identity_self(&self);
    struct queue_run_info *a = NULL;
    size_t cnt = 0, cap = 0;
    enum status st = ST_OK;
    int rc = SQLITE_DONE;
    while (st == ST_OK && (rc = sqlite3_step(s)) == SQLITE_ROW) {
        struct queue_run_info *na = room_for_one(a, cnt, &cap, sizeof(*a));
        if (!na) {
            st = err_set(err, ST_ERR_NOMEM, "out of memory listing runs");
            break;
        }
        a = na;
        struct queue_run_info *r = &a[cnt++];
        memset(r, 0, sizeof(*r));
        r->id = sqlite3_column_int64(s, 0);
        r->job_id = sqlite3_column_int64(s, 1);
        r->pid = sqlite3_column_int64(s, 4);
        r->started_ms = sqlite3_column_int64(s, 5);
        r->heartbeat_ms = sqlite3_column_int64(s, 6);
        r->age_ms = now > r->heartbeat_ms ? now - r->heartbeat_ms : 0;
        r->ended_ms = sqlite3_column_int64(s, 8);
        r->worked = sqlite3_column_int(s, 11);
        if (!r->ended_ms) {
            struct proc_identity other;
            run_identity(s, 3, 12, 13, 4, 14, &other);
            r->gone = self.host[0] && !strcmp(other.host, self.host) &&
                      proc_liveness(&self, &other) == PROC_DEAD;
        }
        if ((st = queue_col_dup(s, 2, &r->worker_id, err)) == ST_OK &&
            (st = queue_col_dup(s, 3, &r->host, err)) == ST_OK &&
            (st = queue_col_dup(s, 7, &r->progress_json, err)) == ST_OK &&
            (st = queue_col_dup(s, 9, &r->exit_reason, err)) == ST_OK)
            st = queue_col_dup(s, 10, &r->engine_json, err);
    }
    if (st == ST_OK && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "listing runs", err);
    queue_stmt_done(s);
    if (st != ST_OK) {
        queue_run_info_free(a, cnt);
        return st;
    }
    *runs = a;
    *n = cnt;
    return ST_OK;
}

enum status queue_run_list_live(struct queue *q, struct queue_run_info **runs, size_t *n,
                                struct err_detail *err)
{
    return list_runs(q, QS_RUN_LIST_LIVE, 0, runs, n, err);
}

enum status queue_run_last_ended(struct queue *q, struct queue_run_info **runs, size_t *n,
                                 struct err_detail *err)
{
    return list_runs(q, QS_RUN_LAST_ENDED, 0, runs, n, err);
}

enum status queue_run_list_job(struct queue *q, int64_t job_id, struct queue_run_info **runs,
                               size_t *n, struct err_detail *err)
{
    return list_runs(q, QS_RUN_LIST_JOB, job_id, runs, n, err);
}

/* ---- samples ---- */

static const char *const SAMPLE_FIELDS[QUEUE_SAMPLE_FIELDS] = {
    "done",    "failed",  "gen_tokens", "prompt_tokens", "cached_tokens",
    "running", "waiting", "kv_used",    "kv_total",      "steps",
    "batch_tokens", "spec_drafted", "spec_accepted",
};

const char *queue_sample_field_name(int f)
{
    return f >= 0 && f < QUEUE_SAMPLE_FIELDS ? SAMPLE_FIELDS[f] : NULL;
}

enum status queue_sample_add(struct queue *q, const struct queue_sample *smp,
                             struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    sqlite3_stmt *s = queue_stmt(q, QS_SAMPLE_ADD, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, smp->run_id);
    sqlite3_bind_int64(s, 2, smp->job_id);
    sqlite3_bind_int64(s, 3, smp->t_ms ? smp->t_ms : queue_now(q));
    for (int f = 0; f < QUEUE_SAMPLE_FIELDS; f++)
        sqlite3_bind_int64(s, 4 + f, smp->v[f]);
    return queue_step_done(q, s, "recording a sample", err);
}

enum status queue_sample_list(struct queue *q, int64_t job_id, struct queue_sample **out,
                              size_t *n, struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    *out = NULL;
    *n = 0;
    sqlite3_stmt *s = queue_stmt(q, QS_SAMPLE_LIST, err);
    if (!s)
        return err->status;
    sqlite3_bind_int64(s, 1, job_id);
    size_t cap = 0;
    enum status st = ST_OK;
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
        if (*n == cap) {
            size_t ncap = cap ? cap * 2 : 64;
            struct queue_sample *t = realloc(*out, ncap * sizeof(*t));
            if (!t) {
                st = err_set(err, ST_ERR_NOMEM, "out of memory");
                break;
            }
            *out = t;
            cap = ncap;
        }
        struct queue_sample *smp = &(*out)[(*n)++];
        smp->run_id = sqlite3_column_int64(s, 0);
        smp->job_id = sqlite3_column_int64(s, 1);
        smp->t_ms = sqlite3_column_int64(s, 2);
        for (int f = 0; f < QUEUE_SAMPLE_FIELDS; f++)
            smp->v[f] = sqlite3_column_int64(s, 3 + f);
    }
    if (!st && rc != SQLITE_DONE)
        st = queue_sql_err(q, rc, "reading samples", err);
    queue_stmt_done(s);
    if (st) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
    return st;
}
