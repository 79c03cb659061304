/* Small helpers shared by the cmocka tests: model and fixture paths, whole-file reads, argmax,
 * FNV-1a, a dead process's tag. */
#ifndef TESTS_TEST_UTIL_H
#define TESTS_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/proc.h"

/* Path of the default model: $QUERN_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf. */
static inline const char *test_model_path(void)
{
    const char *p = getenv("QUERN_MODEL");
    return p && *p ? p : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

/* Path of the optional Gemma 3 270M (`make gemma`): $QUERN_GEMMA or
 * models/gemma-3-270m-q4_k_m.gguf. */
static inline const char *test_gemma_path(void)
{
    const char *p = getenv("QUERN_GEMMA");
    return p && *p ? p : "models/gemma-3-270m-q4_k_m.gguf";
}

/* The proc_tag_self tag of a child that has exited and been reaped into out (cap bytes): a
 * process that is certainly gone. 0, or -1 when the child could not be made or said nothing. */
static inline int test_dead_proc_tag(char *out, size_t cap)
{
    int fds[2];
    if (pipe(fds))
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) { /* the child's own tag, through the pipe */
        char t[400];
        _exit(!proc_tag_self(t, sizeof(t)) && write(fds[1], t, strlen(t) + 1) > 0 ? 0 : 1);
    }
    close(fds[1]);
    int wst = 0;
    memset(out, 0, cap);
    ssize_t got = read(fds[0], out, cap - 1);
    close(fds[0]);
    return waitpid(pid, &wst, 0) == pid && WIFEXITED(wst) && WEXITSTATUS(wst) == 0 && got > 0 ? 0
                                                                                              : -1;
}

/* Index of the largest of x[0..n) (the first on ties). */
static inline int test_argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* Read a whole file into a malloc'd buffer of exactly its size (+1 NUL not counted);
 * returns NULL on failure. Caller frees. */
static inline char *test_read_file(const char *path, size_t *len)
{
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = (size_t)n;
    }
    return buf;
}

static inline uint64_t test_fnv1a64(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001B3ull;
    }
    return h;
}

#endif
