/* `quern submit`: read request lines from input files (JSONL, compressed, or inside
 * archives), validate each one, and insert them as one job's items in the SQLite queue.
 * Blank lines are skipped; a bad line becomes a failed item with its file, line number and
 * reason. Lines are parsed outside the write lock and written in bounded transactions, so runs
 * sharing the database never wait long, while the job stays invisible to them until the last
 * commit makes it ready (queue/queue.h, "Jobs being submitted"). A submit that fails or is
 * interrupted deletes what it wrote; one that is killed is collected by queue_jobs_gc. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <locale.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "batch/batch.h"
#include "common/fileid.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/utf8.h"
#include "engine/sampler.h"
#include "io/input.h"
#include "jobs/params.h"
#include "jobs/request.h"
#include "queue/queue.h"
#include "runner/runner.h"

static const char submit_usage[] =
    "usage: quern submit --db Q.db [options] FILE...\n"
    "       quern submit --db DIR --partitions N [options] FILE...\n"
    "\n"
    "Create a job from request lines and print its id on stdout. FILEs may be .jsonl,\n"
    ".jsonl.gz, .jsonl.zst, or .tar/.tar.gz/.tar.zst/.zip archives of .jsonl members\n"
    "(- reads standard input, as /dev/stdin).\n"
    "Lines: OpenAI Batch requests ({\"custom_id\",\"method\":\"POST\",\"url\":\n"
    "\"/v1/chat/completions\"|\"/v1/completions\",\"body\":{...}}) or the short forms\n"
    "{\"custom_id\"?, \"prompt\": ...} and {\"custom_id\"?, \"messages\": [...]}. A short-form\n"
    "line without custom_id gets \"line-N\" (\"MEMBER:line-N\" in an archive, \"FILE:line-N\"\n"
    "or \"FILE:MEMBER:line-N\" with several inputs, FILE as given; over 400 bytes of it:\n"
    "\"sha256-<16 hex digits of it>:line-N\"); a Batch line must have one. Bad lines become queued "
    "items that carry their error (the first 20\n"
    "reported on stderr with their line numbers) unless --strict; a run writes their error\n"
    "records (custom_id null when the line's own could not be read) and they are failed then.\n"
    "Blank lines are skipped. The job becomes visible to runs only once every line is in.\n"
    "Request fields quern honours besides the messages/prompt: max_tokens (or\n"
    "max_completion_tokens), temperature, top_p, seed, stop, frequency_penalty,\n"
    "presence_penalty, n (1-128 choices), logprobs/top_logprobs, response_format (text,\n"
    "json_object, json_schema: the output follows the schema), quern's grammar (GBNF-style),\n"
    "top_k, min_p, repetition_penalty, repeat_last_n, and chat_template_kwargs\n"
    "{\"enable_thinking\": false} (Qwen3's template reads it); user, metadata (your own data),\n"
    "store, service_tier and other OpenAI fields that change nothing are ignored. A field\n"
    "quern does not know (a typo: max_token) is refused, as are those it cannot honour and\n"
    "schema features it cannot guarantee (README \"Request parameters\").\n"
    "\n"
    "  --db PATH              queue database (created if missing)\n"
    "  --partitions N         write the job as N queue files in the directory --db (made if\n"
    "                         missing; one job per directory): DIR/part-NNNN.db and the\n"
    "                         catalogue DIR/quern-parts.json, lines dealt out so that the\n"
    "                         parts' estimated tokens (stored request JSON bytes / 4 +\n"
    "                         max_tokens x n) are balanced; for Slurm arrays across hosts\n"
    "                         (`quern run --db DIR --part K`). Prints DIR instead of the job id\n"
    "  --model PATH           GGUF model for the job (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --name NAME            job name ([A-Za-z0-9._-], at most 128, not all digits, no\n"
    "                         leading '.'; default job-YYYYMMDD-HHMMSS-PID, UTC)\n"
    "  --out DIR              output root recorded with the job (default out)\n"
    "  --max-tokens N         default max_tokens (default 256; lowered for a line to what the\n"
    "                         model context leaves after its prompt)\n"
    "  --temperature T        default temperature (default 1, as OpenAI)\n"
    "  --top-p P, --top-k K, --min-p P, --repeat-penalty R,\n"
    "  --frequency-penalty F, --presence-penalty F   other sampling defaults\n"
    "  --seed N               job seed (default 0): each request's RNG is keyed by (seed,\n"
    "                         custom_id); a request's own \"seed\" replaces the job's, and\n"
    "                         is still mixed with its custom_id: equal lines with different\n"
    "                         custom_ids sample differently\n"
    "  --max-line BYTES       longest accepted line (default 16M)\n"
    "  --strict               abort (nothing inserted) at the first bad line\n"
    "  -h, --help             this help\n";

struct submit_opts {
    const char *db;            /* --db */
    const char *model;         /* --model */
    const char *name;          /* --name */
    const char *out;           /* --out */
    size_t max_line;           /* --max-line */
    int partitions;            /* --partitions, 0 = one queue file */
    int strict;                /* --strict */
    struct job_defaults def;   /* sampling defaults */
};

enum { S_DB = 256, S_MODEL, S_NAME, S_OUT, S_MAXTOK, S_TEMP, S_TOPP, S_TOPK, S_MINP, S_REP,
       S_FREQ, S_PRES, S_SEED, S_MAXLINE, S_STRICT, S_PARTS };

static int parse_submit(int argc, char **argv, struct submit_opts *o)
{
    static const struct option longopts[] = {
        {"db", required_argument, 0, S_DB},
        {"model", required_argument, 0, S_MODEL},
        {"name", required_argument, 0, S_NAME},
        {"out", required_argument, 0, S_OUT},
        {"max-tokens", required_argument, 0, S_MAXTOK},
        {"temperature", required_argument, 0, S_TEMP},
        {"top-p", required_argument, 0, S_TOPP},
        {"top-k", required_argument, 0, S_TOPK},
        {"min-p", required_argument, 0, S_MINP},
        {"repeat-penalty", required_argument, 0, S_REP},
        {"frequency-penalty", required_argument, 0, S_FREQ},
        {"presence-penalty", required_argument, 0, S_PRES},
        {"seed", required_argument, 0, S_SEED},
        {"max-line", required_argument, 0, S_MAXLINE},
        {"strict", no_argument, 0, S_STRICT},
        {"partitions", required_argument, 0, S_PARTS},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    memset(o, 0, sizeof(*o));
    o->model = RUNNER_DEFAULT_MODEL;
    o->out = "out";
    o->max_line = IO_INPUT_DEFAULT_MAX_LINE;
    engine_sampling_default(&o->def.sampling);
    o->def.max_tokens = 256;
    long l;
    int c;
    const char *cmd = "submit";
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case S_DB: o->db = optarg; break;
        case S_MODEL: o->model = optarg; break;
        case S_NAME: { /* checked now: before the model is hashed or the queue made */
            struct err_detail ne = {0};
            if (queue_job_name_check(optarg, &ne)) {
                fprintf(stderr, "quern submit: --name: %s\n", ne.msg);
                return 0;
            }
            o->name = optarg;
            break;
        }
        case S_OUT:
            if (!*optarg) { /* (it meant the working directory) */
                fprintf(stderr, "quern submit: --out is empty\n");
                return 0;
            }
            o->out = optarg;
            break;
        case S_STRICT: o->strict = 1; break;
        case S_MAXTOK:
            if (!runner_parse_long(cmd, "max-tokens", optarg, 1, 1 << 24, &l))
                return 0;
            o->def.max_tokens = (int32_t)l;
            break;
        case S_TOPK:
            if (!runner_parse_long(cmd, "top-k", optarg, 0, 1 << 24, &l))
                return 0;
            o->def.sampling.top_k = (int32_t)l;
            break;
        case S_TEMP:
            if (!runner_parse_float(cmd, "temperature", optarg, 0, 2, &o->def.sampling.temperature))
                return 0;
            break;
        case S_TOPP:
            if (!runner_parse_float(cmd, "top-p", optarg, 1e-9, 1, &o->def.sampling.top_p))
                return 0;
            break;
        case S_MINP:
            if (!runner_parse_float(cmd, "min-p", optarg, 0, 1, &o->def.sampling.min_p))
                return 0;
            break;
        case S_REP:
            if (!runner_parse_float(cmd, "repeat-penalty", optarg, 0.01, 100,
                                    &o->def.sampling.repeat_penalty))
                return 0;
            break;
        case S_FREQ:
            if (!runner_parse_float(cmd, "frequency-penalty", optarg, -2, 2,
                                    &o->def.sampling.frequency_penalty))
                return 0;
            break;
        case S_PRES:
            if (!runner_parse_float(cmd, "presence-penalty", optarg, -2, 2,
                                    &o->def.sampling.presence_penalty))
                return 0;
            break;
        case S_SEED:
            if (!runner_parse_u64(cmd, "seed", optarg, &o->def.sampling.seed))
                return 0;
            break;
        case S_PARTS:
            if (!runner_parse_long(cmd, "partitions", optarg, 1, BATCH_PARTS_MAX, &l))
                return 0;
            o->partitions = (int)l;
            break;
        case S_MAXLINE:
            if (!runner_parse_size(cmd, "max-line", optarg, &o->max_line))
                return 0;
            break;
        case 'h':
            fputs(submit_usage, stdout);
            runner_help_exit();
        default: fputs(submit_usage, stderr); return 0;
        }
    }
    if (!o->db) {
        fprintf(stderr, "quern submit: --db is required\n%s", submit_usage);
        return 0;
    }
    if (optind >= argc) {
        fprintf(stderr, "quern submit: give at least one input FILE\n");
        return 0;
    }
    return 1;
}

#define SUBMIT_BATCH_LINES 10000       /* lines read per write transaction at most */
#define SUBMIT_BATCH_MS    1000        /* ... and milliseconds of reading */
#define SUBMIT_BATCH_BYTES (64u << 20) /* ... and payload bytes held in memory */
#define SUBMIT_WARN_LINES  20          /* bad lines reported one by one on stderr */

/* SIGINT/SIGTERM seen: stop at the next line and delete what was written. */
static volatile sig_atomic_t g_submit_signal;

static void on_submit_signal(int sig)
{
    g_submit_signal = sig;
}

/* ST_OK, or an error once SIGINT or SIGTERM has come. */
static enum status check_signal(struct err_detail *err)
{
    if (!g_submit_signal)
        return ST_OK;
    return err_set(err, ST_ERR_IO, "interrupted by %s",
                   g_submit_signal == SIGINT    ? "SIGINT"
                   : g_submit_signal == SIGXCPU ? "SIGXCPU (the CPU-time limit)"
                                                : "SIGTERM");
}

/* One line parsed and waiting for its write transaction; strings owned. */
struct pending {
    char *custom_id;  /* may be NULL for a bad line */
    char *source;     /* input file (+ archive member) */
    uint64_t line;    /* 1-based line number */
    char *payload;    /* canonical request JSON; NULL for a bad line */
    const char *code; /* error code (static text) of a bad line; NULL for a good one */
    char *msg;        /* why the line is bad */
    char *param;      /* the request field it names, or NULL */
    int part;         /* the queue it goes to (0 without --partitions) */
    int default_id;   /* custom_id is the one a line without one gets (line-N) */
};

/* custom_id -> part, so that a repeated id lands in the part that has it, whose queue then
 * reports the duplicate as with one file (open addressing, keys owned). */
struct id_map {
    char **key;   /* NULL for an empty slot */
    int *part;    /* part of each key */
    size_t cap;   /* slots, a power of two */
    size_t n;     /* keys */
};

static uint64_t id_hash(const char *k)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *k; k++)
        h = (h ^ (unsigned char)*k) * 1099511628211ull;
    return h;
}

/* The slot of k: where it is, or the empty one where it would go. */
static size_t id_slot(const struct id_map *m, const char *k)
{
    size_t i = (size_t)id_hash(k) & (m->cap - 1);
    while (m->key[i] && strcmp(m->key[i], k))
        i = (i + 1) & (m->cap - 1);
    return i;
}

/* Double the table (or make the first one). 0 when out of memory. */
static int id_grow(struct id_map *m)
{
    struct id_map g = {0};
    g.cap = m->cap ? m->cap * 2 : 1024;
    g.key = calloc(g.cap, sizeof(*g.key));
    g.part = calloc(g.cap, sizeof(*g.part));
    if (!g.key || !g.part) {
        free(g.key);
        free(g.part);
        return 0;
    }
    for (size_t i = 0; i < m->cap; i++)
        if (m->key[i]) {
            size_t j = id_slot(&g, m->key[i]);
            g.key[j] = m->key[i];
            g.part[j] = m->part[i];
        }
    g.n = m->n;
    free(m->key);
    free(m->part);
    *m = g;
    return 1;
}

static void id_map_free(struct id_map *m)
{
    for (size_t i = 0; i < m->cap; i++)
        free(m->key[i]);
    free(m->key);
    free(m->part);
    memset(m, 0, sizeof(*m));
}

struct submit_stats {
    long lines; /* lines read */
    long blank; /* blank lines skipped */
    long ok;    /* queued items */
    long bad;   /* failed items */
};

/* The state of one submit. */
struct submit {
    const struct submit_opts *o; /* options */
    int n_parts;                 /* queues written: 1, or --partitions */
    struct queue **q;            /* each part's queue (one without --partitions) */
    int64_t *job;                /* the job being written (not ready) in each */
    int64_t *run;                /* its submit run in each */
    double *load;                /* estimated tokens dealt to each part */
    struct id_map ids;           /* custom_id -> part (with --partitions) */
    struct pending *pend;        /* lines read since the last write */
    size_t n_pend;               /* used entries of pend */
    size_t cap_pend;             /* allocated entries of pend */
    size_t pend_bytes;           /* payload bytes in pend */
    long batch_lines;            /* lines read since the last write, blank ones too */
    long valid;                  /* requests read (written or pending) */
    double batch_t0;             /* runner_now() at the last write */
    struct submit_stats ss;      /* counts so far */
    long objects;                /* lines that were JSON objects (valid requests or not) */
    long too_long;               /* lines longer than --max-line (not read) */
    int lock_fd;                 /* with --partitions: the directory's submit lock, or -1 */
    cJSON *inputs;               /* with --partitions: the lines' sources in input order (the
                                    catalogue keeps them: `export --order input` merges by them) */
    cJSON *last_input;           /* the last of them */
};

static void pending_clear(struct submit *s)
{
    for (size_t i = 0; i < s->n_pend; i++) {
        free(s->pend[i].custom_id);
        free(s->pend[i].source);
        free(s->pend[i].payload);
        free(s->pend[i].msg);
        free(s->pend[i].param);
    }
    s->n_pend = 0;
    s->pend_bytes = 0;
}

/* The part a line goes to: the one that has its custom_id already, else the one with the
 * fewest estimated tokens so far (ties to the lowest index); est is added to its load. -1 when
 * out of memory. */
static int route(struct submit *s, const char *custom_id, double est)
{
    if (s->n_parts == 1)
        return 0;
    int best = 0;
    for (int k = 1; k < s->n_parts; k++)
        if (s->load[k] < s->load[best])
            best = k;
    if (custom_id && *custom_id) {
        if (s->ids.n * 2 >= s->ids.cap && !id_grow(&s->ids))
            return -1;
        size_t i = id_slot(&s->ids, custom_id);
        if (s->ids.key[i]) {
            best = s->ids.part[i];
        } else {
            if (!(s->ids.key[i] = strdup(custom_id)))
                return -1;
            s->ids.part[i] = best;
            s->ids.n++;
        }
    }
    s->load[best] += est;
    return best;
}

/* Queue a line for the next write, copying custom_id, source and msg and taking payload; est is
 * its estimated tokens, for dealing lines out to parts. */
static enum status pending_add(struct submit *s, const char *custom_id, const char *source,
                               uint64_t line, char *payload, const char *code, const char *msg,
                               const char *param, double est, struct err_detail *err)
{
    int part = route(s, custom_id, est);
    if (part < 0) {
        free(payload);
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    }
    if (s->n_pend == s->cap_pend) {
        size_t ncap = s->cap_pend ? s->cap_pend * 2 : 256;
        struct pending *t = realloc(s->pend, ncap * sizeof(*t));
        if (!t) {
            free(payload);
            return err_set(err, ST_ERR_NOMEM, "out of memory");
        }
        s->pend = t;
        s->cap_pend = ncap;
    }
    struct pending *p = &s->pend[s->n_pend++];
    p->custom_id = custom_id && *custom_id ? strdup(custom_id) : NULL;
    p->source = strdup(source);
    p->line = line;
    p->payload = payload;
    p->code = code;
    p->msg = msg ? strdup(msg) : NULL;
    p->param = param && *param ? strdup(param) : NULL;
    p->part = part;
    p->default_id = 0;
    s->pend_bytes += payload ? strlen(payload) : 0;
    if ((custom_id && *custom_id && !p->custom_id) || !p->source || (msg && !p->msg) ||
        (param && *param && !p->param))
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    return ST_OK;
}

/* Record one bad line as a failed item; report the first SUBMIT_WARN_LINES of them. */
static enum status add_failed(struct submit *s, int part, const char *custom_id, const char *source,
                              uint64_t line, const char *code, const char *msg, const char *param,
                              struct err_detail *err)
{
    struct queue_item_spec it = {0};
    it.error_param = param;
    it.custom_id = custom_id;
    it.source = source;
    it.line_no = (int64_t)line;
    it.error_code = code;
    it.error_msg = msg;
    enum status st = queue_item_add(s->q[part], s->job[part], &it, NULL, err);
    if (st == ST_ERR_EXISTS) { /* the id belongs to another line: keep this one anonymous */
        it.custom_id = NULL;
        st = queue_item_add(s->q[part], s->job[part], &it, NULL, err);
    }
    if (!st && ++s->ss.bad <= SUBMIT_WARN_LINES)
        LOG_WARN("%s:%llu: %s: %s", source, (unsigned long long)line, code, msg);
    return st;
}

/* Write one pending line as a queued item, or a failed one. */
static enum status write_pending(struct submit *s, const struct pending *p,
                                 struct err_detail *err)
{
    if (p->code)
        return add_failed(s, p->part, p->custom_id, p->source, p->line, p->code, p->msg, p->param,
                          err);
    struct queue_item_spec it = {0};
    it.custom_id = p->custom_id;
    it.source = p->source;
    it.line_no = (int64_t)p->line;
    it.payload = p->payload;
    enum status st = queue_item_add(s->q[p->part], s->job[p->part], &it, NULL, err);
    if (st == ST_ERR_EXISTS) {
        char msg[800];
        if (p->default_id) /* (the user never wrote this id: another line did) */
            snprintf(msg, sizeof(msg),
                     "the line has no custom_id, and the one it gets by default, '%.600s', is "
                     "another line's: give it a custom_id",
                     p->custom_id);
        else
            snprintf(msg, sizeof(msg),
                     "duplicate custom_id '%.600s' (the first line with it is kept)", p->custom_id);
        if (s->o->strict)
            return err_set(err, ST_ERR_INVALID_ARG, "%s:%llu: %s (--strict)", p->source,
                           (unsigned long long)p->line, msg);
        return add_failed(s, p->part, NULL, p->source, p->line, "duplicate_custom_id", msg,
                          "custom_id", err);
    }
    if (!st)
        s->ss.ok++;
    return st;
}

/* The run's summary as JSON text (caller frees), or NULL when out of memory. */
static char *submit_summary(const struct submit_stats *ss)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "{\"lines\":%ld,\"blank\":%ld,\"queued\":%ld,\"invalid\":%ld}",
             ss->lines, ss->blank, ss->ok, ss->bad);
    return strdup(buf);
}

/* One write transaction per part: heartbeat the submit run, add the part's pending lines, and
 * when last is set publish the job (ready, submit run ended). */
static enum status submit_write(struct submit *s, int last, struct err_detail *err)
{
    enum status st = ST_OK;
    for (int k = 0; !st && k < s->n_parts; k++) {
        if ((st = queue_tx_begin(s->q[k], err)))
            break;
        st = queue_run_heartbeat(s->q[k], s->run[k], err);
        for (size_t i = 0; !st && i < s->n_pend; i++)
            if (s->pend[i].part == k)
                st = write_pending(s, &s->pend[i], err);
        if (!st && last) {
            char *sum = submit_summary(&s->ss);
            st = sum ? queue_job_publish(s->q[k], s->job[k], sum, err)
                     : err_set(err, ST_ERR_NOMEM, "out of memory");
            free(sum);
        }
        if (!st)
            st = queue_tx_commit(s->q[k], err);
        if (st)
            queue_tx_rollback(s->q[k]);
    }
    pending_clear(s);
    s->batch_lines = 0;
    s->batch_t0 = runner_now();
    return st;
}

/* The model's path and the output root go into JSON (manifests, status --json, records'
 * model) and onto terminals: valid UTF-8 without control characters, else refused (1: fine). */
static int text_path_ok(const char *what, const char *path)
{
    const unsigned char *p = (const unsigned char *)path;
    size_t n = strlen(path);
    for (size_t i = 0; i < n;) {
        uint32_t cp = 0;
        size_t len = utf8_decode(p + i, n - i, &cp, NULL);
        if (!len || cp < 0x20 || (cp >= 0x7f && cp <= 0x9f)) {
            char shown[8192];
            LOG_ERROR("%s %s: the path is not UTF-8 text without control characters (it goes into "
                      "JSON manifests and onto terminals): rename it",
                      what, log_printable(path, shown, sizeof(shown)));
            return 0;
        }
        i += len;
    }
    return 1;
}

/* Source label of a line: the file, plus the archive member when there is one; bytes of the
 * names that are not UTF-8 (a Latin-1 file name, a zip tool's CP437 member) as %XX, for the
 * JSON they go into. */
static void source_label(const struct io_input_pos *pos, char *buf, size_t cap)
{
    char path[4200], member[4200];
    utf8_escape_bad(pos->path, path, sizeof(path));
    utf8_escape_bad(pos->member ? pos->member : "", member, sizeof(member));
    int n =
        pos->member ? snprintf(buf, cap, "%s:%s", path, member) : snprintf(buf, cap, "%s", path);
    if (n >= (int)cap && cap <= sizeof(path)) { /* (cut: mend a character cut in two) */
        memcpy(path, buf, cap);
        utf8_escape_bad(path, buf, cap);
    }
}

/* Parse one non-blank line into a pending item (or fail under --strict). */
static enum status submit_line(struct submit *s, const char *line, size_t len,
                               const struct io_input_pos *pos, const char *path, int multi,
                               const char *source, struct err_detail *err)
{
    /* the default custom_id names the line uniquely: "line-N" in a single plain file, with the
     * archive member ("MEMBER:line-N"), with the input ("FILE:[MEMBER:]line-N") among several
     * (two archives' members of one name gave one id, and the second line was refused as a
     * duplicate); a name too long for an id (512 bytes) is hashed */
    /* (names escaped as in source_label: the id must be the record's, which is JSON; raw, an
     * id that is not UTF-8 came back altered, and export refused the whole job) */
    char *where = NULL, defid[600], file[4200], member[4200];
    utf8_escape_bad(path, file, sizeof(file));
    utf8_escape_bad(pos->member ? pos->member : "", member, sizeof(member));
    const int in_member = pos->member != NULL;
    if (asprintf(&where, "%s%s%s%s", multi ? file : "", multi && in_member ? ":" : "", member,
                 multi || in_member ? ":" : "") < 0)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    if (strlen(where) > 400) {
        char hex[SHA256_HEX_LEN];
        sha256_buf_hex(where, strlen(where), hex);
        snprintf(where, strlen(where) + 1, "sha256-%.16s:", hex);
    }
    snprintf(defid, sizeof(defid), "%sline-%llu", where, (unsigned long long)pos->line);
    free(where);
    struct job_defaults d = s->o->def;
    d.default_id = defid;
    struct job_request *r = NULL;
    struct job_error je = {0};
    enum status st = job_request_parse(line, len, &d, &r, &je);
    if (st == ST_ERR_NOMEM)
        return err_set(err, st, "out of memory parsing %s:%llu", source,
                       (unsigned long long)pos->line);
    /* (a line that is no JSON object at all: the input may not be JSONL) */
    s->objects += !st || je.is_object;
    if (st) {
        if (s->o->strict)
            return err_set(err, ST_ERR_INVALID_ARG, "%s:%llu: %s: %s (--strict)", source,
                           (unsigned long long)pos->line, job_err_code_str(je.code), je.message);
        return pending_add(s, je.custom_id, source, pos->line, NULL, job_err_code_str(je.code),
                           je.message, je.field, 1, err);
    }
    char *payload = job_request_to_json(r);
    /* what the line will cost a run: its prompt (about 4 bytes a token) and its outputs */
    double est = payload ? (double)strlen(payload) / 4 + (double)r->max_tokens * r->n : 0;
    st = payload
             ? pending_add(s, r->custom_id, source, pos->line, payload, NULL, NULL, NULL, est, err)
             : err_set(err, ST_ERR_NOMEM, "out of memory");
    s->valid += !st;
    if (!st)
        s->pend[s->n_pend - 1].default_id = !strcmp(r->custom_id, defid);
    job_request_free(r);
    return st;
}

static enum status submit_file(struct submit *s, const char *path, int multi,
                               struct err_detail *err)
{
    struct io_input *in;
    struct stat before;
    const int regular = !stat(path, &before) && S_ISREG(before.st_mode);
    enum status st = io_input_open(&in, path, s->o->max_line, err);
    if (st)
        return st;
    for (;;) {
        const char *line;
        size_t len;
        struct io_input_pos pos;
        char source[1024];
        if ((st = check_signal(err)))
            break;
        st = io_input_next(in, &line, &len, &pos, err);
        if (st == IO_INPUT_END) {
            /* a file cut, replaced or still being written while it was read: what was read is
             * not the file (a truncated one read "completely", the rest never submitted) */
            struct stat after;
            st = ST_OK;
            if (regular &&
                (stat(path, &after) || after.st_ino != before.st_ino ||
                 after.st_size != before.st_size || after.st_mtim.tv_sec != before.st_mtim.tv_sec ||
                 after.st_mtim.tv_nsec != before.st_mtim.tv_nsec))
                st = err_set(err, ST_ERR_IO,
                             "%s changed while it was read (cut, replaced or still being "
                             "written): submit it once it is complete",
                             path);
            break;
        }
        if (st != ST_OK && st != ST_ERR_RANGE)
            break;
        s->ss.lines++;
        s->batch_lines++;
        source_label(&pos, source, sizeof(source));
        if (s->inputs && (!s->last_input || strcmp(s->last_input->valuestring, source))) {
            /* (each file's, each member's lines come together) */
            cJSON *label = cJSON_CreateString(source);
            if (!label || !cJSON_AddItemToArray(s->inputs, label)) {
                cJSON_Delete(label);
                st = err_set(err, ST_ERR_NOMEM, "out of memory");
                break;
            }
            s->last_input = label;
        }
        if (st == ST_ERR_RANGE) {
            if (s->o->strict)
                break;
            char msg[128]; /* (err->msg names the file and line, as the record does already) */
            snprintf(msg, sizeof(msg), "the line is longer than --max-line (%zu bytes)",
                     (size_t)s->o->max_line);
            s->too_long++;
            st = pending_add(s, NULL, source, pos.line, NULL, "line_too_long", msg, NULL, 1, err);
        } else if (job_line_blank(line, len)) {
            s->ss.blank++;
        } else {
            st = submit_line(s, line, len, &pos, path, multi, source, err);
        }
        if (st)
            break;
        if (s->batch_lines >= SUBMIT_BATCH_LINES || s->pend_bytes >= SUBMIT_BATCH_BYTES ||
            (runner_now() - s->batch_t0) * 1000 >= SUBMIT_BATCH_MS) {
            if ((st = submit_write(s, 0, err)))
                break;
        }
    }
    io_input_close(in);
    return st;
}

/* Does OUT/<name> hold another database's job (its marker, or a part's, in OUT/<name>/part-0000:
 * a plain job and a partitioned one of one name would share it)? Every run of the new job would
 * refuse to write there, so the submit is refused now (logged; 1). A marker of this submit's own
 * database (or of a part in its directory) is left to the queue, which refuses a name in use. */
static int out_claimed(const char *out_abs, const char *name, const char *db)
{
    char *db_real = realpath(db, NULL); /* (NULL: a new queue, which owns no output) */
    static const char *const subs[2] = {"", "/part-0000"};
    int claimed = 0;
    for (int i = 0; i < 2 && !claimed; i++) {
        char jdir[4400], owner[1024], mdb[4096];
        snprintf(jdir, sizeof(jdir), "%s/%s%s", out_abs, name, subs[i]);
        if (!batch_outdir_owner(jdir, owner, sizeof(owner), mdb, sizeof(mdb)))
            continue;
        const char *slash = strrchr(mdb, '/');
        const int ours = db_real && (!strcmp(mdb, db_real) ||
                                     (slash && (size_t)(slash - mdb) == strlen(db_real) &&
                                      !strncmp(mdb, db_real, strlen(db_real))));
        if (ours)
            continue;
        LOG_ERROR("%s holds the output of %s: no run of job '%s' could write there (choose "
                  "another --out or --name)",
                  jdir, owner, name);
        claimed = 1;
    }
    free(db_real);
    return claimed;
}

/* Record the submit run and the (not ready) job in one short transaction per part. */
static enum status submit_begin(struct submit *s, const struct queue_job_spec *spec,
                                const struct proc_identity *self, struct err_detail *err)
{
    struct queue_run_spec rs = {0};
    rs.host = self->host;
    rs.pid = self->pid;
    rs.boot_id = self->boot_id;
    rs.pid_ns = self->pid_ns;
    rs.pstart = self->start_ticks;
    rs.submit = true;
    enum status st = ST_OK;
    for (int k = 0; !st && k < s->n_parts; k++) {
        struct queue_job_spec js = *spec;
        st = queue_tx_begin(s->q[k], err);
        if (!st)
            st = queue_run_start(s->q[k], &rs, &s->run[k], err);
        js.submit_run = s->run[k];
        if (!st)
            st = queue_job_create(s->q[k], &js, &s->job[k], err);
        if (!st)
            st = queue_tx_commit(s->q[k], err);
        if (st) {
            queue_tx_rollback(s->q[k]);
            s->run[k] = s->job[k] = 0;
        }
    }
    s->batch_t0 = runner_now();
    return st;
}

/* The queues: one file, or with --partitions the parts of a new directory (each created). */
static enum status submit_open(struct submit *s, struct batch_parts *parts,
                               struct err_detail *err)
{
    s->n_parts = s->o->partitions ? s->o->partitions : 1;
    s->q = calloc((size_t)s->n_parts, sizeof(*s->q));
    s->job = calloc((size_t)s->n_parts, sizeof(*s->job));
    s->run = calloc((size_t)s->n_parts, sizeof(*s->run));
    s->load = calloc((size_t)s->n_parts, sizeof(*s->load));
    if (!s->q || !s->job || !s->run || !s->load)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    if (!s->o->partitions)
        return queue_open(&s->q[0], s->o->db, err);
    enum status st =
        batch_parts_create(s->o->db, s->o->name, s->n_parts, parts, &s->lock_fd, err);
    for (int k = 0; !st && k < s->n_parts; k++)
        st = batch_parts_open(parts, k, 0, BATCH_PART_CREATE, &s->q[k], err);
    return st;
}

/* A failed submit: each part's partial job deleted; with --partitions, the part files too, and
 * the catalogue if it was written (its directory's fsync failed). They are this submit's own:
 * batch_parts_create found none of their names taken, and the directory's submit lock, still
 * held, keeps other submits out. */
static void submit_undo(struct submit *s, const struct batch_parts *parts)
{
    for (int k = 0; k < s->n_parts && s->q && s->job; k++) {
        struct err_detail e2 = {0};
        enum status dst = s->job[k] ? queue_job_discard(s->q[k], s->job[k],
                                                        g_submit_signal ? "interrupted" : "failed",
                                                        NULL, &e2)
                                    : ST_OK;
        if (dst && dst != ST_ERR_NOT_FOUND) /* not found: deleted already, as dead */
            LOG_WARN("deleting the partial job %lld: %s (it is not ready, so no run takes it; "
                     "the next submit or status deletes it)",
                     (long long)s->job[k], e2.msg);
    }
    for (int k = 0; s->o->partitions && k < s->n_parts; k++) {
        char path[4200];
        queue_close(s->q[k]);
        s->q[k] = NULL;
        /* (batch_parts_create made sure that no file had these names before) */
        static const char *const sfx[] = {".db", ".db-journal", ".db-wal", ".db-shm"};
        for (size_t i = 0; i < sizeof(sfx) / sizeof(sfx[0]); i++) {
            batch_parts_path(parts, k, sfx[i], path, sizeof(path));
            unlink(path);
        }
    }
    if (s->o->partitions) {
        char cat[4200];
        snprintf(cat, sizeof(cat), "%s/%s", parts->dir, BATCH_PARTS_CATALOG);
        unlink(cat);
    }
}

/* SIGINT and SIGTERM stop the submit at the next line; a second one kills it (the job it
 * leaves behind is not ready, and the next submit, run or status deletes it). */
static void submit_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_submit_signal;
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGXCPU, &sa, NULL); /* a soft CPU-time limit: stop before the hard one kills */
}

int runner_cmd_submit(int argc, char **argv)
{
    struct submit_opts o;
    if (!parse_submit(argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    struct err_detail err = {0};
    /* archive member names as libarchive gives them: in the C locale a zip's UTF-8 name
     * ("café.jsonl") cannot be converted and the member could not be read (C.UTF-8 changes no
     * other behaviour here: its ctype and numbers are C's for ASCII) */
    setlocale(LC_CTYPE, "C.UTF-8");
    /* the inputs first: a typo fails at once, before the model is hashed or the queue made */
    for (int i = optind; i < argc; i++) {
        if (!strcmp(argv[i], "-"))
            argv[i] = (char *)"/dev/stdin";
        if (io_input_check(argv[i], &err)) {
            LOG_ERROR("%s", err.msg);
            return RUNNER_EXIT_ERROR;
        }
    }
    struct submit s;
    memset(&s, 0, sizeof(s));
    if (o.partitions && !(s.inputs = cJSON_CreateArray())) {
        LOG_ERROR("out of memory");
        return RUNNER_EXIT_ERROR;
    }
    s.o = &o;
    s.lock_fd = -1;
    char sha[SHA256_HEX_LEN], name[64];
    int rc = RUNNER_EXIT_ERROR;
    /* hashed before any queue file is made (an interrupted or failed submit leaves nothing),
     * unless the queue already knows the file as it is now (queue_model_sha_peek) */
    struct stat msb;
    if (stat(o.model, &msb)) {
        LOG_ERROR("model: %s: %s", o.model, strerror(errno));
        return RUNNER_EXIT_ERROR;
    }
    if (!S_ISREG(msb.st_mode)) { /* (/dev/zero or a FIFO would be read forever) */
        LOG_ERROR("model: %s: not a regular file", o.model);
        return RUNNER_EXIT_ERROR;
    }
    struct file_version mver;
    file_version_of(&msb, &mver);
    char *model_real = realpath(o.model, NULL); /* (as runs record and look it up) */
    int known = model_real && !o.partitions && queue_model_sha_peek(o.db, model_real, sha);
    free(model_real);
    if (!known && sha256_file(o.model, SHA256_WHOLE_FILE, sha, &err)) {
        LOG_ERROR("model: %s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    if (!o.name) {
        time_t t = time(NULL);
        struct tm tm;
        gmtime_r(&t, &tm);
        snprintf(name, sizeof(name), "job-%04d%02d%02d-%02d%02d%02d-%d", tm.tm_year + 1900,
                 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)getpid());
        o.name = name;
    }
    /* record the model by absolute path so runs started elsewhere find it */
    char *model_abs = realpath(o.model, NULL);
    if (!model_abs) {
        LOG_ERROR("model %s: %s", o.model, strerror(errno));
        return RUNNER_EXIT_ERROR;
    }
    o.model = model_abs;
    char out_abs[4096] = "";
    if (!text_path_ok("model", o.model) || (!batch_abspath(o.out, out_abs, sizeof(out_abs), &err) &&
                                            !text_path_ok("--out", out_abs))) {
        free(model_abs);
        return RUNNER_EXIT_ERROR;
    }
    if (out_abs[0] && out_claimed(out_abs, o.name, o.db)) {
        free(model_abs);
        return RUNNER_EXIT_ERROR;
    }
    char *params = job_params_to_json(&o.def);
    struct batch_parts parts;
    memset(&parts, 0, sizeof(parts));
    if (!params || submit_open(&s, &parts, &err)) {
        LOG_ERROR("%s", params ? err.msg : "out of memory");
        if (params && o.partitions && parts.n) /* parts made before the failure */
            submit_undo(&s, &parts);
        goto out;
    }
    /* every part (each part's runs look there) */
    for (int k = 0; !known && k < s.n_parts; k++)
        queue_model_sha_note(s.q[k], o.model, &mver, sha);
    /* a killed submit's job may hold the name we want: collect dead submits first */
    struct proc_identity self;
    proc_identity_self(&self);
    int64_t n_gc = 0;
    if (queue_jobs_gc(s.q[0], &self, QUEUE_DEFAULT_SUBMIT_STALE_MS, &n_gc, &err))
        LOG_WARN("deleting the jobs of dead submits: %s", err.msg);
    else if (n_gc)
        LOG_INFO("deleted %lld unfinished job(s) left by dead submits", (long long)n_gc);
    submit_signals();
    /* the output root is stored absolute: runs started anywhere write to the same place */
    if (batch_abspath(o.out, out_abs, sizeof(out_abs), &err)) {
        LOG_ERROR("--out: %s", err.msg);
        if (o.partitions)
            submit_undo(&s, &parts);
        goto out;
    }
    struct queue_job_spec js = {o.name, o.model, sha, params, out_abs, o.def.sampling.seed, 0};
    enum status st = submit_begin(&s, &js, &self, &err);
    for (int i = optind; !st && i < argc; i++)
        st = submit_file(&s, argv[i], argc - optind > 1, &err);
    /* an input none of whose lines is a JSON object is not JSONL: refused (its lines written
     * first, for their messages); one whose objects are all bad requests is a job of failed
     * items, as any bad line is (an inbox must not retry such a file forever) */
    if (!st && !s.valid && !s.objects && s.ss.lines > s.ss.blank &&
        !(st = submit_write(&s, 0, &err))) {
        char longer[96] = "";
        if (s.too_long)
            snprintf(longer, sizeof(longer), ", %ld of them longer than --max-line", s.too_long);
        st = err_set(&err, ST_ERR_FORMAT,
                     "no line of the input is a JSON object (%ld invalid%s, see above): JSONL is "
                     "one JSON object per line, each ended by \\n or \\r\\n (a pretty-printed "
                     "JSON array, or a file with \\r alone at line ends, is not)",
                     s.ss.lines - s.ss.blank, longer);
    }
    if (!st && !s.valid && s.objects && !(st = submit_write(&s, 0, &err)) &&
        !(st = check_signal(&err)))
        LOG_WARN("no line of the input is a valid request (%ld invalid, see above): every "
                 "item of the job is a failed one",
                 s.ss.lines - s.ss.blank);
    if (!st && !s.valid && !s.objects && !(st = check_signal(&err)))
        LOG_WARN("the input holds no request (%s): the job is empty, and done",
                 s.ss.lines ? "only blank lines" : "no lines");
    if (!st && !(st = check_signal(&err)))
        st = submit_write(&s, 1, &err);
    if (!st && o.partitions)
        st = batch_parts_publish(&parts, s.inputs, &err);
    pending_clear(&s);
    free(s.pend);
    if (s.ss.bad > SUBMIT_WARN_LINES)
        LOG_WARN("%ld more bad lines not shown (each is a failed item with its line number)",
                 s.ss.bad - SUBMIT_WARN_LINES);
    if (st) {
        LOG_ERROR("%s", err.msg);
        submit_undo(&s, &parts);
        LOG_ERROR("nothing was submitted");
        goto out;
    }
    if (o.partitions) {
        printf("%s\n", o.db);
        fprintf(stderr, "quern submit: job '%s' in %d parts (%s): %ld lines, %ld queued, %ld invalid",
                o.name, s.n_parts, o.db, s.ss.lines, s.ss.ok, s.ss.bad);
    } else {
        printf("%lld\n", (long long)s.job[0]);
        fprintf(stderr, "quern submit: job %lld '%s': %ld lines, %ld queued, %ld invalid",
                (long long)s.job[0], o.name, s.ss.lines, s.ss.ok, s.ss.bad);
    }
    if (s.ss.blank)
        fprintf(stderr, ", %ld blank lines skipped", s.ss.blank);
    fputc('\n', stderr);
    if (o.partitions) {
        fprintf(stderr, "quern submit: estimated tokens per part:");
        for (int k = 0; k < s.n_parts; k++)
            fprintf(stderr, " %.0f", s.load[k]);
        fputc('\n', stderr);
    }
    rc = RUNNER_EXIT_OK;
out:
    free(params);
    free(model_abs);
    for (int k = 0; s.q && k < s.n_parts; k++)
        queue_close(s.q[k]);
    free(s.q);
    free(s.job);
    free(s.run);
    free(s.load);
    id_map_free(&s.ids);
    cJSON_Delete(s.inputs);
    if (s.lock_fd >= 0)
        close(s.lock_fd); /* after the parts are closed: the directory is released last */
    return rc;
}
