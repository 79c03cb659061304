/* Option parsing and small helpers shared by the subcommands. */
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "batch/batch.h"
#include "common/cpus.h"
#include "engine/chat.h"
#include "engine/engine.h"
#include "jobs/json.h"
#include "kernels/kernels.h"
#include "runner/runner.h"

/* The end of the plain decimal number s starts with: an optional '-' (when sign), digits with
 * at most one '.' (when frac; at least one digit), an exponent e[+-]digits (when exp); NULL when
 * there is none. Callers require strtol/strtod to end there too: no spaces, '+', hex ("0x10"
 * read as 16), inf or nan. */
static const char *plain_number(const char *s, int sign, int frac, int exp)
{
    if (sign && *s == '-')
        s++;
    size_t d = strspn(s, "0123456789");
    s += d;
    if (frac && *s == '.') {
        size_t f = strspn(s + 1, "0123456789");
        d += f;
        s += 1 + f;
    }
    if (!d)
        return NULL;
    if (exp && (*s == 'e' || *s == 'E')) {
        s += 1 + (s[1] == '+' || s[1] == '-');
        size_t e = strspn(s, "0123456789");
        if (!e)
            return NULL;
        s += e;
    }
    return s;
}

int runner_parse_long(const char *cmd, const char *flag, const char *s, long lo, long hi,
                      long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (plain_number(s, 1, 0, 0) != end || errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "quern %s: bad value for --%s: '%s' (want an integer in %ld..%ld)\n", cmd,
                flag, s, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

int runner_parse_u64(const char *cmd, const char *flag, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || *s < '0' || *s > '9') { /* (" -1" would wrap) */
        fprintf(stderr, "quern %s: bad value for --%s: '%s' (want an unsigned integer)\n", cmd,
                flag, s);
        return 0;
    }
    *out = v;
    return 1;
}

int runner_parse_float(const char *cmd, const char *flag, const char *s, double lo, double hi,
                       float *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (plain_number(s, 1, 1, 1) != end || errno || end == s || *end || !isfinite(v) || v < lo ||
        v > hi) {
        fprintf(stderr, "quern %s: bad value for --%s: '%s' (want a number in %g..%g)\n", cmd,
                flag, s, lo, hi);
        return 0;
    }
    *out = (float)v;
    return 1;
}

int runner_parse_matmul(const char *cmd, const char *s, int *out)
{
    static const struct {
        const char *name;
        int act;
    } modes[] = {{"exact", KERN_ACT_F32}, {"q8", KERN_ACT_Q8}, {"q16", KERN_ACT_Q16},
                 {"bf16", KERN_ACT_BF16}};
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
        if (!strcmp(s, modes[i].name)) {
            *out = modes[i].act;
            return 1;
        }
    fprintf(stderr, "quern %s: bad value for --matmul: '%s' (exact|q16|bf16|q8)\n", cmd, s);
    return 0;
}

int runner_parse_kv_dtype(const char *cmd, const char *s, int *out)
{
    if (!strcmp(s, "f16") || !strcmp(s, "q8")) {
        *out = !strcmp(s, "q8") ? KERN_KV_Q8 : KERN_KV_F16;
        return 1;
    }
    fprintf(stderr, "quern %s: bad value for --kv-dtype: '%s' (f16|q8)\n", cmd, s);
    return 0;
}

int runner_chat_template_ok(const char *cmd, const char *name)
{
    if (engine_chat_name_known(name))
        return 1;
    fprintf(stderr, "quern %s: --chat-template: unknown '%s' (" ENGINE_CHAT_NAMES ")\n", cmd, name);
    return 0;
}

int runner_parse_size(const char *cmd, const char *flag, const char *s, size_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (plain_number(s, 0, 1, 0) != end)
        end = (char *)s; /* (refused below) */
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (mul > 1 && (*end == 'i' || *end == 'I'))
        end++;
    if (mul > 1 && (*end == 'b' || *end == 'B'))
        end++;
    /* (a plain number is bytes, a whole one; 0.5K is 512) */
    if (errno || end == s || *end || !isfinite(v) || v * mul < 1 || v * mul > 1e15 ||
        (mul == 1 && v != floor(v))) {
        fprintf(stderr, "quern %s: bad value for --%s: '%s' (want a size like 2G or 512M)\n", cmd,
                flag, s);
        return 0;
    }
    *out = (size_t)(v * mul);
    return 1;
}

/* dir and base of path ("." for a bare name) */
static void split_path(const char *path, char *dir, size_t cap, const char **base)
{
    const char *slash = strrchr(path, '/');
    *base = slash ? slash + 1 : path;
    if (!slash)
        snprintf(dir, cap, ".");
    else
        snprintf(dir, cap, "%.*s", slash == path ? 1 : (int)(slash - path), path);
}

static int same_file(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

static int has_marker(const char *dir)
{
    char path[4400];
    struct stat sb;
    snprintf(path, sizeof(path), "%.4200s/%s", dir, BATCH_MARKER_NAME);
    return !lstat(path, &sb);
}

int runner_out_file_ok(const char *cmd, const char *flag, const char *out, const char *db,
                       int makes_job_dirs)
{
    if (!strcmp(out, "-") || !strncmp(out, "/dev/", 5) || !strncmp(out, "/proc/self/fd/", 14))
        return 1;
    char dir[4096], qdir[4096], up[4200];
    const char *base, *qbase;
    struct stat ds, qs, os, qds;
    split_path(out, dir, sizeof(dir), &base);
    int ours = !strcmp(base, "manifest.json") || !strncmp(base, "results-", 8) ||
               !strncmp(base, "errors-", 7) || base[0] == '.' || !strncmp(base, "part-", 5);
    const char *why = NULL;
    if (makes_job_dirs && ours && base[0] != '.') {
        /* a file a run writes must not take one of its job directories' names, wherever it is
         * (--metrics-file out/<job>/manifest.json replaced the manifest with metrics when out/<job>
         * was made after this check) */
        why = "a name quern uses in a job's output directory (shards, manifests, markers)";
        goto refuse;
    }
    if (stat(dir, &ds))
        return 1; /* (writing it fails, with the reason) */
    /* the queue by its real name: SQLite names its -wal, -shm and -journal after it, not
     * after a symlink the user typed */
    char *rdb = db ? realpath(db, NULL) : NULL;
    if (rdb)
        db = rdb;
    if (db && !stat(db, &qs)) {
        if (S_ISDIR(qs.st_mode) && same_file(&qs, &ds))
            why = "a file in the partitioned queue's directory";
        else if (!S_ISDIR(qs.st_mode) && !stat(out, &os) && same_file(&qs, &os))
            why = "the queue itself";
        split_path(db, qdir, sizeof(qdir), &qbase);
        size_t n = strlen(qbase);
        if (!why && !S_ISDIR(qs.st_mode) && !stat(qdir, &qds) && same_file(&qds, &ds) &&
            !strncmp(base, qbase, n) &&
            (!base[n] || !strcmp(base + n, "-wal") || !strcmp(base + n, "-shm") ||
             !strcmp(base + n, "-journal")))
            why = "the queue's own file";
    }
    free(rdb);
    snprintf(up, sizeof(up), "%s/..", dir);
    /* a partitioned job's directory: its parts hold the markers (any part that has run) */
    glob_t parts = {0};
    char pat[4200];
    snprintf(pat, sizeof(pat), "%s/part-[0-9][0-9][0-9][0-9]/" BATCH_MARKER_NAME, dir);
    int partitioned = glob(pat, GLOB_NOSORT, NULL, &parts) == 0 && parts.gl_pathc > 0;
    globfree(&parts);
    if (!why && ours && (has_marker(dir) || has_marker(up) || partitioned))
        why = "a name quern uses in a job's output directory (shards, manifests, markers)";
    if (!why)
        return 1;
refuse:
    fprintf(stderr, "quern %s: --%s %s is %s: write it elsewhere\n", cmd, flag, out, why);
    return 0;
}

int runner_default_threads(void)
{
    int n = cpus_usable();
    return n > 256 ? 256 : n;
}

double runner_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

char *runner_read_stdin(size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, stdin);
        n += r;
        if (r == 0) {
            if (ferror(stdin)) {
                free(buf);
                return NULL;
            }
            break;
        }
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void runner_add_percentiles(struct cJSON *o, const char *name, double *v, size_t n)
{
    static const double q[3] = {50, 90, 99};
    static const char *const k[3] = {"p50", "p90", "p99"};
    cJSON *p = cJSON_AddObjectToObject(o, name);
    if (n) /* v may be NULL when nothing finished (qsort's pointer must not be) */
        qsort(v, n, sizeof(double), cmp_double);
    for (int i = 0; i < 3; i++) {
        size_t idx = n ? (size_t)ceil(q[i] / 100.0 * (double)n) : 0;
        cJSON_AddNumberToObject(p, k[i], n ? v[idx ? idx - 1 : 0] : 0);
    }
}

void runner_add_spec_json(cJSON *o, const struct engine_stats *es, int on)
{
    if (!on && !es->spec_steps && !es->spec_skipped)
        return;
    cJSON *j = cJSON_AddObjectToObject(o, "spec");
    const double drafted = (double)es->spec_drafted, verifies = (double)es->spec_tried_at[0];
    cJSON_AddNumberToObject(j, "steps", (double)es->spec_steps);
    cJSON_AddNumberToObject(j, "skipped_steps", (double)es->spec_skipped);
    cJSON_AddNumberToObject(j, "drafted", drafted);
    cJSON_AddNumberToObject(j, "accepted", (double)es->spec_accepted);
    cJSON_AddNumberToObject(j, "acceptance", drafted > 0 ? (double)es->spec_accepted / drafted : 0);
    cJSON_AddNumberToObject(j, "accepted_per_verify",
                            verifies > 0 ? (double)es->spec_accepted / verifies : 0);
    cJSON_AddNumberToObject(j, "drafted_per_step",
                            es->steps ? drafted / (double)es->steps : 0);
    cJSON *pos = cJSON_AddArrayToObject(j, "acceptance_at");
    for (int i = 0; i < ENGINE_SPEC_MAX_K && es->spec_tried_at[i]; i++)
        cJSON_AddItemToArray(pos, cJSON_CreateNumber((double)es->spec_acc_at[i] /
                                                     (double)es->spec_tried_at[i]));
    if (es->spec_ece >= 0)
        cJSON_AddNumberToObject(j, "survival_ece", es->spec_ece);
    else
        cJSON_AddNullToObject(j, "survival_ece");
    cJSON_AddNumberToObject(j, "draft_s", es->spec_draft_s);
    if (es->spec_model_tokens || es->spec_model_cached) {
        cJSON_AddNumberToObject(j, "draft_model_tokens", (double)es->spec_model_tokens);
        cJSON_AddNumberToObject(j, "draft_model_cached", (double)es->spec_model_cached);
        cJSON_AddNumberToObject(j, "draft_model_drawn", (double)es->spec_model_drawn);
        cJSON_AddNumberToObject(j, "draft_model_argmax", (double)es->spec_model_argmax);
    }
}

char *runner_json_quote(const char *s)
{
    struct job_json b = {0};
    job_json_put_cstr(&b, s);
    return job_json_take(&b);
}

void runner_help_exit(void)
{
    errno = 0;
    if (fflush(stdout) || ferror(stdout)) {
        fprintf(stderr, "quern: writing standard output: %s\n",
                errno ? strerror(errno) : "write error");
        exit(RUNNER_EXIT_ERROR);
    }
    exit(RUNNER_EXIT_OK);
}
