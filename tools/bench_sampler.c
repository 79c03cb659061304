/* Per-row cost of the sampler on a language-model-shaped logit row (a normal bulk plus a few
 * strong tokens), for each common sampling setting: `make build/tools/bench_sampler &&
 * build/tools/bench_sampler [n_vocab]`. Prints microseconds per row (the row copy each draw
 * needs is measured apart and subtracted) and how the nucleus rows were decided. The sampler
 * runs once per generated token, so compare with the forward pass's time per token. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/sampler.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const int n = argc > 1 ? atoi(argv[1]) : 49152;
    if (n <= 0) {
        fprintf(stderr, "usage: bench_sampler [n_vocab > 0]\n");
        return 2;
    }
    float *base = malloc((size_t)n * sizeof(float)), *row = malloc((size_t)n * sizeof(float));
    struct engine_sampler *s = NULL;
    struct err_detail err = {0};
    if (!base || !row || engine_sampler_init(&s, n, &err)) {
        fprintf(stderr, "bench_sampler: out of memory\n");
        return 1;
    }
    struct engine_rng g;
    engine_rng_seed(&g, 1, "row", 3);
    for (int i = 0; i < n; i++) { /* sum of four uniforms: a normal-ish bulk, sd ~4.6 */
        double u = 0.0;
        for (int k = 0; k < 4; k++)
            u += engine_rng_uniform(&g);
        base[i] = (float)((u - 2.0) * 8.0);
    }
    for (int j = 0; j < 20; j++) /* the strong tokens */
        base[(size_t)j * 7919 % (size_t)n] += 12.0f + 0.3f * (float)j;
    const struct {
        const char *name;
        float t, top_p, min_p;
        int32_t top_k;
    } cfg[] = {
        {"greedy", 0.0f, 1.0f, 0.0f, 0},           {"temperature 0.8", 0.8f, 1.0f, 0.0f, 0},
        {"T 0.8, top_p 0.95", 0.8f, 0.95f, 0.0f, 0}, {"T 1.0, top_p 0.9", 1.0f, 0.9f, 0.0f, 0},
        {"T 0.7, top_k 40", 0.7f, 1.0f, 0.0f, 40},   {"T 1.0, min_p 0.05", 1.0f, 1.0f, 0.05f, 0},
    };
    const int rows = 2000;
    struct engine_rng r;
    engine_rng_seed(&r, 1, "draws", 5);
    printf("vocabulary %d, %d rows per setting\n", n, rows);
    for (size_t c = 0; c < sizeof(cfg) / sizeof(cfg[0]); c++) {
        struct engine_sampling p;
        engine_sampling_default(&p);
        p.temperature = cfg[c].t;
        p.top_p = cfg[c].top_p;
        p.min_p = cfg[c].min_p;
        p.top_k = cfg[c].top_k;
        long sink = 0;
        double t0 = now();
        for (int i = 0; i < rows; i++) {
            memcpy(row, base, (size_t)n * sizeof(float));
            sink += engine_sample(s, &p, &r, (uint64_t)i, row, NULL, 0, NULL);
        }
        double t1 = now();
        for (int i = 0; i < rows; i++) {
            memcpy(row, base, (size_t)n * sizeof(float));
            sink += row[i % n] > 0.0f;
        }
        double t2 = now();
        uint64_t fast, full;
        engine_sampler_take_counts(s, &fast, &full);
        printf("%-20s %8.1f us/row", cfg[c].name, ((t1 - t0) - (t2 - t1)) / rows * 1e6);
        if (fast + full)
            printf("   nucleus: %llu from candidates, %llu whole row", (unsigned long long)fast,
                   (unsigned long long)full);
        printf("%s\n", sink == -1 ? " " : "");
    }
    engine_sampler_free(s);
    free(base);
    free(row);
    return 0;
}
