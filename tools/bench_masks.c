/* What a grammar's token masks cost: a JSON record is tokenized with the default model's
 * tokenizer and, token by token, the mask of the state after each prefix is taken from a fresh
 * grammar (cold), then the record nested one level deeper and then two (json_object: new
 * states whose top frames were seen before), then again (cached); both ways of computing masks (engine_grammar_set_mask_mode:
 * from the positions' context-free tokens, or walking the whole vocabulary trie).
 *   make build/tools/bench_masks && build/tools/bench_masks [MODEL]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/grammar.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "jobs/schema.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds per mask at every token boundary of ids (through g from its start state). */
static double pass(struct engine_grammar *g, const struct engine_tok *tok,
                   const struct engine_vocab *v, const int32_t *ids, size_t n)
{
    char piece[512];
    int32_t s = engine_grammar_start(g);
    double t0 = now();
    for (size_t i = 0; i < n && s >= 0; i++) {
        if (!engine_grammar_mask(g, s, v)) {
            fprintf(stderr, "bench_masks: out of memory\n");
            exit(1);
        }
        size_t k = engine_tok_piece(tok, ids[i], 0, piece, sizeof(piece));
        s = engine_grammar_feed(g, s, piece, k);
    }
    if (s < 0) {
        fprintf(stderr, "bench_masks: the text does not follow the grammar\n");
        exit(1);
    }
    return (now() - t0) / (double)n;
}

static int32_t *tokens(const struct engine_tok *tok, const char *text, size_t *n)
{
    int32_t *ids = NULL;
    struct err_detail err = {0};
    if (engine_tok_encode(tok, text, strlen(text), 0, &ids, n, &err)) {
        fprintf(stderr, "bench_masks: %s\n", err.msg);
        exit(1);
    }
    return ids;
}

int main(int argc, char **argv)
{
    const char *model = argc > 1 ? argv[1] : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    struct io_gguf *gf;
    struct engine_tok *tok;
    struct engine_vocab *v;
    struct err_detail err = {0};
    if (io_gguf_open(&gf, model, &err) || engine_tok_load(&tok, gf, &err) ||
        engine_vocab_new(&v, tok, engine_tok_n_vocab(tok), &err)) {
        fprintf(stderr, "bench_masks: %s\n", err.msg);
        return 1;
    }
    static const char text[] =
        "{\"name\": \"Ada Lovelace\", \"born\": 1815, \"tags\": [\"mathematics\", \"poetry\", "
        "\"engines\"], \"rating\": 4.75, \"summary\": \"Wrote the first published program, "
        "for Babbage's Analytical Engine, and saw that such machines could do more than "
        "arithmetic.\", \"notes\": {\"letters\": [{\"to\": \"Babbage\", \"year\": 1843}]}}";
    static const char schema[] =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"born\":"
        "{\"type\":\"integer\",\"minimum\":0,\"maximum\":2100},\"tags\":{\"type\":\"array\","
        "\"items\":{\"type\":\"string\"}},\"rating\":{\"type\":\"number\",\"minimum\":0},"
        "\"summary\":{\"type\":\"string\"},\"notes\":{\"type\":\"object\",\"properties\":"
        "{\"letters\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"to\":"
        "{\"type\":\"string\"},\"year\":{\"type\":\"integer\"}},\"required\":[\"to\",\"year\"],"
        "\"additionalProperties\":false}}},\"required\":[\"letters\"],"
        "\"additionalProperties\":false}},\"required\":[\"name\",\"born\",\"tags\",\"rating\","
        "\"summary\",\"notes\"],\"additionalProperties\":false}";
    /* the same record one level deeper: new states (other stacks), the same positions */
    char nested[sizeof(text) + 32], nested2[sizeof(text) + 64];
    snprintf(nested, sizeof(nested), "{\"wrap\": %s}", text);
    snprintf(nested2, sizeof(nested2), "{\"a\": [%s]}", nested);
    size_t n_a, n_b, n_c;
    int32_t *a = tokens(tok, text, &n_a), *b = tokens(tok, nested, &n_b);
    int32_t *c = tokens(tok, nested2, &n_c);
    printf("vocabulary %d; a JSON record of %zu tokens, then it nested one level deeper (%zu)\n",
           engine_tok_n_vocab(tok), n_a, n_b);
    struct engine_grammar *g;
    if (job_schema_grammar_text(JOB_FORMAT_JSON_OBJECT, NULL, &g, &err))
        return 1;
    double cold = pass(g, tok, v, a, n_a), deeper = pass(g, tok, v, b, n_b);
    double deeper2 = pass(g, tok, v, c, n_c), cached = pass(g, tok, v, c, n_c);
    printf("json_object: cold %6.1f us/mask, nested %6.1f, nested again %6.1f, cached %.2f\n",
           1e6 * cold, 1e6 * deeper, 1e6 * deeper2, 1e6 * cached);
    engine_grammar_unref(g);
    if (job_schema_grammar_text(JOB_FORMAT_JSON_SCHEMA, schema, &g, &err))
        return 1;
    cold = pass(g, tok, v, a, n_a);
    cached = pass(g, tok, v, a, n_a);
    printf("json_schema: cold %6.1f us/mask, cached %.2f\n", 1e6 * cold, 1e6 * cached);
    engine_grammar_unref(g);
    free(a);
    free(b);
    free(c);
    engine_vocab_free(v);
    engine_tok_free(tok);
    io_gguf_close(gf);
    return 0;
}
