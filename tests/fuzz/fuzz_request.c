/* libFuzzer harness for request lines (jobs/request.c), the untrusted input of `quern submit`:
 * any bytes must parse or be refused with an error code, never crash or leak; a line that
 * parses must come back from its canonical JSON (job_request_to_json) as the same request,
 * whose canonical JSON is byte-for-byte the same (what the queue stores is what runs). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"
#include "jobs/request.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct job_defaults def;
    memset(&def, 0, sizeof(def));
    engine_sampling_default(&def.sampling);
    def.max_tokens = 256;
    def.default_id = "line-1";
    struct job_request *r = NULL;
    struct job_error je;
    memset(&je, 0, sizeof(je));
    enum status st = job_request_parse((const char *)data, size, &def, &r, &je);
    if (st != ST_OK) {
        if (r || je.code == 0 || !je.message[0])
            abort(); /* a refusal has no request, and says why */
        return 0;
    }
    char *json = job_request_to_json(r);
    if (!json)
        abort();
    struct job_request *again = NULL;
    memset(&je, 0, sizeof(je));
    if (job_request_parse(json, strlen(json), &def, &again, &je) != ST_OK) {
        fprintf(stderr, "canonical JSON does not parse: %s: %s\n", je.message, json);
        abort();
    }
    char *json2 = job_request_to_json(again);
    if (!json2 || strcmp(json, json2) != 0) {
        fprintf(stderr, "canonical JSON changed:\n%s\n%s\n", json, json2 ? json2 : "(null)");
        abort();
    }
    free(json);
    free(json2);
    job_request_free(r);
    job_request_free(again);
    return 0;
}
