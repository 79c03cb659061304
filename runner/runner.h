/* The `quern` command line: one function per subcommand, plus the option helpers they share.
 * Each subcommand returns the process exit code (0 ok, 1 error, 2 usage). */
#ifndef RUNNER_RUNNER_H
#define RUNNER_RUNNER_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#define RUNNER_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define RUNNER_EXIT_OK 0
#define RUNNER_EXIT_ERROR 1
#define RUNNER_EXIT_USAGE 2

int runner_cmd_generate(int argc, char **argv);
int runner_cmd_tokenize(int argc, char **argv);
int runner_cmd_info(int argc, char **argv);
int runner_cmd_bench(int argc, char **argv);
int runner_cmd_plan(int argc, char **argv);
int runner_cmd_perplexity(int argc, char **argv);
int runner_cmd_submit(int argc, char **argv);
int runner_cmd_run(int argc, char **argv);
int runner_cmd_status(int argc, char **argv);
int runner_cmd_export(int argc, char **argv);
int runner_cmd_cancel(int argc, char **argv);
int runner_cmd_retry(int argc, char **argv);
int runner_cmd_report(int argc, char **argv);

/* Strict number parsing for flag values: the whole string must be a number in [lo, hi].
 * On failure prints "quern NAME: bad value for --FLAG: ..." to stderr and returns 0. */
int runner_parse_long(const char *cmd, const char *flag, const char *s, long lo, long hi,
                      long *out);
int runner_parse_u64(const char *cmd, const char *flag, const char *s, uint64_t *out);
int runner_parse_float(const char *cmd, const char *flag, const char *s, double lo, double hi,
                       float *out);

/* --matmul MODE: "exact", "q8" or "q16" into *out (an enum kern_act); 0 and a message on
 * anything else. kern_act_name gives the name back. */
int runner_parse_matmul(const char *cmd, const char *s, int *out);

/* --kv-dtype f16|q8 into *out (an enum kern_kv_dtype); 0 and a message on anything else.
 * kern_kv_dtype_name gives the name back. */
int runner_parse_kv_dtype(const char *cmd, const char *s, int *out);

/* --chat-template NAME: 1 when it names one of ENGINE_CHAT_NAMES; 0 and a message otherwise. */
int runner_chat_template_ok(const char *cmd, const char *name);

/* An output file of export, report or --metrics-file must not be a file quern keeps: the queue
 * at db (its file, -wal, -shm or -journal; any file in a partitioned queue's directory) or a
 * name quern uses in a job's output directory (one holding the job marker, or a part's
 * directory under one): manifest.json, results-*, errors-*, part-*, hidden files. Standard
 * streams and devices ("-", /dev/...) are fine. 1 when out is fine, else 0 after a message
 * "quern CMD: ..." on stderr. With makes_job_dirs (run, which makes job directories as it goes)
 * the names manifest.json, results-*, errors-* and part-* are refused wherever they are. */
int runner_out_file_ok(const char *cmd, const char *flag, const char *out, const char *db,
                       int makes_job_dirs);

/* Byte sizes like "2G", "512M", "1.5GiB", "65536" (K/M/G/T are powers of 1024). */
int runner_parse_size(const char *cmd, const char *flag, const char *s, size_t *out);

/* Add {"p50","p90","p99"} (nearest-rank percentiles of v[0..n), which is sorted in place)
 * to the JSON object o under name. Declared with an opaque pointer so callers need cJSON only
 * where they use it. */
struct cJSON;
void runner_add_percentiles(struct cJSON *o, const char *name, double *v, size_t n);
/* Speculative decoding's numbers from es as o's "spec" object (nothing when speculation is off,
 * on 0; zeros where it is on and nothing was drafted yet): steps that verified drafts and steps the
 * load skipped, draft tokens verified and accepted, acceptance, accepted tokens per sequence
 * verification, verified draft tokens per step (the budget), acceptance per draft position,
 * survival ECE, drafting seconds. */
struct engine_stats;
void runner_add_spec_json(struct cJSON *o, const struct engine_stats *es, int on);

/* Add id to the entry of groups ([{"engine": {...}, key: [ids]}, ...]) whose engine equals eng,
 * or to a new entry at the end; an id equal to the entry's last is not added twice. eng is taken
 * (kept or freed). 0, or -1 out of memory (groups unchanged but for a new empty entry). */
int runner_engine_group_add(struct cJSON *groups, const char *key, struct cJSON *eng, double id);

/* Print a job's "engines" (status JSON: [{"engine": {...}, "<unit>s": [ids]}]) as text: one
 * "engine: ..." line, or a count and a line per engine when they differ. unit: "run", "part". */
void runner_print_engines(const struct cJSON *engines, const char *unit);

/* One job's `quern status` object (cmd_jobs.c): counts by state, tokens, rates, ETA, the live
 * numbers of runs (runs[0..n_runs) as queue_run_list_live gave them), errors by code. NULL
 * with err set on failure; caller frees with cJSON_Delete. */
struct queue;
struct queue_job;
struct queue_run_info;
struct err_detail;
struct cJSON *runner_job_status(struct queue *q, const struct queue_job *j,
                                const struct queue_run_info *runs, size_t n_runs,
                                struct err_detail *err);

/* A partitioned queue's status (job, when given, must be its job's name), and cancel or retry
 * --failed on every part (cmd_parts.c). Exit codes. */
struct batch_parts;
int runner_parts_status(const struct batch_parts *p, const char *job, int json);
int runner_parts_steer(const struct batch_parts *p, const char *cmd, const char *job, int retry);
/* Does a run report from part k (its progress file changes within 5 s)? Stops waiting when
 * *stop becomes non-zero. */
int runner_part_run_alive(const struct batch_parts *p, int k, const volatile sig_atomic_t *stop);

/* Online CPU count (>= 1): the default for --threads. */
int runner_default_threads(void);

/* Monotonic seconds. */
double runner_now(void);

/* Read all of stdin into a malloc'd NUL-terminated buffer (caller frees); NULL on error. */
char *runner_read_stdin(size_t *len);

/* The end of a command's --help printed on stdout: exit 0, or 1 when it did not reach stdout
 * (a full disk, a closed descriptor), as main checks for every command that returns. */
__attribute__((noreturn)) void runner_help_exit(void);

/* s as a quoted JSON string (escaped as job_json_put_str does; NULL: null), malloc'd; NULL when
 * out of memory. For the JSON lines commands print with printf. */
char *runner_json_quote(const char *s);

#endif
