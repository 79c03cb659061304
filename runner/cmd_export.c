/* `quern export`: one file with a job's output: every committed result record, every error
 * record still current (a retried item's old error is left out), and an error record for
 * each line that was rejected at submit. Formats by extension: .jsonl, .jsonl.zst, or a
 * .tar / .tar.zst bundle of the shards, manifest and submit errors as they are.
 * A record's identity is its place, (shard, index among the shard's records), as the queue
 * stored it for its item; the output file appears at its path only once it is complete. */
#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <zstd.h>

#include "batch/batch.h"
#include "common/fault.h"
#include "common/log.h"
#include "common/proc.h"
#include "io/shard.h"
#include "jobs/json.h"
#include "jobs/record.h"
#include "queue/queue.h"
#include "runner/runner.h"

static const char export_usage[] =
    "usage: quern export --db Q.db --job ID|NAME --out FILE [--order shard|input]\n"
    "       quern export --db PARTS_DIR --out FILE [--order shard|input]\n"
    "\n"
    "Write the job's output records to FILE: .jsonl, .jsonl.zst (.zstd), or a .tar/.tar.zst\n"
    "(.tzst) bundle (shards, manifest.json and submit-time errors, unchanged); the suffix in\n"
    "any case; any other name gets plain JSONL, except a compressed or archive name quern does\n"
    "not write (.gz, .tgz, .zip, .bz2, .xz, .lz4, .7z), which is refused. Records of items still\n"
    "queued or running are not there yet: export warns how many (exit 0); `quern status` shows\n"
    "them.\n"
    "\n"
    "In .jsonl and .jsonl.zst each finished item has exactly one record: the one at the\n"
    "place (shard, record number) the queue stored when the item was committed. A shard\n"
    "record no item names any more (the old error of an item retried since) is left out.\n"
    "Items committed by an older queue (no record number) match by custom_id, taking the\n"
    "first such record in their shard. A bundle copies the shards unchanged, superseded\n"
    "records included (those of a running job cut at their committed length), and the\n"
    "manifest.json the job's last run wrote when it stopped: until the job is finished it may\n"
    "not list every shard, or be missing (export warns).\n"
    "A partitioned queue is exported part by part (every part must be free: not in use by a\n"
    "run), each part's records in the order above, or with --order input all parts' records\n"
    "in the order of the input lines (the catalogue lists the inputs; a queue submitted before\n"
    "it did goes part by part); its bundle holds <job>/part-NNNN/ for each part and the\n"
    "combined <job>/manifest.json.\n"
    "The output is written to a new temporary file beside FILE (FILE.tmp.XXXXXX.<pid,\n"
    "host...>), synced, and renamed over FILE: FILE is either its old self or the complete\n"
    "export (a symlink there is replaced, its target untouched). Such files left by an export\n"
    "killed on this host are removed by the next export to FILE. FILE '-' or /dev/stdout is "
    "standard output,\n"
    "/dev/stderr and /dev/fd/N those descriptors; a pipe or a character device is written\n"
    "directly.\n"
    "\n"
    "  --order shard   shard by shard, results then errors (default; streams)\n"
    "  --order input   the order of the input lines (holds all records in memory; not for a\n"
    "                  bundle)\n";

/* ---- lookups: record place -> item, and custom_id -> item for legacy items ------------------ */

/* (shard id, record index) -> item index, open addressing; a slot is empty when item < 0. */
struct recslot {
    int64_t shard_id; /* shards.id */
    int64_t record;   /* 0-based index among that shard's records */
    int64_t item;     /* item index, -1 = empty slot */
};

struct recmap {
    struct recslot *slots; /* cap slots (owned) */
    size_t cap;            /* power of two, 0 before the first put */
    size_t n;              /* entries */
};

static uint64_t rec_hash(int64_t shard_id, int64_t record)
{
    uint64_t h = (uint64_t)shard_id * 0x9e3779b97f4a7c15ull ^ (uint64_t)record;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 29);
}

static struct recslot *recmap_find(struct recslot *slots, size_t cap, int64_t shard_id,
                                   int64_t record)
{
    size_t j = rec_hash(shard_id, record) & (cap - 1);
    while (slots[j].item >= 0 && (slots[j].shard_id != shard_id || slots[j].record != record))
        j = (j + 1) & (cap - 1);
    return &slots[j];
}

/* Returns 0 on allocation failure. A place already present keeps its first item. */
static int recmap_put(struct recmap *m, int64_t shard_id, int64_t record, int64_t item)
{
    if (2 * (m->n + 1) > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 1024;
        struct recslot *s = malloc(cap * sizeof(*s));
        if (!s)
            return 0;
        for (size_t i = 0; i < cap; i++)
            s[i].item = -1;
        for (size_t i = 0; i < m->cap; i++)
            if (m->slots[i].item >= 0)
                *recmap_find(s, cap, m->slots[i].shard_id, m->slots[i].record) = m->slots[i];
        free(m->slots);
        m->slots = s;
        m->cap = cap;
    }
    struct recslot *e = recmap_find(m->slots, m->cap, shard_id, record);
    if (e->item < 0) {
        *e = (struct recslot){shard_id, record, item};
        m->n++;
    }
    return 1;
}

static int64_t recmap_get(const struct recmap *m, int64_t shard_id, int64_t record)
{
    return m->cap ? recmap_find(m->slots, m->cap, shard_id, record)->item : -1;
}

static const char *bundle_out; /* the export's --out, for messages */

/* custom_id -> item index (open addressing), only for items without a record index. */
struct idmap {
    char **keys;  /* owned strings, NULL = empty */
    int64_t *val; /* item index */
    size_t cap;   /* power of two */
    size_t n;     /* entries */
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

/* ---- the exporter ---------------------------------------------------------------------------- */

struct item {
    int64_t shard_id;     /* shard holding its current record, 0 if none */
    int64_t shard_record; /* index of that record in the shard, -1 if unknown (legacy) */
    char *custom_id;      /* owned copy, NULL when the input line had none */
    int found;            /* its record was read from its shard */
    char *line;           /* record held for --order input (owned) */
    uint32_t rank;        /* its source's place among the job's inputs (a partitioned job's) */
    int64_t line_no;      /* its line in that source */
};

/* A record of a partitioned job held for --order input across its parts. */
struct merged {
    uint32_t rank;   /* its source's place in the catalogue's inputs (n_inputs: unknown) */
    int32_t part;    /* its part */
    int64_t line_no; /* its line in the source */
    int64_t idx;     /* its item's place in its part (input order there) */
    char *line;      /* the record (owned) */
};

enum fmt { FMT_JSONL, FMT_JSONL_ZST, FMT_TAR, FMT_TAR_ZST, FMT_UNSUPPORTED };

struct exporter {
    struct queue_job job;      /* the job */
    struct item *items;        /* in input order */
    size_t n_items, cap_items; /* count, capacity */
    struct recmap recs;        /* (shard, record) -> index, items with a record index */
    struct idmap ids;          /* custom_id -> index, legacy items only */
    char **submit_errors;      /* records of lines rejected at submit (owned) */
    size_t n_submit_errors;    /* their count */
    size_t cap_submit_errors;  /* their capacity */
    int order_input;           /* --order input */
    FILE *f;                   /* output */
    ZSTD_CCtx *z;              /* for .jsonl.zst */
    int64_t cur_shard;         /* shard being read */
    int64_t cur_record;        /* index of the next line in it */
    uint64_t written;          /* records written */
    uint64_t superseded;       /* shard lines no item names, left out */
    int64_t unfinished;        /* items of the job(s) still queued or leased */
    struct err_detail *err;    /* failure detail */
    struct archive *tar;       /* the bundle being written, or NULL */
    char tar_dir[4096];        /* the directory of the last queue's shards in it */
    /* --order input over a partitioned job: every part's records gathered, then written in
     * input order, by their source's place in the catalogue's inputs and their line */
    int merge;             /* gathering */
    int part;              /* the part being read */
    cJSON *inputs;         /* the catalogue's inputs (owned) */
    uint32_t n_inputs;     /* their count */
    const char **in_labels; /* the inputs' labels by place (in inputs) */
    uint32_t *in_slots;     /* label -> place + 1, open addressing; 0: empty */
    size_t in_cap;          /* slots (a power of two), 0 before input_table */
    const char *last_label; /* the input the last item named, and its place */
    uint32_t last_rank;     /* (items of one source come together: found once) */
    struct merged *all;    /* the gathered records */
    size_t n_all, cap_all; /* their count, capacity */
};

/* The catalogue's inputs by label: an open-addressing table of their places (the first place
 * of a label given twice). 0 when out of memory. */
static int input_table(struct exporter *x)
{
    size_t cap = 16;
    while (cap < 2 * (size_t)x->n_inputs + 2)
        cap *= 2;
    x->in_slots = calloc(cap, sizeof(*x->in_slots));
    x->in_labels = calloc(x->n_inputs ? x->n_inputs : 1, sizeof(*x->in_labels));
    if (!x->in_slots || !x->in_labels)
        return 0;
    x->in_cap = cap;
    uint32_t r = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, x->inputs)
    {
        x->in_labels[r] = e->valuestring;
        size_t i = (size_t)str_hash(e->valuestring) & (cap - 1);
        while (x->in_slots[i] && strcmp(x->in_labels[x->in_slots[i] - 1], e->valuestring))
            i = (i + 1) & (cap - 1);
        if (!x->in_slots[i])
            x->in_slots[i] = r + 1;
        r++;
    }
    return 1;
}

/* The place of source among the catalogue's inputs (n_inputs when it is not there). */
static uint32_t input_rank(struct exporter *x, const char *source)
{
    if (!source || !x->in_cap)
        return x->n_inputs;
    if (x->last_label && !strcmp(x->last_label, source))
        return x->last_rank;
    size_t i = (size_t)str_hash(source) & (x->in_cap - 1);
    while (x->in_slots[i] && strcmp(x->in_labels[x->in_slots[i] - 1], source))
        i = (i + 1) & (x->in_cap - 1);
    if (!x->in_slots[i])
        return x->n_inputs;
    x->last_rank = x->in_slots[i] - 1;
    x->last_label = x->in_labels[x->last_rank];
    return x->last_rank;
}

static enum status out_bytes(struct exporter *x, const void *p, size_t n, int end)
{
    if (!x->z) {
        if (n && fwrite(p, 1, n, x->f) != n)
            return err_set(x->err, ST_ERR_IO, "writing %s: %s", bundle_out, strerror(errno));
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
            return err_set(x->err, ST_ERR_IO, "writing %s: %s", bundle_out, strerror(errno));
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
    int64_t idx = (int64_t)x->n_items;
    struct item *d = &x->items[x->n_items++];
    memset(d, 0, sizeof(*d));
    if (x->merge) {
        d->rank = input_rank(x, it->source);
        d->line_no = it->line_no;
    }
    d->shard_id = it->shard_id;
    d->shard_record = it->shard_id ? it->shard_record : -1;
    if (it->custom_id && !(d->custom_id = strdup(it->custom_id)))
        return err_set(x->err, ST_ERR_NOMEM, "out of memory");
    if (d->shard_id && d->shard_record >= 0) {
        if (!recmap_put(&x->recs, d->shard_id, d->shard_record, idx))
            return err_set(x->err, ST_ERR_NOMEM, "out of memory");
    } else if (d->shard_id && it->custom_id) { /* committed by schema v1 */
        if (!idmap_put(&x->ids, it->custom_id, idx))
            return err_set(x->err, ST_ERR_NOMEM, "out of memory");
    }
    if (it->state == QUEUE_ITEM_FAILED && !it->shard_id) { /* rejected at submit (schema v1) */
        char *rec = job_record_rejected(x->job.id, it->id, it->custom_id, it->source, it->line_no,
                                        it->error_code, it->error_msg ? it->error_msg : "",
                                        it->error_param);
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
    return ST_OK;
}

/* The line's custom_id as a new string, or NULL (not JSON, no custom_id, or not a string).
 * Caller frees. */
static char *line_custom_id(const char *line)
{
    cJSON *j = cJSON_Parse(line);
    const cJSON *cid = j ? cJSON_GetObjectItem(j, "custom_id") : NULL;
    char *s = cJSON_IsString(cid) ? strdup(cid->valuestring) : NULL;
    cJSON_Delete(j);
    return s;
}

static enum status keep_line(struct exporter *x, struct item *it, const char *line)
{
    it->found = 1;
    if (!x->order_input)
        return out_line(x, line);
    free(it->line);
    it->line = strdup(line);
    return it->line ? ST_OK : err_set(x->err, ST_ERR_NOMEM, "out of memory");
}

/* Whether a record's custom_id is the item's: the same, or the same once JSON-written as the
 * record was (bytes that are not UTF-8 become U+FFFD): queues before 2026-12-06 kept a default
 * id made from a file or member name that is not UTF-8 raw, and every record of its job was
 * refused. */
static int same_id(const char *rec_id, const char *item_id)
{
    if (!strcmp(rec_id, item_id))
        return 1;
    struct job_json b = {0};
    job_json_put_cstr(&b, item_id);
    char *js = job_json_take(&b);
    cJSON *v = js ? cJSON_Parse(js) : NULL;
    int same = cJSON_IsString(v) && !strcmp(v->valuestring, rec_id);
    cJSON_Delete(v);
    free(js);
    return same;
}

/* One shard line, record number cur_record of cur_shard: kept iff an item names that place
 * (or, for a legacy item without a record number, it is the first line in the item's shard
 * with the item's custom_id). Anything else is a superseded record and left out. */
static enum status on_line(const char *line, size_t len, void *user)
{
    struct exporter *x = user;
    (void)len;
    int64_t rec = x->cur_record++;
    int64_t idx = recmap_get(&x->recs, x->cur_shard, rec);
    if (idx >= 0) {
        struct item *it = &x->items[idx];
        if (it->custom_id) { /* the queue and the shard must agree on whose record this is */
            char *cid = line_custom_id(line);
            int differ = cid && !same_id(cid, it->custom_id);
            free(cid);
            if (differ)
                return err_set(x->err, ST_ERR_FORMAT,
                               "record %lld of shard %lld is not item %s's, as the queue says",
                               (long long)rec, (long long)x->cur_shard, it->custom_id);
        }
        return keep_line(x, it, line);
    }
    if (x->ids.n) {
        char *cid = line_custom_id(line);
        idx = cid ? idmap_get(&x->ids, cid) : -1;
        free(cid);
        if (idx >= 0 && x->items[idx].shard_id == x->cur_shard && !x->items[idx].found)
            return keep_line(x, &x->items[idx], line);
    }
    x->superseded++;
    return ST_OK;
}

static enum fmt pick_format(const char *path)
{
    size_t n = strlen(path);
#define ENDS(s) (n >= strlen(s) && !strcasecmp(path + n - strlen(s), s))
    if (ENDS(".tar.zst") || ENDS(".tar.zstd") || ENDS(".tzst"))
        return FMT_TAR_ZST;
    if (ENDS(".tar"))
        return FMT_TAR;
    if (ENDS(".zst") || ENDS(".zstd"))
        return FMT_JSONL_ZST;
    static const char *const other[] = {".gz", ".tgz", ".zip", ".bz2", ".xz", ".lz4", ".7z"};
    for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++)
        if (ENDS(other[i]))
            return FMT_UNSUPPORTED; /* plain JSONL under that name would fail far away */
#undef ENDS
    return FMT_JSONL;
}

/* ---- the temporary output file ----------------------------------------------------------------
 * Created beside the output (same file system, so the rename is atomic) with O_EXCL and
 * O_NOFOLLOW under a random name: nothing already at that name, a planted symlink included,
 * is ever opened. Its path lives in static storage so a SIGINT/SIGTERM/SIGHUP handler can
 * unlink it before the process dies; SIGKILL leaves it behind, never a partial output. */

static char tmp_path[4200];            /* the temporary file, while tmp_live */
static volatile sig_atomic_t tmp_live; /* tmp_path exists and is ours */
static struct sigaction tmp_old_sa[4]; /* handlers replaced while it exists */
static const int tmp_signals[4] = {SIGINT, SIGTERM, SIGHUP, SIGXCPU};

static void tmp_on_signal(int sig)
{
    if (tmp_live)
        unlink(tmp_path);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void tmp_forget(void)
{
    tmp_live = 0;
    for (int i = 0; i < 4; i++)
        sigaction(tmp_signals[i], &tmp_old_sa[i], NULL);
}

static const char tmp_alnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
#define TMP_RANDOM 6 /* random characters after ".tmp." */

/* Remove the temporary files beside out ("<name>.tmp.XXXXXX.<tag>") whose tag names a process
 * that is certainly gone: exports killed on this host (kill -9, a power cut) leave them. */
static void tmp_sweep(const char *out)
{
    const char *slash = strrchr(out, '/');
    char dir[sizeof(tmp_path)], prefix[300];
    snprintf(dir, sizeof(dir), "%.*s", slash ? (int)(slash - out) + (slash == out) : 1,
             slash ? out : ".");
    snprintf(prefix, sizeof(prefix), "%s.tmp.", slash ? slash + 1 : out);
    proc_sweep_dead(dir, prefix, TMP_RANDOM, "an export");
}

/* Create the temporary file for out, "out.tmp.XXXXXX.<tag>" (the tag names this process, so a
 * later export can remove the file if this one is killed; without the tag where it cannot be
 * made or the name would be too long); *fd gets it, open for writing. */
static enum status tmp_create(const char *out, int *fd, struct err_detail *err)
{
    size_t n = strlen(out);
    if (n + sizeof(".tmp.XXXXXX") > sizeof(tmp_path))
        return err_set(err, ST_ERR_INVALID_ARG, "output path too long");
    const char *slash = strrchr(out, '/');
    size_t base_len = strlen(slash ? slash + 1 : out);
    char tag[400] = ".";
    if (proc_tag_self(tag + 1, sizeof(tag) - 1) || base_len + 5 + TMP_RANDOM + strlen(tag) > 255 ||
        n + 5 + TMP_RANDOM + strlen(tag) >= sizeof(tmp_path))
        tag[0] = 0;
    tmp_sweep(out);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = tmp_on_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 4; i++)
        sigaction(tmp_signals[i], &sa, &tmp_old_sa[i]);
    for (int tries = 0; tries < 100; tries++) {
        unsigned char rnd[TMP_RANDOM];
        if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
            uint64_t t = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20) ^ (uint64_t)tries;
            for (size_t i = 0; i < sizeof(rnd); i++)
                rnd[i] = (unsigned char)(t >> (8 * i)) ^ (unsigned char)(tries * 37 + i);
        }
        memcpy(tmp_path, out, n);
        memcpy(tmp_path + n, ".tmp.", 5);
        for (size_t i = 0; i < sizeof(rnd); i++)
            tmp_path[n + 5 + i] = tmp_alnum[rnd[i] % (sizeof(tmp_alnum) - 1)];
        strcpy(tmp_path + n + 5 + sizeof(rnd), tag);
        *fd = open(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (*fd >= 0) {
            tmp_live = 1;
            return ST_OK;
        }
        if (errno != EEXIST && errno != ELOOP)
            break;
    }
    enum status st = err_set(err, ST_ERR_IO, "cannot create %s (its temporary file %s): %s", out,
                             tmp_path, strerror(errno));
    tmp_forget();
    return st;
}

/* The output, *fd open for writing. "-" and "/dev/stdout" are standard output, "/dev/stderr"
 * and "/dev/fd/N" (or /proc/self/fd/N) those descriptors (a dup: "--out /dev/stdout >>all.jsonl"
 * appends, as the shell set it up; renaming over those links replaced them, as root). A character
 * device, FIFO or socket (or a symlink to one) is written directly (*direct = 1): renaming a file
 * over it would replace the device node (as root, /dev/full became a regular file). A regular file,
 * a symlink to one (the link is replaced, its target never written: it may have been planted), or
 * nothing yet gets a temporary file beside it (tmp_create). */
static enum status out_open(const char *out, int *fd, int *direct, struct err_detail *err)
{
    struct stat sb;
    *direct = 0;
    int std = !strcmp(out, "-") || !strcmp(out, "/dev/stdout") ? 1
              : !strcmp(out, "/dev/stderr")                    ? 2
                                                               : -1;
    char *end;
    if (!strncmp(out, "/dev/fd/", 8) || !strncmp(out, "/proc/self/fd/", 14)) {
        long n = strtol(out + (out[1] == 'd' ? 8 : 14), &end, 10);
        if (!*end && n >= 0 && n < 1024)
            std = (int)n;
    }
    if (std >= 0) { /* the descriptor itself, as the shell set it up (>> appends) */
        if ((*fd = fcntl(std, F_DUPFD_CLOEXEC, 3)) < 0)
            return err_set(err, ST_ERR_IO, "%s: %s", out, strerror(errno));
        *direct = 1;
        return ST_OK;
    }
    if (stat(out, &sb))
        return tmp_create(out, fd, err);
    if (S_ISDIR(sb.st_mode))
        return err_set(err, ST_ERR_INVALID_ARG, "%s is a directory: --out names a file", out);
    if (S_ISREG(sb.st_mode)) { /* replaced, keeping its permissions */
        enum status st = tmp_create(out, fd, err);
        if (!st)
            (void)fchmod(*fd, sb.st_mode & 07777);
        return st;
    }
    if (!S_ISCHR(sb.st_mode) && !S_ISFIFO(sb.st_mode) && !S_ISSOCK(sb.st_mode))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "%s is not a regular file, a pipe or a character device", out);
    if ((*fd = open(out, O_WRONLY | O_CLOEXEC)) < 0)
        return err_set(err, ST_ERR_IO, "cannot open %s: %s", out, strerror(errno));
    *direct = 1;
    return ST_OK;
}

/* Finish the temporary file (*fd, closed here either way) after writing it ended with st:
 * on ST_OK fsync it, rename it over out and fsync the directory; otherwise, or when any of
 * that fails, remove it. Returns st, or the status of the step that failed. */
static enum status tmp_commit(const char *out, int *fd, enum status st, struct err_detail *err)
{
    if (!st && fault_hit("export.fsync"))
        st = err_set(err, ST_ERR_IO, "fsync %s: injected fault", tmp_path);
    if (!st && fsync(*fd))
        st = err_set(err, ST_ERR_IO, "fsync %s: %s", tmp_path, strerror(errno));
    if (close(*fd) && !st)
        st = err_set(err, ST_ERR_IO, "close %s: %s", tmp_path, strerror(errno));
    *fd = -1;
    if (!st)
        tmp_live = 0; /* from here on a signal handler must not unlink the name */
    if (!st && rename(tmp_path, out))
        st = err_set(err, ST_ERR_IO, "cannot rename %s to %s: %s", tmp_path, out, strerror(errno));
    if (st)
        unlink(tmp_path);
    tmp_forget();
    if (!st)
        st = io_fsync_parent(out, err);
    return st;
}

/* ---- formats ----------------------------------------------------------------------------- */

/* A failed write to the bundle: its path, libarchive's message and the system's reason. */
static enum status tar_fail(struct archive *a, struct err_detail *err)
{
    const int e = archive_errno(a);
    return err_set(err, ST_ERR_IO, "writing the bundle %s: %s%s%s", bundle_out,
                   archive_error_string(a), e > 0 ? ": " : "", e > 0 ? strerror(e) : "");
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
        st = tar_fail(a, err);
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
                st = tar_fail(a, err);
            left -= want;
        }
        if (f)
            fclose(f);
    } else if (!st && mem_len && archive_write_data(a, mem, mem_len) != (la_ssize_t)mem_len) {
        st = tar_fail(a, err);
    }
    archive_entry_free(e);
    return st;
}

/* The bundle, written to fd (which stays open: the caller syncs and closes it). */
/* Start the bundle (x->tar) on fd: a tar, zstd-compressed when zst. */
static enum status tar_open(struct exporter *x, int fd, int zst, struct err_detail *err)
{
    struct archive *a = x->tar = archive_write_new();
    if (!a)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    archive_write_set_format_pax_restricted(a);
    if (zst && archive_write_add_filter_zstd(a) != ARCHIVE_OK)
        return err_set(err, ST_ERR_UNSUPPORTED, "tar: %s", archive_error_string(a));
    if (archive_write_open_fd(a, fd) != ARCHIVE_OK)
        return tar_fail(a, err);
    return ST_OK;
}

/* One queue's part of the bundle: its shards and manifest under <job>/<sub> (sub "" or
 * "part-NNNN/"), and its submit-time errors. The shards' directory goes to x->tar_dir; without
 * shards (a part cancelled before any output has a manifest all the same) it is job_dir. */
static enum status tar_queue(struct exporter *x, struct queue *q, const struct queue_shard *sh,
                             size_t n, const char *sub, const char *job_dir, struct err_detail *err)
{
    enum status st = ST_OK;
    char dir[4096] = "";
    for (size_t i = 0; !st && i < n; i++) {
        if (!sh[i].committed_bytes)
            continue;
        const char *slash = strrchr(sh[i].path, '/');
        char name[700];
        snprintf(name, sizeof(name), "%s/%s%s", x->job.name, sub, slash ? slash + 1 : sh[i].path);
        st = tar_add(x->tar, name, sh[i].path, sh[i].committed_bytes, NULL, 0, err);
        if (slash && !dir[0])
            snprintf(dir, sizeof(dir), "%.*s", (int)(slash - sh[i].path), sh[i].path);
    }
    if (!dir[0])
        snprintf(dir, sizeof(dir), "%s", job_dir);
    if (!st && dir[0]) {
        char mpath[4200], name[400];
        struct stat sb;
        snprintf(mpath, sizeof(mpath), "%s/manifest.json", dir);
        snprintf(name, sizeof(name), "%s/%smanifest.json", x->job.name, sub);
        const int have = !stat(mpath, &sb);
        if (have)
            st = tar_add(x->tar, name, mpath, (uint64_t)sb.st_size, NULL, 0, err);
        /* a run writes the manifest when it stops: while the job is unfinished it may not list
         * the shards written since (or be missing, during the first run) */
        /* (a job, not a part, cancelled with no shard and no run on it: run.c writes it none) */
        if (!st && !have && x->job.state == QUEUE_JOB_CANCELLED && !n && !sub[0] && !x->unfinished)
            LOG_WARN("job %s was cancelled before any run wrote its output: it has no "
                     "manifest.json, nor will it (the bundle has none)",
                     x->job.name);
        else if (!st && !have)
            LOG_WARN("job %s has no manifest.json yet (a run writes it when it stops): the "
                     "bundle has none",
                     x->job.name);
        else if (!st && (x->unfinished || !batch_manifest_current(q, &x->job, dir)))
            LOG_WARN("job %s %s: the bundle's manifest.json is the one its last run wrote when it "
                     "stopped, and may not list every shard in the bundle",
                     x->job.name, x->unfinished ? "is not finished" : "changed since its manifest");
        snprintf(x->tar_dir, sizeof(x->tar_dir), "%s", dir);
    }
    if (!st && x->n_submit_errors) {
        size_t len = 0;
        for (size_t i = 0; i < x->n_submit_errors; i++)
            len += strlen(x->submit_errors[i]) + 1;
        char *buf = malloc(len + 1), *p = buf;
        for (size_t i = 0; buf && i < x->n_submit_errors; i++)
            p += sprintf(p, "%s\n", x->submit_errors[i]);
        char name[400];
        snprintf(name, sizeof(name), "%s/%serrors-submit.jsonl", x->job.name, sub);
        st = buf ? tar_add(x->tar, name, NULL, 0, buf, len, err)
                 : err_set(err, ST_ERR_NOMEM, "oom");
        free(buf);
    }
    return st;
}

/* End the bundle; for a partitioned queue (job set) first the combined manifest, from the
 * directory above the last part's. */
static enum status tar_close(struct exporter *x, const char *job, enum status st,
                             struct err_detail *err)
{
    if (!x->tar)
        return st;
    char *slash = strrchr(x->tar_dir, '/');
    if (!st && job && slash) {
        char mpath[4200], name[300];
        struct stat sb;
        snprintf(mpath, sizeof(mpath), "%.*s/manifest.json", (int)(slash - x->tar_dir), x->tar_dir);
        snprintf(name, sizeof(name), "%s/manifest.json", job);
        if (!stat(mpath, &sb))
            st = tar_add(x->tar, name, mpath, (uint64_t)sb.st_size, NULL, 0, err);
    }
    if (archive_write_close(x->tar) != ARCHIVE_OK && !st)
        st = tar_fail(x->tar, err);
    archive_write_free(x->tar);
    x->tar = NULL;
    return st;
}

/* Read the shards' committed records (on_line: each kept as the items say), results first. */
static enum status read_shards(struct exporter *x, const struct queue_shard *sh, size_t n_sh,
                               struct err_detail *err)
{
    enum status st = ST_OK;
    for (int kind = 0; !st && kind < 2; kind++)
        for (size_t i = 0; !st && i < n_sh; i++) {
            if ((int)sh[i].kind != kind || !sh[i].committed_bytes)
                continue;
            x->cur_shard = sh[i].id;
            x->cur_record = 0;
            st = io_shard_read(sh[i].path, sh[i].committed_bytes, on_line, x, err);
        }
    return st;
}

/* Start writing JSONL to fd (which stays open; zstd-compressed, one frame, when zst). */
static enum status stream_open(struct exporter *x, int fd, int zst, struct err_detail *err)
{
    int dfd = dup(fd);
    if (dfd < 0 || !(x->f = fdopen(dfd, "wb"))) {
        if (dfd >= 0)
            close(dfd);
        return err_set(err, ST_ERR_IO, "cannot write %s: %s", tmp_path, strerror(errno));
    }
    if (zst && !(x->z = ZSTD_createCCtx()))
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    return ST_OK;
}

/* End what stream_open began (the frame, the stream); st: how the writing went. */
static enum status stream_close(struct exporter *x, enum status st, struct err_detail *err)
{
    if (!st)
        st = out_bytes(x, "", 0, 1);
    if (x->f && fclose(x->f) && !st)
        st = err_set(err, ST_ERR_IO, "writing %s: %s", bundle_out, strerror(errno));
    x->f = NULL;
    ZSTD_freeCCtx(x->z);
    x->z = NULL;
    return st;
}

/* The records as JSONL (zstd-compressed when zst), written to fd (which stays open). */
static enum status export_jsonl(struct exporter *x, int fd, int zst, const struct queue_shard *sh,
                                size_t n_sh, struct err_detail *err)
{
    enum status st = stream_open(x, fd, zst, err);
    if (!st)
        st = read_shards(x, sh, n_sh, err);
    for (size_t i = 0; !st && i < x->n_submit_errors; i++)
        st = out_line(x, x->submit_errors[i]);
    for (size_t i = 0; !st && x->order_input && i < x->n_items; i++)
        if (x->items[i].line)
            st = out_line(x, x->items[i].line);
    return stream_close(x, st, err);
}

/* Drop what the exporter holds for one queue (items, lookups, the job). */
static void exporter_reset(struct exporter *x)
{
    ZSTD_freeCCtx(x->z);
    x->z = NULL;
    for (size_t i = 0; i < x->n_items; i++) {
        free(x->items[i].line);
        free(x->items[i].custom_id);
    }
    free(x->items);
    x->items = NULL;
    x->n_items = x->cap_items = 0;
    for (size_t i = 0; i < x->n_submit_errors; i++)
        free(x->submit_errors[i]);
    free(x->submit_errors);
    x->submit_errors = NULL;
    x->n_submit_errors = x->cap_submit_errors = 0;
    free(x->recs.slots);
    memset(&x->recs, 0, sizeof(x->recs));
    idmap_free(&x->ids);
    queue_job_free(&x->job);
    memset(&x->job, 0, sizeof(x->job));
}

/* Export job (id or name) of the open queue q to fd in format fmt, appending (a bundle: to
 * x->tar, its names under <job>/<sub>). */
/* --order input over parts: this part's records (read from its shards into its items) join
 * the gathered ones; nothing is written yet. */
static enum status gather_part(struct exporter *x, const struct queue_shard *sh, size_t n_sh,
                               struct err_detail *err)
{
    enum status st = read_shards(x, sh, n_sh, err);
    for (size_t i = 0; !st && i < x->n_items; i++) {
        if (!x->items[i].line)
            continue;
        if (x->n_all == x->cap_all) {
            size_t cap = x->cap_all ? x->cap_all * 2 : 1024;
            struct merged *n = realloc(x->all, sizeof(*n) * cap);
            if (!n)
                return err_set(err, ST_ERR_NOMEM, "out of memory");
            x->all = n;
            x->cap_all = cap;
        }
        x->all[x->n_all++] = (struct merged){x->items[i].rank, x->part, x->items[i].line_no,
                                             (int64_t)i, x->items[i].line};
        x->items[i].line = NULL;
    }
    return st;
}

static int cmp_merged(const void *pa, const void *pb)
{
    const struct merged *a = pa, *b = pb;
    if (a->rank != b->rank)
        return a->rank < b->rank ? -1 : 1;
    if (a->line_no != b->line_no)
        return a->line_no < b->line_no ? -1 : 1;
    if (a->part != b->part)
        return a->part < b->part ? -1 : 1;
    return (a->idx > b->idx) - (a->idx < b->idx);
}

/* The gathered records, in input order, to fd (one zstd frame for .jsonl.zst). */
static enum status write_merged(struct exporter *x, int fd, int zst, struct err_detail *err)
{
    if (x->n_all)
        qsort(x->all, x->n_all, sizeof(*x->all), cmp_merged);
    enum status st = stream_open(x, fd, zst, err);
    for (size_t i = 0; !st && i < x->n_all; i++)
        st = out_line(x, x->all[i].line);
    return stream_close(x, st, err);
}

static void merged_free(struct exporter *x)
{
    for (size_t i = 0; i < x->n_all; i++)
        free(x->all[i].line);
    free(x->all);
    x->all = NULL;
    x->n_all = x->cap_all = 0;
    cJSON_Delete(x->inputs);
    x->inputs = NULL;
    free(x->in_slots);
    free(x->in_labels);
    x->in_slots = NULL;
    x->in_labels = NULL;
    x->in_cap = 0;
    x->last_label = NULL;
}

static enum status export_queue(struct exporter *x, struct queue *q, const char *job, int fd,
                                enum fmt fmt, const char *sub, struct err_detail *err)
{
    struct queue_shard *sh = NULL;
    size_t n_sh = 0;
    int tar = fmt == FMT_TAR || fmt == FMT_TAR_ZST;
    exporter_reset(x);
    enum status st;
    int64_t queued = 0, leased = 0;
    /* one snapshot: a commit between the item scan and the shard list would make the records
     * it added look superseded */
    if ((st = queue_read_begin(q, err)))
        goto out;
    st = queue_job_find_ready(q, job, &x->job, err);
    if (!st)
        st = queue_job_unfinished(q, x->job.id, &queued, &leased, err);
    if (!st)
        st = queue_item_scan_finished(q, x->job.id, on_item, x, err);
    if (!st)
        st = queue_shard_list(q, x->job.id, &sh, &n_sh, err);
    queue_read_end(q);
    if (st)
        goto out;
    x->unfinished += queued + leased;
    for (size_t i = 0; i < n_sh; i++) { /* stored paths may be relative to the database */
        char path[4096], *dup;
        if ((st = batch_shard_path(q, &sh[i], path, sizeof(path), err)))
            goto out;
        if (!(dup = strdup(path))) {
            st = err_set(err, ST_ERR_NOMEM, "out of memory");
            goto out;
        }
        free(sh[i].path);
        sh[i].path = dup;
    }
    if (tar) {
        char root[4096], job_dir[4400];
        if (!(st = queue_resolve_path(q, x->job.out_dir, root, sizeof(root), err))) {
            snprintf(job_dir, sizeof(job_dir), "%s/%s/%s", root, x->job.name, sub);
            size_t l = strlen(job_dir);
            if (l && job_dir[l - 1] == '/')
                job_dir[l - 1] = 0;
            st = tar_queue(x, q, sh, n_sh, sub, job_dir, err);
        }
    } else if (x->merge)
        st = gather_part(x, sh, n_sh, err);
    else
        st = export_jsonl(x, fd, fmt == FMT_JSONL_ZST, sh, n_sh, err);
    if (!st && !tar) {
        uint64_t missing = 0;
        for (size_t i = 0; i < x->n_items; i++)
            missing += x->items[i].shard_id && !x->items[i].found;
        if (missing)
            LOG_WARN("%llu committed items have no record in their shard",
                     (unsigned long long)missing);
    }
out:
    queue_shard_list_free(sh, n_sh);
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
    if (optind < argc) {
        fprintf(stderr, "quern export: unexpected argument '%s'\n", argv[optind]);
        return RUNNER_EXIT_USAGE;
    }
    if (optind < argc || !db || !out || !*out || (0)) {
        fprintf(stderr, "quern export: %s\n%s",
                db && out && *out ? "--out names a file (standard output is not offered)"
                                  : "--db and --out (a file name) are required",
                export_usage);
        return RUNNER_EXIT_USAGE;
    }
    if (!runner_out_file_ok("export", "out", out, db, 0))
        return RUNNER_EXIT_USAGE;
    if (x.order_input && (pick_format(out) == FMT_TAR || pick_format(out) == FMT_TAR_ZST)) {
        fprintf(stderr, "quern export: --order input is for .jsonl and .jsonl.zst: a bundle "
                        "copies the shards unchanged\n");
        return RUNNER_EXIT_USAGE;
    }
    if (pick_format(out) == FMT_UNSUPPORTED) {
        fprintf(stderr,
                "quern export: %s: quern writes .jsonl, .jsonl.zst, .tar or .tar.zst (and "
                "plain JSONL under other names), not this compression\n",
                out);
        return RUNNER_EXIT_USAGE;
    }
    struct err_detail err = {0};
    x.err = &err;
    struct batch_parts parts;
    int dir = batch_parts_find(db, &parts, &err);
    enum fmt fmt = pick_format(out);
    int tar = fmt == FMT_TAR || fmt == FMT_TAR_ZST, rc = RUNNER_EXIT_ERROR, fd = -1, direct = 0;
    enum status st = ST_OK;
    if (dir < 0)
        goto out;
    if (dir && job && strcmp(job, parts.job)) {
        err_set(&err, ST_ERR_NOT_FOUND, "%s holds job '%s', not '%s'", db, parts.job, job);
        goto out;
    }
    if (!dir && !job) {
        fprintf(stderr, "quern export: --job is required\n%s", export_usage);
        return RUNNER_EXIT_USAGE;
    }
    bundle_out = out;
    if ((st = out_open(out, &fd, &direct, &err)) ||
        (tar && (st = tar_open(&x, fd, fmt == FMT_TAR_ZST, &err))))
        goto out;
    /* a partitioned queue: part by part into the one file (each part's records as they would
     * be exported alone; a .zst gets a frame per part, which zstd reads as one stream); with
     * --order input every part's records gathered first and written in input order, by the
     * inputs the catalogue lists (a queue submitted before it listed them: part by part) */
    if (dir && x.order_input && !tar) {
        x.inputs = batch_parts_inputs(&parts);
        x.n_inputs = (uint32_t)cJSON_GetArraySize(x.inputs);
        x.merge = x.inputs != NULL;
        if (x.merge && !input_table(&x)) {
            err_set(&err, ST_ERR_NOMEM, "out of memory");
            goto out;
        }
        if (!x.merge)
            LOG_WARN("%s: its catalogue does not list the inputs (a submit before 2026-12-05): "
                     "--order input goes part by part",
                     db);
    }
    for (int k = 0; !st && k < (dir ? parts.n : 1); k++) {
        x.part = k;
        struct queue *q = NULL;
        struct queue_options qo = {.must_exist = true, .read_only_ok = true};
        st = dir ? batch_parts_open(&parts, k, 500, BATCH_PART_READ, &q, &err)
                 : queue_open_opts(&q, db, &qo, &err);
        if (st == ST_ERR_BUSY)
            err_set(&err, st, "part %d is in use by a run: export when it has ended (quern status "
                    "--db %s shows the parts)", k, db);
        char sub[32] = "";
        if (dir)
            snprintf(sub, sizeof(sub), "part-%04d/", k);
        if (!st)
            st = export_queue(&x, q, dir ? parts.job : job, fd, fmt, sub, &err);
        queue_close(q);
    }
    if (!st && x.merge)
        st = write_merged(&x, fd, fmt == FMT_JSONL_ZST, &err);
    st = tar_close(&x, dir ? parts.job : NULL, st, &err);
    if (direct) {
        if (close(fd) && !st)
            st = err_set(&err, ST_ERR_IO, "close %s: %s", out, strerror(errno));
        fd = -1;
    } else {
        st = tmp_commit(out, &fd, st, &err);
    }
    if (st)
        goto out;
    if (!tar)
        fprintf(stderr, "quern export: %llu records to %s (%llu superseded left out)\n",
                (unsigned long long)x.written, out, (unsigned long long)x.superseded);
    if (x.unfinished)
        LOG_WARN("%lld items are not finished yet (queued or running): their records are not in "
                 "%s (quern status --db %s shows them)",
                 (long long)x.unfinished, out, db);
    rc = RUNNER_EXIT_OK;
out:
    if (rc)
        LOG_ERROR("%s", err.msg);
    tar_close(&x, NULL, ST_ERR_IO, NULL);
    if (fd >= 0 && direct)
        close(fd);
    else if (fd >= 0)
        tmp_commit(out, &fd, ST_ERR_IO, NULL);
    exporter_reset(&x);
    merged_free(&x);
    return rc;
}
