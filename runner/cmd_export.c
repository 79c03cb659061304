/* `quern export`: one file with a job's output: every committed result record, every error
 * record still current (a retried item's old error is left out), and an error record for
 * each line that was rejected at submit. Formats by extension: .jsonl, .jsonl.zst, or a
 * .tar / .tar.zst bundle of the shards, manifest and submit errors as they are. */
#include <archive.h>
#include <archive_entry.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <zstd.h>

#include "common/log.h"
#include "io/shard.h"
#include "jobs/record.h"
#include "queue/queue.h"
#include "runner/runner.h"

static const char export_usage[] =
    "usage: quern export --db Q.db --job ID|NAME --out FILE [--order shard|input]\n"
    "\n"
    "Write the job's output records to FILE: .jsonl, .jsonl.zst, or a .tar/.tar.zst bundle\n"
    "(shards, manifest.json and submit-time errors, unchanged). Records of items still\n"
    "queued or running are not there yet; run `quern status` to see what is left.\n"
    "\n"
    "  --order shard   shard by shard, results then errors (default; streams)\n"
    "  --order input   the order of the input lines (holds all records in memory)\n";

/* custom_id -> item index (open addressing). */
struct idmap {
    char **keys;     /* owned strings, NULL = empty */
    int64_t *val;    /* item index */
    size_t cap;      /* power of two */
    size_t n;        /* entries */
};

static uint64_t str_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static int idmap_put(struct idmap *m, const char *k, int64_t v)
{
    if (2 * (m->n + 1) > m->cap) {
        struct idmap nm = {0};
        nm.cap = m->cap ? m->cap * 2 : 1024;
        nm.keys = calloc(nm.cap, sizeof(char *));
        nm.val = malloc(nm.cap * sizeof(int64_t));
        if (!nm.keys || !nm.val) {
            free(nm.keys);
            free(nm.val);
            return 0;
        }
        for (size_t i = 0; i < m->cap; i++)
            if (m->keys[i]) {
                size_t j = str_hash(m->keys[i]) & (nm.cap - 1);
                while (nm.keys[j])
                    j = (j + 1) & (nm.cap - 1);
                nm.keys[j] = m->keys[i];
                nm.val[j] = m->val[i];
            }
        free(m->keys);
        free(m->val);
        nm.n = m->n;
        *m = nm;
    }
    size_t j = str_hash(k) & (m->cap - 1);
    while (m->keys[j])
        j = (j + 1) & (m->cap - 1);
    if (!(m->keys[j] = strdup(k)))
        return 0;
    m->val[j] = v;
    m->n++;
    return 1;
}

static int64_t idmap_get(const struct idmap *m, const char *k)
{
    if (!m->cap)
        return -1;
    for (size_t j = str_hash(k) & (m->cap - 1); m->keys[j]; j = (j + 1) & (m->cap - 1))
        if (!strcmp(m->keys[j], k))
            return m->val[j];
    return -1;
}

static void idmap_free(struct idmap *m)
{
    for (size_t i = 0; i < m->cap; i++)
        free(m->keys[i]);
    free(m->keys);
    free(m->val);
}

struct item {
    int64_t shard_id;             /* shard holding its current record, 0 if none */
    enum queue_item_state state;  /* state */
    char *line;                   /* record held for --order input (owned) */
};

enum fmt { FMT_JSONL, FMT_JSONL_ZST, FMT_TAR, FMT_TAR_ZST };

struct exporter {
    struct queue_job job;        /* the job */
    struct item *items;          /* in input order */
    size_t n_items, cap_items;   /* count, capacity */
    struct idmap ids;            /* custom_id -> index */
    char **submit_errors;        /* records of lines rejected at submit (owned) */
    size_t n_submit_errors, cap_submit_errors;
    int order_input;             /* --order input */
    FILE *f;                     /* output */
    ZSTD_CCtx *z;                /* for .jsonl.zst */
    int64_t cur_shard;           /* shard being read */
    int cur_errors;              /* it is an errors shard */
    uint64_t written;            /* records written */
    struct err_detail *err;      /* failure detail */
};

static enum status out_bytes(struct exporter *x, const void *p, size_t n, int end)
{
    if (!x->z) {
        if (n && fwrite(p, 1, n, x->f) != n)
            return err_set(x->err, ST_ERR_IO, "write failed");
        return ST_OK;
    }
    char buf[1 << 16];
    ZSTD_inBuffer in = {p, n, 0};
    for (;;) {
        ZSTD_outBuffer ob = {buf, sizeof(buf), 0};
        size_t left = ZSTD_compressStream2(x->z, &ob, &in, end ? ZSTD_e_end : ZSTD_e_continue);
        if (ZSTD_isError(left))
            return err_set(x->err, ST_ERR_INTERNAL, "zstd: %s", ZSTD_getErrorName(left));
        if (ob.pos && fwrite(buf, 1, ob.pos, x->f) != ob.pos)
            return err_set(x->err, ST_ERR_IO, "write failed");
        if (end ? left == 0 : in.pos == in.size)
            return ST_OK;
    }
}

static enum status out_line(struct exporter *x, const char *line)
{
    enum status st = out_bytes(x, line, strlen(line), 0);
    if (!st)
        st = out_bytes(x, "\n", 1, 0);
    x->written++;
    return st;
}

static enum status on_item(void *user, const struct queue_item_info *it)
{
    struct exporter *x = user;
    if (x->n_items == x->cap_items) {
        size_t cap = x->cap_items ? x->cap_items * 2 : 1024;
        struct item *n = realloc(x->items, sizeof(*n) * cap);
        if (!n)
            return err_set(x->err, ST_ERR_NOMEM, "out of memory");
        x->items = n;
        x->cap_items = cap;
    }
    struct item *d = &x->items[x->n_items];
    d->shard_id = it->shard_id;
    d->state = it->state;
    d->line = NULL;
    if (it->custom_id && !idmap_put(&x->ids, it->custom_id, (int64_t)x->n_items))
        return err_set(x->err, ST_ERR_NOMEM, "out of memory");
    if (it->state == QUEUE_ITEM_FAILED && !it->shard_id) { /* rejected at submit */
        char idbuf[64];
        const char *cid = it->custom_id;
        if (!cid) {
            snprintf(idbuf, sizeof(idbuf), "line-%lld", (long long)it->line_no);
            cid = idbuf;
        }
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s:%lld: %s", it->source ? it->source : "?",
                 (long long)it->line_no, it->error_msg ? it->error_msg : "");
        char *rec = job_record_invalid(x->job.id, cid, 400,
                                       it->error_code ? it->error_code : "invalid_request", msg,
                                       NULL);
        if (!rec)
            return err_set(x->err, ST_ERR_NOMEM, "out of memory");
        if (x->order_input) {
            d->line = rec;
        } else {
            if (x->n_submit_errors == x->cap_submit_errors) {
                size_t cap = x->cap_submit_errors ? x->cap_submit_errors * 2 : 64;
                char **n = realloc(x->submit_errors, sizeof(*n) * cap);
                if (!n) {
                    free(rec);
                    return err_set(x->err, ST_ERR_NOMEM, "out of memory");
                }
                x->submit_errors = n;
                x->cap_submit_errors = cap;
            }
            x->submit_errors[x->n_submit_errors++] = rec;
        }
    }
    x->n_items++;
    return ST_OK;
}

/* One shard line: keep it if its item still points at this shard. */
static enum status on_line(const char *line, size_t len, void *user)
{
    struct exporter *x = user;
    (void)len;
    cJSON *j = cJSON_Parse(line);
    const cJSON *cid = j ? cJSON_GetObjectItem(j, "custom_id") : NULL;
    int64_t idx = cJSON_IsString(cid) ? idmap_get(&x->ids, cid->valuestring) : -1;
    cJSON_Delete(j);
    if (idx < 0)
        return err_set(x->err, ST_ERR_FORMAT, "a shard record names an unknown custom_id");
    struct item *it = &x->items[idx];
    if (it->shard_id != x->cur_shard)
        return ST_OK; /* superseded (retried) or not committed to this shard */
    if (!x->order_input)
        return out_line(x, line);
    free(it->line);
    it->line = strdup(line);
    return it->line ? ST_OK : err_set(x->err, ST_ERR_NOMEM, "out of memory");
}

static enum fmt pick_format(const char *path)
{
    size_t n = strlen(path);
#define ENDS(s) (n >= strlen(s) && !strcmp(path + n - strlen(s), s))
    if (ENDS(".tar.zst"))
        return FMT_TAR_ZST;
    if (ENDS(".tar"))
        return FMT_TAR;
    if (ENDS(".zst"))
        return FMT_JSONL_ZST;
#undef ENDS
    return FMT_JSONL;
}

/* Add a file (its first `bytes` bytes) or a memory buffer to the tar bundle. */
static enum status tar_add(struct archive *a, const char *name, const char *path, uint64_t bytes,
                           const char *mem, size_t mem_len, struct err_detail *err)
{
    struct archive_entry *e = archive_entry_new();
    archive_entry_set_pathname(e, name);
    archive_entry_set_size(e, (la_int64_t)(path ? bytes : mem_len));
    archive_entry_set_filetype(e, AE_IFREG);
    archive_entry_set_perm(e, 0644);
    archive_entry_set_mtime(e, time(NULL), 0);
    enum status st = ST_OK;
    if (archive_write_header(a, e) != ARCHIVE_OK)
        st = err_set(err, ST_ERR_IO, "tar: %s", archive_error_string(a));
    if (!st && path) {
        FILE *f = fopen(path, "rb");
        char buf[1 << 16];
        uint64_t left = bytes;
        if (!f)
            st = err_set(err, ST_ERR_IO, "cannot open %s", path);
        while (!st && left) {
            size_t want = left < sizeof(buf) ? (size_t)left : sizeof(buf);
            if (fread(buf, 1, want, f) != want)
                st = err_set(err, ST_ERR_IO, "%s is shorter than its committed length", path);
            else if (archive_write_data(a, buf, want) != (la_ssize_t)want)
                st = err_set(err, ST_ERR_IO, "tar: %s", archive_error_string(a));
            left -= want;
        }
        if (f)
            fclose(f);
    } else if (!st && mem_len && archive_write_data(a, mem, mem_len) != (la_ssize_t)mem_len) {
        st = err_set(err, ST_ERR_IO, "tar: %s", archive_error_string(a));
    }
    archive_entry_free(e);
    return st;
}

static enum status export_tar(struct exporter *x, const char *out, int zst,
                              const struct queue_shard *sh, size_t n, struct err_detail *err)
{
    struct archive *a = archive_write_new();
    enum status st = ST_OK;
    archive_write_set_format_pax_restricted(a);
    if (zst)
        archive_write_add_filter_zstd(a);
    if (archive_write_open_filename(a, out) != ARCHIVE_OK)
        st = err_set(err, ST_ERR_IO, "cannot write %s: %s", out, archive_error_string(a));
    char dir[4096] = "";
    for (size_t i = 0; !st && i < n; i++) {
        if (!sh[i].committed_bytes)
            continue;
        const char *slash = strrchr(sh[i].path, '/');
        char name[600];
        snprintf(name, sizeof(name), "%s/%s", x->job.name, slash ? slash + 1 : sh[i].path);
        st = tar_add(a, name, sh[i].path, sh[i].committed_bytes, NULL, 0, err);
        if (slash && !dir[0])
            snprintf(dir, sizeof(dir), "%.*s", (int)(slash - sh[i].path), sh[i].path);
    }
    if (!st && dir[0]) {
        char mpath[4200], name[300];
        struct stat sb;
        snprintf(mpath, sizeof(mpath), "%s/manifest.json", dir);
        snprintf(name, sizeof(name), "%s/manifest.json", x->job.name);
        if (!stat(mpath, &sb))
            st = tar_add(a, name, mpath, (uint64_t)sb.st_size, NULL, 0, err);
    }
    if (!st && x->n_submit_errors) {
        size_t len = 0;
        for (size_t i = 0; i < x->n_submit_errors; i++)
            len += strlen(x->submit_errors[i]) + 1;
        char *buf = malloc(len + 1), *p = buf;
        for (size_t i = 0; buf && i < x->n_submit_errors; i++)
            p += sprintf(p, "%s\n", x->submit_errors[i]);
        char name[300];
        snprintf(name, sizeof(name), "%s/errors-submit.jsonl", x->job.name);
        st = buf ? tar_add(a, name, NULL, 0, buf, len, err) : err_set(err, ST_ERR_NOMEM, "oom");
        free(buf);
    }
    if (archive_write_close(a) != ARCHIVE_OK && !st)
        st = err_set(err, ST_ERR_IO, "tar: %s", archive_error_string(a));
    archive_write_free(a);
    return st;
}

int runner_cmd_export(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"db", required_argument, 0, 'd'},    {"job", required_argument, 0, 'j'},
        {"out", required_argument, 0, 'o'},   {"order", required_argument, 0, 'O'},
        {"help", no_argument, 0, 'h'},        {0, 0, 0, 0},
    };
    const char *db = NULL, *job = NULL, *out = NULL;
    struct exporter x;
    memset(&x, 0, sizeof(x));
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd': db = optarg; break;
        case 'j': job = optarg; break;
        case 'o': out = optarg; break;
        case 'O':
            if (strcmp(optarg, "shard") && strcmp(optarg, "input")) {
                fprintf(stderr, "quern export: --order is shard or input\n");
                return RUNNER_EXIT_USAGE;
            }
            x.order_input = !strcmp(optarg, "input");
            break;
        case 'h': fputs(export_usage, stdout); return RUNNER_EXIT_OK;
        default: fputs(export_usage, stderr); return RUNNER_EXIT_USAGE;
        }
    }
    if (optind < argc || !db || !job || !out) {
        fprintf(stderr, "quern export: --db, --job and --out are required\n%s", export_usage);
        return RUNNER_EXIT_USAGE;
    }
    struct err_detail err = {0};
    x.err = &err;
    struct queue *q = NULL;
    struct queue_shard *sh = NULL;
    size_t n_sh = 0;
    int rc = RUNNER_EXIT_ERROR;
    enum fmt fmt = pick_format(out);
    enum status st;
    if ((st = queue_open(&q, db, &err)) || (st = queue_job_find(q, job, &x.job, &err)) ||
        (st = queue_item_scan(q, x.job.id, on_item, &x, &err)) ||
        (st = queue_shard_list(q, x.job.id, &sh, &n_sh, &err)))
        goto out;
    if (fmt == FMT_TAR || fmt == FMT_TAR_ZST) {
        if ((st = export_tar(&x, out, fmt == FMT_TAR_ZST, sh, n_sh, &err)))
            goto out;
    } else {
        char tmp[4200];
        snprintf(tmp, sizeof(tmp), "%s.tmp", out);
        if (!(x.f = fopen(tmp, "wb"))) {
            err_set(&err, ST_ERR_IO, "cannot write %s", tmp);
            goto out;
        }
        if (fmt == FMT_JSONL_ZST && !(x.z = ZSTD_createCCtx())) {
            err_set(&err, ST_ERR_NOMEM, "out of memory");
            goto out;
        }
        for (int kind = 0; !st && kind < 2; kind++)
            for (size_t i = 0; !st && i < n_sh; i++) {
                if ((int)sh[i].kind != kind || !sh[i].committed_bytes)
                    continue;
                x.cur_shard = sh[i].id;
                st = io_shard_read(sh[i].path, sh[i].committed_bytes, on_line, &x, &err);
            }
        for (size_t i = 0; !st && i < x.n_submit_errors; i++)
            st = out_line(&x, x.submit_errors[i]);
        for (size_t i = 0; !st && x.order_input && i < x.n_items; i++)
            if (x.items[i].line)
                st = out_line(&x, x.items[i].line);
        if (!st)
            st = out_bytes(&x, "", 0, 1);
        if (fclose(x.f) && !st)
            st = err_set(&err, ST_ERR_IO, "write failed");
        x.f = NULL;
        if (!st && rename(tmp, out))
            st = err_set(&err, ST_ERR_IO, "cannot rename %s to %s", tmp, out);
        if (st) {
            remove(tmp);
            goto out;
        }
        fprintf(stderr, "quern export: %llu records to %s\n", (unsigned long long)x.written, out);
    }
    rc = RUNNER_EXIT_OK;
out:
    if (rc)
        LOG_ERROR("%s", err.msg);
    if (x.f)
        fclose(x.f);
    ZSTD_freeCCtx(x.z);
    for (size_t i = 0; i < x.n_items; i++)
        free(x.items[i].line);
    free(x.items);
    for (size_t i = 0; i < x.n_submit_errors; i++)
        free(x.submit_errors[i]);
    free(x.submit_errors);
    idmap_free(&x.ids);
    queue_shard_list_free(sh, n_sh);
    queue_job_free(&x.job);
    queue_close(q);
    return rc;
}
