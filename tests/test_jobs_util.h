/* Helpers shared by the jobs/ tests (test_request.c, test_jobs.c): the job defaults the
 * tests parse against and a parse that must succeed. */
#ifndef TESTS_TEST_JOBS_UTIL_H
#define TESTS_TEST_JOBS_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobs/json.h"
#include "jobs/record.h"
#include "jobs/request.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static inline struct job_defaults defaults(void)
{
    struct job_defaults d;
    memset(&d, 0, sizeof(d));
    engine_sampling_default(&d.sampling);
    d.sampling.seed = 42;
    d.max_tokens = 256;
    d.max_tokens_cap = 4096;
    d.default_id = "line-7";
    return d;
}

#define BATCH(params) "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\"," \
                      "\"body\":{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]" params "}}"

/* The record line is strict JSON + UTF-8 by our own scanner: as an input line it fails only
 * for lacking messages/prompt, never for syntax or encoding. */
static inline void assert_strict_json(const char *line)
{
    struct job_defaults d = defaults();
    struct job_request *r;
    struct job_error e;
    enum status st = job_request_parse(line, strlen(line), &d, &r, &e);
    if (st == ST_OK)
        job_request_free(r);
    assert_int_not_equal(e.code, JOB_ERR_INVALID_JSON);
    assert_int_not_equal(e.code, JOB_ERR_INVALID_UTF8);
    for (const char *p = line; *p; p++)
        assert_true((unsigned char)*p >= 0x20);
}

#endif
