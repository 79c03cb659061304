/* `quern report`: one self-contained HTML file about a job (batch/report.c draws it). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "batch/batch.h"
#include "common/log.h"
#include "runner/runner.h"

static const char report_usage[] =
    "usage: quern report --db Q.db --job ID|NAME --out FILE.html [--cost-per-hour X]\n"
    "       quern report --db PARTS_DIR --out FILE.html [--cost-per-hour X]\n"
    "\n"
    "Write one self-contained HTML file about the job, all its parts and runs (inline SVG and\n"
    "CSS: no script, no network; readable printed and on a phone): summary figures, output\n"
    "tokens per second over time with run starts and killed or stopped runs marked, batch size\n"
    "and KV use over time, histograms of time to first token, time per output token, prompt\n"
    "and output lengths with P50/P90/P99, errors by code with examples, progress by part, the\n"
    "runs, and the cost. The time series comes from the samples runs record every 5 s\n"
    "(status --json's \"series\"); a part in use by a run shows only its counts. As status\n"
    "does, it first ends this host's runs whose process is gone (a killed run shows \"dead\",\n"
    "its time up to its last heartbeat).\n"
    "\n"
    "  --cost-per-hour X  cost of one run's device or node per hour (each run uses one): the\n"
    "                     cost of all runs and per million output tokens\n";

int runner_cmd_report(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"db", required_argument, 0, 'd'},  {"job", required_argument, 0, 'j'},
        {"out", required_argument, 0, 'o'}, {"cost-per-hour", required_argument, 0, 'c'},
        {"help", no_argument, 0, 'h'},      {0, 0, 0, 0},
    };
    const char *db = NULL, *job = NULL, *out = NULL;
    struct batch_report_opts ro = {0};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd':
            db = optarg;
            break;
        case 'j':
            job = optarg;
            break;
        case 'o':
            out = optarg;
            break;
        case 'c': {
            float v;
            if (!runner_parse_float("report", "cost-per-hour", optarg, 0, 1e9, &v))
                return RUNNER_EXIT_USAGE;
            ro.cost_per_hour = v;
            break;
        }
        case 'h':
            fputs(report_usage, stdout);
            return RUNNER_EXIT_OK;
        default:
            fputs(report_usage, stderr);
            return RUNNER_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern report: unexpected argument '%s'\n", argv[optind]);
        return RUNNER_EXIT_USAGE;
    }
    if (optind < argc || !db || !out || !*out || (!strcmp(out, "-") || !strncmp(out, "/dev/", 5))) {
        fprintf(stderr, "quern report: %s\n%s",
                db && out && *out ? "--out names a file (standard output is not offered)"
                                  : "--db and --out (a file name) are required",
                report_usage);
        return RUNNER_EXIT_USAGE;
    }
    if (!runner_out_file_ok("report", "out", out, db, 0))
        return RUNNER_EXIT_USAGE;
    struct stat sb;
    if (!job && !stat(db, &sb) && !S_ISDIR(sb.st_mode)) { /* a queue file: which job? */
        fprintf(stderr, "quern report: --job is required for a queue file\n%s", report_usage);
        return RUNNER_EXIT_USAGE;
    }
    struct err_detail err = {0};
    if (batch_report_write(db, job, &ro, out, &err)) {
        LOG_ERROR("%s", err.msg);
        return RUNNER_EXIT_ERROR;
    }
    fprintf(stderr, "quern report: %s\n", out);
    return RUNNER_EXIT_OK;
}
