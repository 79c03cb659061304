/* Partitioned queues (batch/batch.h): the catalogue of a job split over N queue files in one
 * directory, opening a part exclusively, and the combined manifest over the parts' outputs. */
#include "batch/batch.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "io/shard.h"

#define CATALOG_FORMAT "quern-parts"

int batch_parts_find(const char *path, struct batch_parts *p, struct err_detail *err)
{
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return 0;
    memset(p, 0, sizeof(*p));
    char cat[4200];
    snprintf(cat, sizeof(cat), "%s/%s", path, BATCH_PARTS_CATALOG);
    cJSON *c = batch_json_file(cat);
    const cJSON *fmt = cJSON_GetObjectItem(c, "format"), *job = cJSON_GetObjectItem(c, "job");
    const cJSON *n = cJSON_GetObjectItem(c, "parts"), *id = cJSON_GetObjectItem(c, "part_set");
    int ok = cJSON_IsString(fmt) && !strcmp(fmt->valuestring, CATALOG_FORMAT) &&
             cJSON_IsString(job) && strlen(job->valuestring) < sizeof(p->job) &&
             cJSON_IsNumber(n) && n->valuedouble >= 1 && n->valuedouble <= BATCH_PARTS_MAX &&
             n->valuedouble == (int)n->valuedouble && cJSON_IsString(id) &&
             strlen(id->valuestring) == 32;
    if (ok) {
        snprintf(p->dir, sizeof(p->dir), "%s", path);
        snprintf(p->job, sizeof(p->job), "%s", job->valuestring);
        snprintf(p->set_id, sizeof(p->set_id), "%s", id->valuestring);
        p->n = (int)n->valuedouble;
    }
    int exists = access(cat, F_OK) == 0;
    cJSON_Delete(c);
    if (ok)
        return 1;
    err_set(err, exists ? ST_ERR_FORMAT : ST_ERR_INVALID_ARG,
            exists ? "%s: not a valid catalogue of a partitioned queue"
                   : "%s is a directory without a catalogue (" BATCH_PARTS_CATALOG
                     "): give a queue file, or a directory made by `quern submit --partitions`",
            exists ? cat : path);
    return -1;
}

/* 32 hex digits from /dev/urandom (time and pid if it cannot be read). */
static void random_id(char out[33])
{
    unsigned char b[16];
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t got = fd >= 0 ? read(fd, b, sizeof(b)) : -1;
    if (fd >= 0)
        close(fd);
    if (got != (ssize_t)sizeof(b)) {
        unsigned long long t =
            (unsigned long long)time(NULL) ^ ((unsigned long long)getpid() << 32);
        for (int i = 0; i < 16; i++)
            b[i] = (unsigned char)(t >> (8 * (i % 8))) ^ (unsigned char)(i * 37);
    }
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", b[i]);
}

/* Claim dir for this submit: an exclusive flock on its submit lock file, in *fd. */
static enum status claim_dir(const char *dir, int *fd, struct err_detail *err)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, BATCH_PARTS_SUBMIT_LOCK);
    *fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (*fd < 0)
        return err_set(err, ST_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    if (flock(*fd, LOCK_EX | LOCK_NB) == 0)
        return ST_OK;
    int e = errno;
    close(*fd);
    *fd = -1;
    if (e == EWOULDBLOCK)
        return err_set(err, ST_ERR_BUSY,
                       "another submit is writing a job into %s (it holds %s): one job per "
                       "directory",
                       dir, path);
    return err_set(err, ST_ERR_IO, "cannot lock %s: %s", path, strerror(e));
}

enum status batch_parts_create(const char *dir, const char *name, int n, struct batch_parts *p,
                               int *lock_fd, struct err_detail *err)
{
    *lock_fd = -1;
    if (n < 1 || n > BATCH_PARTS_MAX)
        return err_set(err, ST_ERR_INVALID_ARG, "--partitions must be 1..%d", BATCH_PARTS_MAX);
    if (strlen(name) >= sizeof(p->job) || strlen(dir) >= sizeof(p->dir))
        return err_set(err, ST_ERR_RANGE, "name or directory too long");
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return err_set(err, ST_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return err_set(err, ST_ERR_INVALID_ARG, "%s exists and is not a directory", dir);
    enum status st = claim_dir(dir, lock_fd, err);
    if (st)
        return st;
    char cat[4200], part0[4200];
    snprintf(cat, sizeof(cat), "%s/%s", dir, BATCH_PARTS_CATALOG);
    snprintf(part0, sizeof(part0), "%s/part-0000.db", dir);
    if (access(cat, F_OK) == 0)
        st = err_set(err, ST_ERR_EXISTS,
                     "%s already holds a partitioned job (%s): one job per directory", dir,
                     BATCH_PARTS_CATALOG);
    else if (access(part0, F_OK) == 0)
        st = err_set(err, ST_ERR_EXISTS,
                     "%s holds parts without a catalogue (a submit that did not finish?): "
                     "remove its part-*.db files or choose another directory",
                     dir);
    /* a file at any of the new parts' names is not ours: never written into (a queue there
     * would become a part), and never deleted by a failed submit's undo */
    for (int k = 1; !st && k < n; k++) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/part-%04d.db", dir, k);
        if (access(path, F_OK) == 0 || errno != ENOENT)
            st = err_set(err, ST_ERR_EXISTS,
                         "%s exists (a file this submit did not make): remove it or choose "
                         "another directory",
                         path);
    }
    if (st) {
        close(*lock_fd);
        *lock_fd = -1;
        return st;
    }
    memset(p, 0, sizeof(*p));
    snprintf(p->dir, sizeof(p->dir), "%s", dir);
    snprintf(p->job, sizeof(p->job), "%s", name);
    p->n = n;
    random_id(p->set_id);
    return ST_OK;
}

enum status batch_parts_publish(const struct batch_parts *p, const cJSON *inputs,
                                struct err_detail *err)
{
    char files[64];
    snprintf(files, sizeof(files), "part-NNNN.db, NNNN = 0000..%04d", p->n - 1);
    cJSON *c = cJSON_CreateObject(), *in = NULL;
    if (!c || !cJSON_AddStringToObject(c, "format", CATALOG_FORMAT) ||
        !cJSON_AddNumberToObject(c, "version", 1) || !cJSON_AddStringToObject(c, "job", p->job) ||
        !cJSON_AddNumberToObject(c, "parts", p->n) ||
        !cJSON_AddStringToObject(c, "part_set", p->set_id) ||
        !cJSON_AddStringToObject(c, "files", files) ||
        (inputs && !cJSON_AddItemToObject(c, "inputs", in = cJSON_Duplicate(inputs, 1)))) {
        if (in && !cJSON_GetObjectItem(c, "inputs"))
            cJSON_Delete(in);
        cJSON_Delete(c);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    char *text = cJSON_Print(c);
    cJSON_Delete(c);
    if (!text)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    size_t len = strlen(text);
    char *t = realloc(text, len + 2);
    if (!t) {
        free(text);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    t[len++] = '\n';
    t[len] = 0;
    enum status st = io_file_replace(p->dir, BATCH_PARTS_CATALOG, t, len, NULL, err);
    free(t);
    return st;
}

cJSON *batch_parts_inputs(const struct batch_parts *p)
{
    char cat[4200];
    snprintf(cat, sizeof(cat), "%s/%s", p->dir, BATCH_PARTS_CATALOG);
    cJSON *c = batch_json_file(cat);
    cJSON *in = cJSON_DetachItemFromObject(c, "inputs");
    cJSON_Delete(c);
    const cJSON *e;
    int ok = cJSON_IsArray(in);
    cJSON_ArrayForEach(e, in) ok = ok && cJSON_IsString(e);
    if (!ok) {
        cJSON_Delete(in);
        return NULL;
    }
    return in;
}

void batch_parts_path(const struct batch_parts *p, int k, const char *suffix, char *out, size_t cap)
{
    snprintf(out, cap, "%s/part-%04d%s", p->dir, k, suffix);
}

enum status batch_parts_which(struct queue *q, int *k, int *n, struct err_detail *err)
{
    char v[32];
    bool found = false;
    *k = *n = 0;
    enum status st = queue_meta_get(q, "parts", v, sizeof(v), &found, err);
    if (st || !found)
        return st;
    *n = atoi(v);
    if ((st = queue_meta_get(q, "part", v, sizeof(v), &found, err)))
        return st;
    *k = found ? atoi(v) : -1;
    if (*n < 1 || *k < 0 || *k >= *n)
        return err_set(err, ST_ERR_FORMAT, "queue %s: bad part facts (part %d of %d)",
                       queue_db_path(q), *k, *n);
    return ST_OK;
}

/* Mark a new part, or check that an existing one is part k of p's set. */
static enum status part_mark(struct queue *q, const struct batch_parts *p, int k,
                             struct err_detail *err)
{
    char set[40];
    bool found = false;
    enum status st = queue_meta_get(q, "part_set", set, sizeof(set), &found, err);
    if (st)
        return st;
    if (!found) {
        char v[16];
        snprintf(v, sizeof(v), "%d", k);
        if ((st = queue_tx_begin(q, err)))
            return st;
        st = queue_meta_set(q, "part", v, err);
        snprintf(v, sizeof(v), "%d", p->n);
        if (!st)
            st = queue_meta_set(q, "parts", v, err);
        if (!st)
            st = queue_meta_set(q, "part_set", p->set_id, err);
        if (!st)
            return queue_tx_commit(q, err);
        queue_tx_rollback(q);
        return st;
    }
    int pk, pn;
    if ((st = batch_parts_which(q, &pk, &pn, err)))
        return st;
    if (strcmp(set, p->set_id) || pk != k || pn != p->n)
        return err_set(err, ST_ERR_FORMAT,
                       "queue %s is part %d of %d of set %s, not part %d of %d of the catalogue's "
                       "set %s (files moved between directories?)",
                       queue_db_path(q), pk, pn, set, k, p->n, p->set_id);
    return ST_OK;
}

enum status batch_parts_open(const struct batch_parts *p, int k, int busy_ms, int flags,
                             struct queue **q, struct err_detail *err)
{
    *q = NULL;
    if (k < 0 || k >= p->n)
        return err_set(err, ST_ERR_INVALID_ARG, "part %d does not exist: %s has parts 0..%d", k,
                       p->dir, p->n - 1);
    char path[4200];
    batch_parts_path(p, k, ".db", path, sizeof(path));
    struct queue_options qo = {.exclusive = true,
                               .busy_timeout_ms = busy_ms,
                               .must_exist = !(flags & BATCH_PART_CREATE),
                               .check_integrity = (flags & BATCH_PART_CHECK) != 0,
                               .read_only_ok = (flags & BATCH_PART_READ) != 0};
    enum status st = queue_open_opts(q, path, &qo, err);
    if (!st && (st = part_mark(*q, p, k, err))) {
        queue_close(*q);
        *q = NULL;
    }
    return st;
}

/* Add part k's manifest m to the combined one: its shards, prefixed, and their totals; its
 * runs (their ids are the part's: each gets "part" as the shards do). */
static int add_part(cJSON *shards, cJSON *runs, uint64_t tot[2][3], const cJSON *m, int k)
{
    const cJSON *r;
    cJSON_ArrayForEach(r, cJSON_GetObjectItem(m, "runs"))
    {
        cJSON *o = cJSON_Duplicate(r, 1);
        if (!o || !cJSON_AddNumberToObject(o, "part", k)) {
            cJSON_Delete(o);
            return 0;
        }
        cJSON_AddItemToArray(runs, o);
    }
    const cJSON *arr = cJSON_GetObjectItem(m, "shards"), *e;
    char file[300];
    cJSON_ArrayForEach(e, arr)
    {
        const cJSON *f = cJSON_GetObjectItem(e, "file"), *kind = cJSON_GetObjectItem(e, "kind");
        const cJSON *rec = cJSON_GetObjectItem(e, "records"),
                    *bytes = cJSON_GetObjectItem(e, "bytes");
        if (!cJSON_IsString(f) || !cJSON_IsString(kind) || !cJSON_IsNumber(rec) ||
            !cJSON_IsNumber(bytes))
            return 0;
        cJSON *o = cJSON_Duplicate(e, 1);
        if (!o)
            return 0;
        snprintf(file, sizeof(file), "part-%04d/%s", k, f->valuestring);
        cJSON_ReplaceItemInObject(o, "file", cJSON_CreateString(file));
        cJSON_AddNumberToObject(o, "part", k);
        cJSON_AddItemToArray(shards, o);
        int ki = strcmp(kind->valuestring, "errors") == 0;
        tot[ki][0] += 1;
        tot[ki][1] += (uint64_t)rec->valuedouble;
        tot[ki][2] += (uint64_t)bytes->valuedouble;
    }
    return 1;
}

/* Hold an exclusive flock on job_root/.manifest.lock (NFS: a POSIX lock) while the part
 * manifests are read and the combined one written, so that two parts finishing together
 * cannot leave the older picture last. -1 when it cannot be had: go on without it. */
static int manifest_lock(const char *job_root)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/.manifest.lock", job_root);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd >= 0 && flock(fd, LOCK_EX) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

enum status batch_parts_manifest(const char *job_root, int n, int *complete, struct err_detail *err)
{
    int lock = manifest_lock(job_root);
    cJSON *root = cJSON_CreateObject(), *shards = cJSON_CreateArray(),
          *missing = cJSON_CreateArray(), *runs = cJSON_CreateArray();
    uint64_t tot[2][3] = {{0, 0, 0}, {0, 0, 0}};
    int all = 1, cancelled = 0, oom = !root || !shards || !missing || !runs;
    char path[4400];
    for (int k = 0; k < n && !oom; k++) {
        snprintf(path, sizeof(path), "%s/part-%04d/manifest.json", job_root, k);
        cJSON *m = batch_json_file(path);
        if (m && !cJSON_GetObjectItem(root, "manifest_version")) {
            static const char *const copy[] = {"manifest_version", "params", "model"};
            for (size_t i = 0; i < sizeof(copy) / sizeof(copy[0]); i++) {
                const cJSON *v = cJSON_GetObjectItem(m, copy[i]);
                if (v)
                    cJSON_AddItemToObject(root, copy[i], cJSON_Duplicate(v, 1));
            }
        }
        if (m && !add_part(shards, runs, tot, m, k))
            oom = 1;
        /* `quern cancel` is of the whole job (every part not done yet): one cancelled part
         * means the job was cancelled and its cancelled items have no record */
        cancelled |= cJSON_IsTrue(cJSON_GetObjectItem(m, "cancelled"));
        if (!m || !cJSON_IsTrue(cJSON_GetObjectItem(m, "complete"))) {
            all = 0;
            cJSON_AddItemToArray(missing, cJSON_CreateNumber(k));
        }
        cJSON_Delete(m);
    }
    enum status st = ST_OK;
    if (!oom) {
        cJSON_AddNumberToObject(root, "parts", n);
        cJSON_AddBoolToObject(root, "complete", all);
        if (cancelled) /* as in a single queue's manifest (io/manifest.h): present only then */
            cJSON_AddTrueToObject(root, "cancelled");
        cJSON_AddItemToObject(root, "parts_incomplete", missing);
        cJSON_AddItemToObject(root, "shards", shards);
        cJSON_AddItemToObject(root, "runs", runs);
        missing = shards = runs = NULL;
        cJSON *t = cJSON_AddObjectToObject(root, "totals");
        static const char *const kinds[2] = {"results", "errors"};
        for (int ki = 0; t && ki < 2; ki++) {
            cJSON *o = cJSON_AddObjectToObject(t, kinds[ki]);
            cJSON_AddNumberToObject(o, "shards", (double)tot[ki][0]);
            cJSON_AddNumberToObject(o, "records", (double)tot[ki][1]);
            cJSON_AddNumberToObject(o, "bytes", (double)tot[ki][2]);
        }
        char *text = cJSON_Print(root);
        if (text) {
            size_t len = strlen(text);
            text[len] = '\n';
            st = io_file_replace(job_root, "manifest.json", text, len + 1, NULL, err);
            free(text);
        } else {
            oom = 1;
        }
    }
    cJSON_Delete(root);
    cJSON_Delete(shards);
    cJSON_Delete(missing);
    cJSON_Delete(runs);
    if (lock >= 0)
        close(lock); /* releases the flock */
    if (oom)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    if (complete)
        *complete = all;
    return st;
}
