#include "common/cpus.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A small file's text into text (at most cap - 1 bytes, cap > 1); 0 on success. */
static int read_small(const char *path, char *text, size_t cap)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    size_t got = fread(text, 1, cap - 1, f);
    text[got] = 0;
    fclose(f);
    return 0;
}

/* ceil(quota / period), at most 65536; 0 for no limit (a quota of "max" or -1, or nonsense). */
static int quota_cpus(long long quota, long long period)
{
    if (quota <= 0 || period <= 0)
        return 0;
    long long n = (quota + period - 1) / period;
    return n > 65536 ? 65536 : (int)n;
}

/* The CPU limit of cgroup dir (v2: cpu.max; v1: cpu.cfs_quota_us and cpu.cfs_period_us), 0 for
 * none. */
static int dir_limit(const char *dir, int v1)
{
    char file[4200], text[128], q[32];
    long long quota = 0, period = 0;
    if (!v1) {
        snprintf(file, sizeof(file), "%s/cpu.max", dir);
        if (read_small(file, text, sizeof(text)) || sscanf(text, "%31s %lld", q, &period) != 2 ||
            !strcmp(q, "max"))
            return 0;
        char *end;
        quota = strtoll(q, &end, 10);
        return *end ? 0 : quota_cpus(quota, period);
    }
    snprintf(file, sizeof(file), "%s/cpu.cfs_quota_us", dir);
    if (read_small(file, text, sizeof(text)) || sscanf(text, "%lld", &quota) != 1)
        return 0;
    snprintf(file, sizeof(file), "%s/cpu.cfs_period_us", dir);
    if (read_small(file, text, sizeof(text)) || sscanf(text, "%lld", &period) != 1)
        return 0;
    return quota_cpus(quota, period);
}

/* The smallest limit of base + path and each of its ancestors down to base itself. */
static int path_limit(const char *base, const char *path, size_t n, int v1)
{
    char dir[4096];
    size_t bl = strlen(base);
    if (bl + n + 1 >= sizeof(dir))
        return 0;
    snprintf(dir, sizeof(dir), "%s%.*s", base, (int)n, path);
    int best = 0;
    for (;;) {
        int c = dir_limit(dir, v1);
        if (c > 0 && (best == 0 || c < best))
            best = c;
        char *slash = strlen(dir) > bl ? strrchr(dir + bl, '/') : NULL;
        if (!slash)
            break;
        *slash = 0; /* (at base + "/", this leaves base itself) */
    }
    return best;
}

/* Does the comma-separated list [s, s + n) hold the word "cpu"? */
static int has_cpu(const char *s, size_t n)
{
    while (n) {
        size_t w = 0;
        while (w < n && s[w] != ',')
            w++;
        if (w == 3 && !strncmp(s, "cpu", 3))
            return 1;
        s += w < n ? w + 1 : w;
        n -= w < n ? w + 1 : w;
    }
    return 0;
}

int cpus_cgroup_limit(const char *root, const char *proc_cgroup)
{
    int best = 0;
    for (const char *line = proc_cgroup; line && *line;) {
        const char *eol = strchr(line, '\n'), *end = eol ? eol : line + strlen(line);
        const char *c1 = memchr(line, ':', (size_t)(end - line));
        const char *c2 = c1 ? memchr(c1 + 1, ':', (size_t)(end - c1 - 1)) : NULL;
        /* (a path outside the namespace's root, "/..", names nothing under root) */
        const char *dots = c2 ? strstr(c2 + 1, "/..") : NULL;
        if (c2 && c2[1] == '/' && !(dots && dots < end)) {
            int v2 = c1 == line + 1 && line[0] == '0' && c2 == c1 + 1;
            int c = 0;
            if (v2) {
                c = path_limit(root, c2 + 1, (size_t)(end - c2 - 1), 0);
            } else if (has_cpu(c1 + 1, (size_t)(c2 - c1 - 1))) {
                char base[4096];
                snprintf(base, sizeof(base), "%s/cpu", root);
                c = path_limit(base, c2 + 1, (size_t)(end - c2 - 1), 1);
            }
            if (c > 0 && (best == 0 || c < best))
                best = c;
        }
        line = eol ? eol + 1 : NULL;
    }
    return best;
}

/* CPUs in this process's affinity mask, 0 when it cannot be read (a mask wider than the one
 * tried is EINVAL: tried again twice as wide, up to 2^20 CPUs). */
static long affinity_cpus(void)
{
    for (int ncpu = 1024; ncpu <= (1 << 20); ncpu *= 2) {
        cpu_set_t *set = CPU_ALLOC(ncpu);
        if (!set)
            return 0;
        size_t size = CPU_ALLOC_SIZE(ncpu);
        CPU_ZERO_S(size, set);
        int rc = sched_getaffinity(0, size, set);
        long n = rc == 0 ? CPU_COUNT_S(size, set) : 0;
        CPU_FREE(set);
        if (rc == 0 || errno != EINVAL)
            return n;
    }
    return 0;
}

int cpus_usable(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    long a = affinity_cpus();
    if (a > 0)
        n = a;
    char text[4096];
    if (!read_small("/proc/self/cgroup", text, sizeof(text))) {
        int lim = cpus_cgroup_limit("/sys/fs/cgroup", text);
        if (lim > 0 && lim < n)
            n = lim;
    }
    return n < 1 ? 1 : (int)n;
}
