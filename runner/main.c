/* quern: offline batch LLM generation. This file dispatches to the subcommands. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "common/version.h"
#include "runner/runner.h"

static const char usage[] =
    "usage: quern <command> [options]\n"
    "\n"
    "Commands available in this build:\n"
    "  submit     create a job in an SQLite queue from JSONL request files\n"
    "  run        process queued items into zstd JSONL shards (resumable)\n"
    "  status     per-job progress, tokens, throughput, ETA, errors, runs (--watch: live)\n"
    "  report     one self-contained HTML report of a job: throughput, load, latency, errors\n"
    "  export     a job's records as .jsonl/.jsonl.zst, or a .tar/.tar.zst bundle\n"
    "  cancel     cancel a job's remaining items\n"
    "  retry      re-queue a job's failed items\n"
    "  generate   run one prompt through a model and print the completion\n"
    "  tokenize   print the token ids of text read from stdin as a JSON array\n"
    "  info       print a GGUF model's metadata, tensors and sizes\n"
    "  bench      offline throughput benchmark (continuous batching), JSON on stdout\n"
    "  plan       memory plan: weights, KV bytes per token, how many sequences fit\n"
    "  perplexity a model's perplexity on a text file (llama.cpp's method or sliding windows)\n"
    "\n"

    "Run 'quern <command> --help' for a command's options; 'quern --version' says which quern\n"
    "this is.\n";

/* --version: the source revision and what this binary can run on. */
static int version(void)
{
    printf("quern %s\n", quern_version());
#ifdef QUERN_CUDA
    puts("CUDA backend: built in (`quern info` lists the devices it finds)");
#else
    puts("CUDA backend: not built in");
#endif
    return RUNNER_EXIT_OK;
}

static int dispatch(int argc, char **argv);

/* What a command printed on standard output must have reached it: a full disk or a closed
 * descriptor (`status --json >/dev/full`, a submit's job id) is an error, not exit 0. */
/* Limits a shared node's shell may have set low: a stack below what the kernels keep on it
 * (tiles of up to 256 KiB: `ulimit -s 256` crashed a run) is raised within the hard limit, or
 * refused; open files are raised to the hard limit (a queue of many parts holds two each);
 * a file-size limit makes writes fail with EFBIG, which the I/O paths report, instead of
 * SIGXFSZ killing the process silently mid-commit. 0, or -1 after a message. */
static int settle_limits(void)
{
    const rlim_t need = (rlim_t)1 << 20, want = (rlim_t)8 << 20;
    struct rlimit rl;
    if (!getrlimit(RLIMIT_STACK, &rl) && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
        setrlimit(RLIMIT_STACK, &rl);
        if (rl.rlim_cur < need) {
            fprintf(stderr,
                    "quern: the stack limit (ulimit -s) is %llu KiB, and cannot be raised to "
                    "the 1024 KiB quern needs\n",
                    (unsigned long long)(rl.rlim_cur >> 10));
            return -1;
        }
    }
    if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGXFSZ, SIG_IGN);
    if (!getrlimit(RLIMIT_FSIZE, &rl) && rl.rlim_cur != RLIM_INFINITY)
        fprintf(stderr,
                "quern warn: a file-size limit (ulimit -f) of %llu KiB: the queue, shards or "
                "exports growing past it fail to write (\"disk I/O error\")\n",
                (unsigned long long)(rl.rlim_cur >> 10));
    return 0;
}

int main(int argc, char **argv)
{
    if (settle_limits())
        return RUNNER_EXIT_ERROR;
    int rc = dispatch(argc, argv);
    errno = 0;
    if ((fflush(stdout) || ferror(stdout)) && rc == RUNNER_EXIT_OK) {
        fprintf(stderr,
                "quern: writing standard output: %s (the command itself is done: only "
                "what it printed is lost)\n",
                errno ? strerror(errno) : "write error");
        rc = RUNNER_EXIT_ERROR;
    }
    return rc;
}

static int dispatch(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "help")) { /* quern help CMD: CMD's help */
        if (!strcmp(argv[2], "version") || !strcmp(argv[2], "--version"))
            return version();
        if (!strcmp(argv[2], "help") || !strcmp(argv[2], "--help") || !strcmp(argv[2], "-h")) {
            fputs(usage, stdout);
            return RUNNER_EXIT_OK;
        }
        char *av[] = {argv[0], argv[2], "--help", NULL};
        return dispatch(3, av);
    }
    if (argc < 2 ||
        ((!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) &&
         argc == 2)) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? RUNNER_EXIT_USAGE : RUNNER_EXIT_OK;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        if (argc > 2) {
            fprintf(stderr, "quern: unexpected argument '%s'\n", argv[2]);
            return RUNNER_EXIT_USAGE;
        }
        return version();
    }
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        fprintf(stderr, "quern: unexpected argument '%s' (quern help COMMAND: its help)\n",
                argv[argc - 1]);
        return RUNNER_EXIT_USAGE;
    }
    if (!strcmp(cmd, "submit"))
        return runner_cmd_submit(argc - 1, argv + 1);
    if (!strcmp(cmd, "run"))
        return runner_cmd_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "status"))
        return runner_cmd_status(argc - 1, argv + 1);
    if (!strcmp(cmd, "report"))
        return runner_cmd_report(argc - 1, argv + 1);
    if (!strcmp(cmd, "export"))
        return runner_cmd_export(argc - 1, argv + 1);
    if (!strcmp(cmd, "cancel"))
        return runner_cmd_cancel(argc - 1, argv + 1);
    if (!strcmp(cmd, "retry"))
        return runner_cmd_retry(argc - 1, argv + 1);
    if (!strcmp(cmd, "generate"))
        return runner_cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize"))
        return runner_cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "info"))
        return runner_cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench"))
        return runner_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "plan"))
        return runner_cmd_plan(argc - 1, argv + 1);
    if (!strcmp(cmd, "perplexity"))
        return runner_cmd_perplexity(argc - 1, argv + 1);
    fprintf(stderr, "quern: unknown command '%s'\n%s", cmd, usage);
    return RUNNER_EXIT_USAGE;
}
