/* Output directories of jobs: location, ownership marker and manifest (see batch/batch.h). */
#include "batch/batch.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "io/manifest.h"
#include "io/shard.h"
#include "jobs/json.h"

enum status batch_abspath(const char *p, char *out, size_t cap, struct err_detail *err)
{
    char cwd[4096];
    int n;
    if (p[0] == '/')
        n = snprintf(out, cap, "%s", p);
    else if (getcwd(cwd, sizeof(cwd)))
        n = snprintf(out, cap, "%s/%s", cwd, p);
    else
        return err_set(err, ST_ERR_IO, "getcwd: %s", strerror(errno));
    if (n < 0 || (size_t)n >= cap)
        return err_set(err, ST_ERR_RANGE, "path too long: %.200s", p);
    while (n > 1 && out[n - 1] == '/')
        out[--n] = 0;
    return ST_OK;
}

/* mkdir -p for an absolute or relative path. */
static enum status mkdirs(const char *path, struct err_detail *err)
{
    char buf[4096];
    if (snprintf(buf, sizeof(buf), "%s", path) >= (int)sizeof(buf))
        return err_set(err, ST_ERR_RANGE, "path too long: %.200s", path);
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p != 0)
            continue;
        char c = *p;
        *p = 0;
        if (mkdir(buf, 0777) && errno != EEXIST)
            return err_set(err, ST_ERR_IO, "cannot create %s: %s", buf, strerror(errno));
        *p = c;
        if (!c)
            break;
    }
    struct stat sb;
    if (stat(path, &sb) || !S_ISDIR(sb.st_mode))
        return err_set(err, ST_ERR_IO, "%s is not a directory", path);
    return ST_OK;
}

/* Do a and b name the same existing directory? (device and inode) */
static int same_dir(const char *a, const char *b)
{
    struct stat sa, sb;
    if (stat(a, &sa) || stat(b, &sb))
        return strcmp(a, b) == 0;
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

static int marker_matches(const char *text, const char *uuid, int64_t job_id, char *owner,
                          size_t cap, char *db_path, size_t db_cap);

/* The marker at path into text (cap bytes, NUL-terminated): 1 read, 0 none (errno says why). */
static int read_marker(const char *path, char *text, size_t cap)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, text, cap - 1);
    close(fd);
    text[n > 0 ? n : 0] = 0;
    return 1;
}

/* Does dir hold this database's marker for job (a run has claimed it for its output)? */
static int dir_claimed(struct queue *q, const struct queue_job *job, const char *dir)
{
    char uuid[33], path[4300], text[4096], owner[1024];
    snprintf(path, sizeof(path), "%s/%s", dir, BATCH_MARKER_NAME);
    return read_marker(path, text, sizeof(text)) && !queue_db_uuid(q, uuid, NULL) &&
           marker_matches(text, uuid, job->id, owner, sizeof(owner), NULL, 0);
}

enum status batch_shard_path(struct queue *q, const struct queue_shard *sh, char *out, size_t cap,
                             struct err_detail *err)
{
    const char *stored = sh->path;
    enum status st = queue_resolve_path(q, stored, out, cap, err);
    struct stat sb;
    if (st || stored[0] == '/' || lstat(out, &sb) == 0 || errno != ENOENT)
        return st;
    /* under the working directory: a regular file holding at least what was committed (a
     * same-named shard of another job there is not taken for it) */
    if (lstat(stored, &sb) || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size < sh->committed_bytes)
        return ST_OK;
    char cwd[4096];
    if (!getcwd(cwd, sizeof(cwd)))
        snprintf(cwd, sizeof(cwd), ".");
    const char *slash = strrchr(stored, '/'), *oslash = strrchr(out, '/');
    int dl = slash ? (int)(slash - stored) : 0, ol = oslash ? (int)(oslash - out) : 0;
    return err_set(err, ST_ERR_NOT_FOUND,
                   "shard %s is not where the queue says (%s) but under the working directory "
                   "%s: a quern from before 2026-12-01 stored the job's paths relative to the "
                   "directory it ran in, and they are read relative to the queue's directory; "
                   "move %s/%.*s to %.*s, then try again",
                   stored, out, cwd, cwd, dl, stored, ol, out);
}

/* The directory of job_id's first shard into dir (cap bytes), "" when it has none. */
static enum status shards_dir(struct queue *q, int64_t job_id, char *dir, size_t cap,
                              struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    enum status st = queue_shard_list(q, job_id, &sh, &n, err);
    dir[0] = 0;
    if (st)
        return st;
    if (n) {
        st = batch_shard_path(q, &sh[0], dir, cap, err);
        char *slash = strrchr(dir, '/');
        if (!st && slash)
            *slash = 0;
    }
    queue_shard_list_free(sh, n);
    return st;
}

enum status batch_job_dir_check(struct queue *q, int64_t job_id, const char *dir,
                                struct err_detail *err)
{
    char have[4096];
    enum status st = shards_dir(q, job_id, have, sizeof(have), err);
    if (!st && have[0] && !same_dir(have, dir))
        st = err_set(err, ST_ERR_CONFLICT,
                     "job %lld writes its output in %s (a run started at the same time made its "
                     "first shard there); this run's %s would split it across directories, so "
                     "it stops here and gives its items back: a run without --out continues the "
                     "job where its shards are",
                     (long long)job_id, have, dir);
    return st;
}

enum status batch_job_dir(struct queue *q, const struct queue_job *job, const char *out_flag,
                          int create, char *dir, size_t cap, struct err_detail *err)
{
    char root[4096], shard_dir[4096] = "";
    enum status st;
    if ((st = shards_dir(q, job->id, shard_dir, sizeof(shard_dir), err)))
        return st;
    int part, parts; /* a part writes OUT/<job>/part-NNNN (batch/parts.c) */
    if ((st = batch_parts_which(q, &part, &parts, err)))
        return st;
    char sub[32] = "", tail[300];
    if (parts)
        snprintf(sub, sizeof(sub), "/part-%04d", part);
    snprintf(tail, sizeof(tail), "/%s%s", job->name, sub);
    const size_t sl = strlen(shard_dir), tl = strlen(tail);
    char stored[4096] = "";
    if (out_flag) {
        st = batch_abspath(out_flag, root, sizeof(root), err);
    } else if (sl > tl && !strcmp(shard_dir + sl - tl, tail)) {
        /* the job's output is where its shards are, whatever out_dir says (a run with another
         * --out that lost the race for the first shard may have recorded its own) */
        snprintf(root, sizeof(root), "%.*s", (int)(sl - tl), shard_dir);
        st = queue_resolve_path(q, job->out_dir, stored, sizeof(stored), err);
    } else {
        st = queue_resolve_path(q, job->out_dir, root, sizeof(root), err);
    }
    if (st)
        return st;
    int len = snprintf(dir, cap, "%s/%s%s", root, job->name, sub);
    if (len < 0 || (size_t)len + 64 >= cap)
        return err_set(err, ST_ERR_RANGE, "output path too long under %.200s", root);
    if (shard_dir[0] && !same_dir(shard_dir, dir))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "job '%s' writes its output in %s; %s would split it across directories "
                       "(run without --out, or with the directory that holds %s)",
                       job->name, shard_dir, dir, job->name);
    if (out_flag && !shard_dir[0]) { /* first output: it goes where --out says ... */
        char claimed[4200];
        if ((st = queue_resolve_path(q, job->out_dir, stored, sizeof(stored), err)))
            return st;
        /* ... unless a run working on the job now (it holds items) has started it in the
         * recorded place, its first shard not made yet: the job is never split */
        snprintf(claimed, sizeof(claimed), "%s/%s%s", stored, job->name, sub);
        int64_t leased = 0;
        if (!same_dir(claimed, dir) && dir_claimed(q, job, claimed) &&
            !queue_job_unfinished(q, job->id, NULL, &leased, NULL) && leased > 0)
            return err_set(err, ST_ERR_INVALID_ARG,
                           "job '%s' is being written in %s by a run working on it now; %s "
                           "would split it across directories (run without --out, or with %s)",
                           job->name, claimed, dir, stored);
    }
    if (create && (st = mkdirs(dir, err)))
        return st;
    /* (a plain run records where the shards are; status, opened read-only, only reads) */
    if (stored[0] && strcmp(stored, root) && (out_flag || create) &&
        (st = queue_job_set_out_dir(q, job->id, root, err)))
        return st;
    return create ? batch_outdir_claim(q, job, dir, err) : ST_OK;
}

/* Does the marker text name this database and job? Its owner described in owner, and its
 * database's path in db_path ("" if none; db_path may be NULL). */
static int marker_matches(const char *text, const char *uuid, int64_t job_id, char *owner,
                          size_t cap, char *db_path, size_t db_cap)
{
    cJSON *m = cJSON_Parse(text);
    const cJSON *u = cJSON_GetObjectItem(m, "db_uuid"), *j = cJSON_GetObjectItem(m, "job_id");
    const cJSON *nm = cJSON_GetObjectItem(m, "job_name"), *db = cJSON_GetObjectItem(m, "database");
    int ok = cJSON_IsString(u) && cJSON_IsNumber(j) && !strcmp(u->valuestring, uuid) &&
             (int64_t)j->valuedouble == job_id;
    snprintf(owner, cap, "job '%s' (id %lld) of database %s (uuid %s)",
             cJSON_IsString(nm) ? nm->valuestring : "?",
             cJSON_IsNumber(j) ? (long long)j->valuedouble : -1LL,
             cJSON_IsString(db) ? db->valuestring : "?", cJSON_IsString(u) ? u->valuestring : "?");
    if (db_path)
        snprintf(db_path, db_cap, "%s", cJSON_IsString(db) ? db->valuestring : "");
    cJSON_Delete(m);
    return ok;
}

int batch_outdir_owner(const char *dir, char *owner, size_t cap, char *db, size_t db_cap)
{
    char path[4300], text[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, BATCH_MARKER_NAME);
    if (!read_marker(path, text, sizeof(text)))
        return 0;
    marker_matches(text, "", -1, owner, cap, db, db_cap);
    return 1;
}

enum status batch_outdir_claim(struct queue *q, const struct queue_job *job, const char *dir,
                               struct err_detail *err)
{
    char uuid[33], path[4200], tmp[4300];
    const char *dbpath = queue_db_path(q);
    enum status st = queue_db_uuid(q, uuid, err);
    if (st)
        return st;
    snprintf(path, sizeof(path), "%s/%s", dir, BATCH_MARKER_NAME);
    for (int tries = 0; tries < 2; tries++) {
        char have[4096];
        if (read_marker(path, have, sizeof(have))) {
            char owner[1024];
            if (marker_matches(have, uuid, job->id, owner, sizeof(owner), NULL, 0))
                return ST_OK;
            return err_set(err, ST_ERR_EXISTS,
                           "%s belongs to %s; refusing to write job '%s' there (choose another "
                           "--out or job name)",
                           dir, owner, job->name);
        }
        if (errno == ELOOP)
            return err_set(err, ST_ERR_IO, "%s is a symbolic link; refusing to follow it", path);
        if (errno != ENOENT)
            return err_set(err, ST_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        /* none yet: write a temp file and link it into place, which fails if another run
         * made the marker meanwhile (then the loop reads theirs) */
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "db_uuid", uuid);
        cJSON_AddNumberToObject(m, "job_id", (double)job->id);
        cJSON_AddStringToObject(m, "job_name", job->name);
        job_json_add_text(m, "database", dbpath);
        char *text = cJSON_PrintUnformatted(m);
        cJSON_Delete(m);
        if (!text)
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        snprintf(tmp, sizeof(tmp), "%s/.quern-job.tmp.%ld", dir, (long)getpid());
        unlink(tmp);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        size_t len = strlen(text);
        int ok = fd >= 0 && write(fd, text, len) == (ssize_t)len && write(fd, "\n", 1) == 1 &&
                 fsync(fd) == 0;
        int e = errno;
        free(text);
        if (fd >= 0)
            close(fd);
        if (!ok) {
            unlink(tmp);
            return err_set(err, ST_ERR_IO, "cannot write %s: %s", tmp, strerror(e));
        }
        int linked = link(tmp, path);
        e = errno;
        unlink(tmp);
        if (linked == 0)
            return io_fsync_dir(dir, err);
        if (e != EEXIST)
            return err_set(err, ST_ERR_IO, "cannot create %s: %s", path, strerror(e));
    }
    return err_set(err, ST_ERR_IO, "%s: could not create or read the marker", path);
}

/* The closed shards with records, as the manifest lists them (names point into sh); with ids
 * (may be NULL) their shard ids, which the caller frees. */
static struct io_manifest_shard *manifest_shards(const struct queue_shard *sh, size_t n, size_t *k,
                                                 int64_t **ids)
{
    struct io_manifest_shard *ms = calloc(n + 1, sizeof(*ms));
    *k = 0;
    if (ids && ms && !(*ids = calloc(n + 1, sizeof(**ids)))) {
        free(ms);
        return NULL;
    }
    for (size_t i = 0; ms && i < n; i++) {
        if (sh[i].state != QUEUE_SHARD_CLOSED || !sh[i].committed_bytes)
            continue;
        if (ids)
            (*ids)[*k] = sh[i].id;
        const char *slash = strrchr(sh[i].path, '/');
        struct io_manifest_shard *m = &ms[(*k)++];
        m->name = slash ? slash + 1 : sh[i].path;
        m->kind = sh[i].kind == QUEUE_SHARD_RESULTS ? IO_SHARD_RESULTS : IO_SHARD_ERRORS;
        m->records = sh[i].records;
        m->superseded = sh[i].superseded;
        m->bytes = sh[i].committed_bytes;
        snprintf(m->sha256, sizeof(m->sha256), "%s", sh[i].sha256);
    }
    return ms;
}

/* A listed shard's id and its index in the manifest's shard list. */
struct shard_slot {
    int64_t id;
    size_t slot;
};

static int slot_cmp(const void *a, const void *b)
{
    const struct shard_slot *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

/* Who wrote the listed shards' records: ms[i] (the shard ids[i]) gets its rows of w (ordered
 * by shard then run), and *runs every run named once (strings point into w). The writers'
 * array (caller frees), or NULL when out of memory. */
static struct io_manifest_writer *manifest_writers(struct io_manifest_shard *ms, const int64_t *ids,
                                                   size_t k, const struct queue_writer *w,
                                                   size_t nw, struct io_manifest_run **runs,
                                                   size_t *n_runs)
{
    struct io_manifest_writer *mw = calloc(nw + 1, sizeof(*mw));
    struct io_manifest_run *mr = calloc(nw + 1, sizeof(*mr));
    struct shard_slot *by_id = calloc(k + 1, sizeof(*by_id));
    *runs = mr;
    *n_runs = 0;
    if (!mw || !mr || !by_id) {
        free(mw);
        free(by_id);
        return NULL;
    }
    for (size_t s = 0; s < k; s++)
        by_id[s] = (struct shard_slot){ids[s], s};
    qsort(by_id, k, sizeof(*by_id), slot_cmp);
    for (size_t i = 0; i < nw; i++) {
        mw[i] = (struct io_manifest_writer){w[i].run_id, w[i].records};
        struct shard_slot key = {w[i].shard_id, 0};
        const struct shard_slot *hit = bsearch(&key, by_id, k, sizeof(*by_id), slot_cmp);
        if (!hit) /* a shard the manifest does not list (still open, or empty) */
            continue;
        size_t r = 0;
        while (r < *n_runs && mr[r].id != w[i].run_id)
            r++;
        if (r == *n_runs)
            mr[(*n_runs)++] = (struct io_manifest_run){w[i].run_id, w[i].host, w[i].engine_json};
        struct io_manifest_shard *m = &ms[hit->slot];
        if (!m->writers)
            m->writers = &mw[i]; /* the shard's rows are consecutive in w */
        m->n_writers++;
    }
    free(by_id);
    return mw;
}

/* The first closed, non-empty shard of sh[0..n) that is not a regular file of its committed
 * length: its index, or -1 when every one is (*size: what is there, -1 when nothing is). */
static ptrdiff_t shard_file_bad(struct queue *q, const struct queue_shard *sh, size_t n,
                                long long *size)
{
    for (size_t i = 0; i < n; i++) {
        struct stat sb;
        char path[4096];
        if (sh[i].state != QUEUE_SHARD_CLOSED || !sh[i].committed_bytes)
            continue;
        /* (an older queue's paths are relative to its directory) */
        if (queue_resolve_path(q, sh[i].path, path, sizeof(path), NULL))
            snprintf(path, sizeof(path), "%s", sh[i].path);
        *size = lstat(path, &sb) ? -1 : (long long)sb.st_size;
        if (*size < 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != sh[i].committed_bytes)
            return (ptrdiff_t)i;
    }
    return -1;
}

static enum status shard_file_err(const struct queue_shard *s, long long size,
                                  struct err_detail *err)
{
    char had[64] = "is missing";
    if (size >= 0)
        snprintf(had, sizeof(had), "has %lld bytes", size);
    return err_set(err, ST_ERR_NOT_FOUND,
                   "%s %s, but %llu bytes (%llu records) of it were committed: the job's output "
                   "was deleted, moved or cut since; restore it there (the queue counts those "
                   "items done)",
                   s->path, had, (unsigned long long)s->committed_bytes,
                   (unsigned long long)s->records);
}

enum status batch_check_shard_files(struct queue *q, int64_t job_id, struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n = 0;
    long long size = 0;
    enum status st = queue_shard_list(q, job_id, &sh, &n, err);
    ptrdiff_t bad = st ? -1 : shard_file_bad(q, sh, n, &size);
    if (bad >= 0)
        st = shard_file_err(&sh[bad], size, err);
    queue_shard_list_free(sh, n);
    return st;
}

/* The job directory's marker (batch_outdir_claim), open and flock'ed exclusively: runs of the
 * job write its manifest one at a time; -1 (no lock) where there is no marker, or after 30 s
 * (a writer stopped with SIGSTOP, a lock a crashed NFS client left: the manifest is written
 * unordered then, as before, rather than never). */
static int manifest_lock(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, BATCH_MARKER_NAME);
    /* (for writing: Linux's NFS client emulates flock with POSIX locks, whose exclusive lock
     * wants a file open for writing) */
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return -1;
    for (int tries = 0; flock(fd, LOCK_EX | LOCK_NB) != 0; tries++) {
        if ((errno != EWOULDBLOCK && errno != EINTR) || tries == 600) {
            LOG_WARN("%s: cannot lock it for the manifest (%s); writing it unlocked", path,
                     errno == EWOULDBLOCK ? "another run held it for 30 s" : strerror(errno));
            close(fd);
            return -1;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return fd;
}

static enum status manifest_write_locked(struct queue *q, const struct queue_job *job,
                                         const char *dir, struct err_detail *err)
{
    int complete;
    struct queue_shard *sh = NULL;
    struct queue_writer *w = NULL;
    size_t n = 0, k = 0, nw = 0, n_runs = 0;
    long long size = 0;
    enum status st;
    { /* the queue now, read under the lock, decides: another run may have finished the job
       * since the caller looked, and written its complete manifest, which this one must not
       * replace with an older view (nor a stale "complete" one after a retry, the other way) */
        int64_t open = 0, queued = 0, leased = 0;
        if ((st = batch_count_open_shards(q, job->id, &open, err)) ||
            (st = queue_job_unfinished(q, job->id, &queued, &leased, err)))
            return st;
        complete = open == 0 && queued == 0 && leased == 0;
    }
    if ((st = queue_shard_list(q, job->id, &sh, &n, err)))
        return st;
    ptrdiff_t bad = shard_file_bad(q, sh, n, &size);
    if (bad >= 0) {
        st = shard_file_err(&sh[bad], size, err);
        queue_shard_list_free(sh, n);
        return st;
    }
    if ((st = queue_job_writers(q, job->id, &w, &nw, err))) {
        queue_shard_list_free(sh, n);
        return st;
    }
    int64_t *ids = NULL;
    struct io_manifest_shard *ms = manifest_shards(sh, n, &k, &ids);
    struct io_manifest_run *runs = NULL;
    struct io_manifest_writer *mw = ms ? manifest_writers(ms, ids, k, w, nw, &runs, &n_runs) : NULL;
    free(ids);
    if (!mw) {
        free(ms);
        free(runs);
        queue_shard_list_free(sh, n);
        queue_writers_free(w, nw);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    char jid[32];
    snprintf(jid, sizeof(jid), "%lld", (long long)job->id);
    struct io_manifest m = {0};
    m.job_id = jid;
    m.params_json = job->params_json;
    m.model_path = job->model_path;
    m.model_sha256 = job->model_sha256;
    m.complete = complete;
    m.cancelled = job->state == QUEUE_JOB_CANCELLED;
    m.shards = ms;
    m.n_shards = k;
    m.runs = runs;
    m.n_runs = n_runs;
    st = io_manifest_write(dir, &m, err);
    free(ms);
    free(mw);
    free(runs);
    queue_shard_list_free(sh, n);
    queue_writers_free(w, nw);
    return st ? st : batch_manifest_combined(q, dir, err);
}

enum status batch_manifest_write(struct queue *q, const struct queue_job *job, const char *dir,
                                 struct err_detail *err)
{
    const int lock = manifest_lock(dir);
    enum status st = manifest_write_locked(q, job, dir, err);
    if (lock >= 0)
        close(lock); /* (releases the flock) */
    return st;
}

enum status batch_manifest_combined(struct queue *q, const char *dir, struct err_detail *err)
{
    int part, parts;
    enum status st = batch_parts_which(q, &part, &parts, err);
    if (st || !parts)
        return st;
    char root[4096];
    snprintf(root, sizeof(root), "%s", dir);
    char *slash = strrchr(root, '/');
    if (slash)
        *slash = 0;
    /* the part's own manifest is written: a failure here is only the combined view's */
    struct err_detail e2 = {0};
    if (batch_parts_manifest(root, parts, NULL, &e2))
        LOG_WARN("the combined manifest in %s: %s (rewritten when a part's is)", root, e2.msg);
    return ST_OK;
}

cJSON *batch_json_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *text = NULL;
    size_t len = 0, cap = 0, got;
    char buf[65536];
    int oom = 0;
    while (!oom && (got = fread(buf, 1, sizeof(buf), f)) > 0) {
        if (len + got + 1 > cap) {
            cap = (len + got + 1) * 2;
            char *t = realloc(text, cap);
            oom = !t;
            if (oom)
                break;
            text = t;
        }
        memcpy(text + len, buf, got);
        len += got;
    }
    fclose(f);
    if (!text || oom) {
        free(text);
        return NULL;
    }
    text[len] = 0;
    cJSON *m = cJSON_Parse(text);
    free(text);
    return m;
}

int batch_manifest_current(struct queue *q, const struct queue_job *job, const char *dir)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    cJSON *m = batch_json_file(path);
    struct queue_shard *sh = NULL;
    size_t n = 0, k = 0;
    int ok =
        m && cJSON_IsTrue(cJSON_GetObjectItem(m, "complete")) &&
        cJSON_IsTrue(cJSON_GetObjectItem(m, "cancelled")) == (job->state == QUEUE_JOB_CANCELLED) &&
        !queue_shard_list(q, job->id, &sh, &n, NULL);
    struct io_manifest_shard *ms = ok ? manifest_shards(sh, n, &k, NULL) : NULL;
    const cJSON *arr = cJSON_GetObjectItem(m, "shards");
    /* (a manifest from before provenance, without "runs", is rewritten with them) */
    ok = ok && ms && cJSON_IsArray(arr) && (size_t)cJSON_GetArraySize(arr) == k &&
         cJSON_IsArray(cJSON_GetObjectItem(m, "runs"));
    for (size_t i = 0; ok && i < k; i++) {
        const cJSON *e = cJSON_GetArrayItem(arr, (int)i);
        const cJSON *file = cJSON_GetObjectItem(e, "file"), *sha = cJSON_GetObjectItem(e, "sha256");
        const cJSON *bytes = cJSON_GetObjectItem(e, "bytes"),
                    *rec = cJSON_GetObjectItem(e, "records");
        ok = cJSON_IsArray(cJSON_GetObjectItem(e, "runs")) && cJSON_IsString(file) &&
             !strcmp(file->valuestring, ms[i].name) && cJSON_IsString(sha) &&
             !strcmp(sha->valuestring, ms[i].sha256) && cJSON_IsNumber(bytes) &&
             (uint64_t)bytes->valuedouble == ms[i].bytes && cJSON_IsNumber(rec) &&
             (uint64_t)rec->valuedouble == ms[i].records;
    }
    free(ms);
    queue_shard_list_free(sh, n);
    cJSON_Delete(m);
    return ok;
}
