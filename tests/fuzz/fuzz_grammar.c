/* libFuzzer harness for the grammar compilers (jobs/gbnf.c, jobs/schema.c), whose input comes
 * from request lines: the first byte picks GBNF text or a JSON schema, the rest up to the first
 * NUL is the text, the bytes after it are fed to the compiled grammar. Any text must compile or
 * be refused with a message, never crash, hang or leak; a compiled grammar must take any bytes
 * (ending dead or alive) and agree with itself: a state reached twice by the same bytes is the
 * same state, and a dead step stays dead. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jobs/schema.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 4096)
        return 0;
    const uint8_t *nul = memchr(data + 1, 0, size - 1);
    size_t tlen = nul ? (size_t)(nul - data - 1) : size - 1;
    char *text = malloc(tlen + 1);
    if (!text)
        return 0;
    memcpy(text, data + 1, tlen);
    text[tlen] = 0;
    struct engine_grammar *g = NULL;
    struct err_detail err = {0};
    enum status st = job_schema_grammar_text(data[0] & 1 ? JOB_FORMAT_JSON_SCHEMA
                                                         : JOB_FORMAT_GRAMMAR,
                                             text, &g, &err);
    free(text);
    if (st != ST_OK) {
        if (g || !err.msg[0])
            abort(); /* a refusal has no grammar, and says why */
        return 0;
    }
    const char *in = nul ? (const char *)nul + 1 : "";
    size_t n = nul ? size - (size_t)(nul - data) - 1 : 0;
    int32_t s = engine_grammar_start(g), again = engine_grammar_start(g);
    for (size_t i = 0; i < n; i++) {
        int32_t t = engine_grammar_step(g, s, (unsigned char)in[i]);
        if (engine_grammar_step(g, s, (unsigned char)in[i]) != t)
            abort(); /* transitions are a function */
        s = t;
        if (t < 0) {
            if (engine_grammar_feed(g, t, in + i, n - i) >= 0)
                abort(); /* dead stays dead */
            break;
        }
    }
    if (n && engine_grammar_feed(g, again, in, n) != s &&
        engine_grammar_n_states(g) < ENGINE_GRAMMAR_MAX_STATES)
        abort(); /* the same bytes reach the same state */
    engine_grammar_unref(g);
    return 0;
}
