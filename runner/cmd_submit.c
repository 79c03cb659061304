/* `quern submit`: read request lines from input files (JSONL, compressed, or inside
 * archives), validate each one, and insert them as one job's items in the SQLite queue.
 * A bad line becomes a failed item with its file, line number and reason; the whole submit
 * is one transaction, so an interrupted submit leaves nothing behind. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/sha256.h"
#include "engine/sampler.h"
#include "io/input.h"
#include "jobs/params.h"
#include "jobs/request.h"
#include "queue/queue.h"
#include "runner/runner.h"

static const char submit_usage[] =
    "usage: quern submit --db Q.db [options] FILE...\n"
    "\n"
    "Create a job from request lines and print its id on stdout. FILEs may be .jsonl,\n"
    ".jsonl.gz, .jsonl.zst, or .tar/.tar.gz/.tar.zst/.zip archives of .jsonl members.\n"
    "Lines: OpenAI Batch requests ({\"custom_id\",\"method\":\"POST\",\"url\":\n"
    "\"/v1/chat/completions\"|\"/v1/completions\",\"body\":{...}}) or the short forms\n"
    "{\"custom_id\"?, \"prompt\": ...} and {\"custom_id\"?, \"messages\": [...]}. A line without\n"
    "custom_id gets \"line-N\" (\"FILE:line-N\" with several inputs). Bad lines become failed\n"
    "items (reported on stderr with their line numbers) unless --strict.\n"
    "\n"
    "  --db PATH              queue database (created if missing)\n"
    "  --model PATH           GGUF model for the job (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --name NAME            job name ([A-Za-z0-9._-], not all digits; default job-<time>)\n"
    "  --out DIR              output root recorded with the job (default out)\n"
    "  --max-tokens N         default max_tokens (default 256)\n"
    "  --temperature T        default temperature (default 1, as OpenAI)\n"
    "  --top-p P, --top-k K, --min-p P, --repeat-penalty R,\n"
    "  --frequency-penalty F, --presence-penalty F   other sampling defaults\n"
    "  --seed N               job seed: each request's RNG is seeded from (seed, custom_id)\n"
    "                         unless the request gives its own seed (default 0)\n"
    "  --max-line BYTES       longest accepted line (default 16M)\n"
    "  --strict               abort (nothing inserted) at the first bad line\n"
    "  -h, --help             this help\n";

struct submit_opts {
    const char *db;            /* --db */
    const char *model;         /* --model */
    const char *name;          /* --name */
    const char *out;           /* --out */
    size_t max_line;           /* --max-line */
    int strict;                /* --strict */
    struct job_defaults def;   /* sampling defaults */
};

enum { S_DB = 256, S_MODEL, S_NAME, S_OUT, S_MAXTOK, S_TEMP, S_TOPP, S_TOPK, S_MINP, S_REP,
       S_FREQ, S_PRES, S_SEED, S_MAXLINE, S_STRICT };

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
        case S_NAME: o->name = optarg; break;
        case S_OUT: o->out = optarg; break;
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
        case S_MAXLINE:
            if (!runner_parse_size(cmd, "max-line", optarg, &o->max_line))
                return 0;
            break;
        case 'h': fputs(submit_usage, stdout); exit(RUNNER_EXIT_OK);
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

struct submit_stats {
    long lines;    /* lines read */
    long ok;       /* queued items */
    long bad;      /* failed items */
};

/* Record one bad line as a failed item and report it. */
static enum status add_failed(struct queue *q, int64_t job, const char *custom_id,
                              const char *source, uint64_t line, const char *code,
                              const char *msg, struct submit_stats *ss, struct err_detail *err)
{
    struct queue_item_spec it = {0};
    it.custom_id = custom_id && *custom_id ? custom_id : NULL;
    it.source = source;
    it.line_no = (int64_t)line;
    it.error_code = code;
    it.error_msg = msg;
    enum status st = queue_item_add(q, job, &it, NULL, err);
    if (st == ST_ERR_EXISTS) { /* the id belongs to another line: keep this one anonymous */
        it.custom_id = NULL;
        st = queue_item_add(q, job, &it, NULL, err);
    }
    if (!st) {
        ss->bad++;
        LOG_WARN("%s:%llu: %s: %s", source, (unsigned long long)line, code, msg);
    }
    return st;
}

/* Source label of a line: the file, plus the archive member when there is one. */
static void source_label(const struct io_input_pos *pos, char *buf, size_t cap)
{
    if (pos->member)
        snprintf(buf, cap, "%s:%s", pos->path, pos->member);
    else
        snprintf(buf, cap, "%s", pos->path);
}

static enum status submit_file(struct queue *q, int64_t job, const char *path, int multi,
                               const struct submit_opts *o, struct submit_stats *ss,
                               struct err_detail *err)
{
    struct io_input *in;
    enum status st = io_input_open(&in, path, o->max_line, err);
    if (st)
        return st;
    for (;;) {
        const char *line;
        size_t len;
        struct io_input_pos pos;
        char source[1024], defid[1100];
        st = io_input_next(in, &line, &len, &pos, err);
        if (st == IO_INPUT_END) {
            st = ST_OK;
            break;
        }
        if (st != ST_OK && st != ST_ERR_RANGE)
            break;
        ss->lines++;
        source_label(&pos, source, sizeof(source));
        if (st == ST_ERR_RANGE) {
            if (o->strict)
                break;
            if ((st = add_failed(q, job, NULL, source, pos.line, "line_too_long", err->msg, ss,
                                 err)))
                break;
            continue;
        }
        if (multi)
            snprintf(defid, sizeof(defid), "%s:line-%llu", pos.member ? pos.member : path,
                     (unsigned long long)pos.line);
        else
            snprintf(defid, sizeof(defid), "line-%llu", (unsigned long long)pos.line);
        struct job_defaults d = o->def;
        d.default_id = defid;
        struct job_request *r = NULL;
        struct job_error je = {0};
        if (len == 0) {
            je.code = JOB_ERR_INVALID_JSON;
            snprintf(je.message, sizeof(je.message), "empty line");
            st = ST_ERR_FORMAT;
        } else {
            st = job_request_parse(line, len, &d, &r, &je);
        }
        if (st == ST_ERR_NOMEM) {
            err_set(err, st, "out of memory parsing %s:%llu", source, (unsigned long long)pos.line);
            break;
        }
        if (st) {
            if (o->strict) {
                err_set(err, ST_ERR_INVALID_ARG, "%s:%llu: %s: %s (--strict: nothing submitted)",
                        source, (unsigned long long)pos.line, job_err_code_str(je.code),
                        je.message);
                break;
            }
            if ((st = add_failed(q, job, je.custom_id, source, pos.line,
                                 job_err_code_str(je.code), je.message, ss, err)))
                break;
            continue;
        }
        char *payload = job_request_to_json(r);
        struct queue_item_spec it = {0};
        it.custom_id = r->custom_id;
        it.source = source;
        it.line_no = (int64_t)pos.line;
        it.payload = payload;
        st = payload ? queue_item_add(q, job, &it, NULL, err)
                     : err_set(err, ST_ERR_NOMEM, "out of memory");
        if (st == ST_ERR_EXISTS) {
            char msg[700];
            snprintf(msg, sizeof(msg), "duplicate custom_id '%.600s' (the first line with it is kept)",
                     r->custom_id);
            st = o->strict ? err_set(err, ST_ERR_INVALID_ARG, "%s:%llu: %s (--strict)", source,
                                     (unsigned long long)pos.line, msg)
                           : add_failed(q, job, NULL, source, pos.line, "duplicate_custom_id",
                                        msg, ss, err);
        } else if (!st) {
            ss->ok++;
        }
        free(payload);
        job_request_free(r);
        if (st)
            break;
    }
    io_input_close(in);
    return st;
}

int runner_cmd_submit(int argc, char **argv)
{
    struct submit_opts o;
    if (!parse_submit(argc, argv, &o))
        return RUNNER_EXIT_USAGE;
    struct err_detail err = {0};
    struct queue *q = NULL;
    char sha[SHA256_HEX_LEN], name[64];
    int rc = RUNNER_EXIT_ERROR;
    if (sha256_file(o.model, SHA256_WHOLE_FILE, sha, &err)) {
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
    char *params = job_params_to_json(&o.def);
    if (!params || queue_open(&q, o.db, &err) || queue_tx_begin(q, &err)) {
        LOG_ERROR("%s", params ? err.msg : "out of memory");
        goto out;
    }
    struct queue_job_spec js = {o.name, o.model, sha, params, o.out, o.def.sampling.seed};
    int64_t job = 0;
    struct submit_stats ss = {0};
    enum status st = queue_job_create(q, &js, &job, &err);
    for (int i = optind; !st && i < argc; i++)
        st = submit_file(q, job, argv[i], argc - optind > 1, &o, &ss, &err);
    if (st || (st = queue_tx_commit(q, &err))) {
        queue_tx_rollback(q);
        LOG_ERROR("%s", err.msg);
        LOG_ERROR("nothing was submitted");
        goto out;
    }
    printf("%lld\n", (long long)job);
    fprintf(stderr, "quern submit: job %lld '%s': %ld lines, %ld queued, %ld invalid\n",
            (long long)job, o.name, ss.lines, ss.ok, ss.bad);
    rc = RUNNER_EXIT_OK;
out:
    free(params);
    free(model_abs);
    queue_close(q);
    return rc;
}
