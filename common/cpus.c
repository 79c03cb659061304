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
static long long cpu_limit(const char *dir, int v1)
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

/* A cgroup directory's limit of one kind, > 0, or 0 for none. */
typedef long long (*dir_limit_fn)(const char *dir, int v1);

/* The bytes cgroup dir may still take: its limit less its use (v2: memory.max and
 * memory.current; v1: memory.limit_in_bytes and memory.usage_in_bytes), its inactive file
 * cache counted as room (memory.stat's inactive_file, v1 total_inactive_file: the kernel
 * reclaims it first, as MemAvailable counts it), at least 1; 0 for no limit ("max", or v1's
 * "unlimited" of about 2^63). */
static long long mem_room(const char *dir, int v1)
{
    char file[4200], text[8192];
    long long lim = 0, used = 0, cache = 0;
    snprintf(file, sizeof(file), "%s/%s", dir, v1 ? "memory.limit_in_bytes" : "memory.max");
    if (read_small(file, text, sizeof(text)) || sscanf(text, "%lld", &lim) != 1 || lim <= 0 ||
        lim >= (1ll << 60))
        return 0;
    snprintf(file, sizeof(file), "%s/%s", dir, v1 ? "memory.usage_in_bytes" : "memory.current");
    if (read_small(file, text, sizeof(text)) || sscanf(text, "%lld", &used) != 1 || used < 0)
        used = 0;
    snprintf(file, sizeof(file), "%s/memory.stat", dir);
    const char *key = v1 ? "\ntotal_inactive_file " : "\ninactive_file ";
    text[0] = '\n'; /* (so that the first line's key is found too) */
    if (!read_small(file, text + 1, sizeof(text) - 1)) {
        const char *k = strstr(text, key);
        if (!k || sscanf(k + strlen(key), "%lld", &cache) != 1 || cache < 0)
            cache = 0;
    }
    used = cache < used ? used - cache : 0;
    return lim > used ? lim - used : 1;
}

/* The smallest limit of base + path and each of its ancestors down to base itself. */
static long long path_limit(const char *base, const char *path, size_t n, int v1,
                            dir_limit_fn dir_limit)
{
    char dir[4096];
    size_t bl = strlen(base);
    if (bl + n + 1 >= sizeof(dir))
        return 0;
    snprintf(dir, sizeof(dir), "%s%.*s", base, (int)n, path);
    long long best = 0;
    for (;;) {
        long long c = dir_limit(dir, v1);
        if (c > 0 && (best == 0 || c < best))
            best = c;
        char *slash = strlen(dir) > bl ? strrchr(dir + bl, '/') : NULL;
        if (!slash)
            break;
        *slash = 0; /* (at base + "/", this leaves base itself) */
    }
    return best;
}

/* Does the comma-separated list [s, s + n) hold word? */
static int has_word(const char *s, size_t n, const char *word)
{
    const size_t wl = strlen(word);
    while (n) {
        size_t w = 0;
        while (w < n && s[w] != ',')
            w++;
        if (w == wl && !strncmp(s, word, wl))
            return 1;
        s += w < n ? w + 1 : w;
        n -= w < n ? w + 1 : w;
    }
    return 0;
}

/* The smallest limit over the cgroups a /proc/self/cgroup text names (v2, and v1's controller,
 * mounted at root/controller) and their ancestors; 0 when none is set. */
static long long cgroup_limit(const char *root, const char *proc_cgroup, const char *controller,
                              dir_limit_fn dir_limit)
{
    long long best = 0;
    for (const char *line = proc_cgroup; line && *line;) {
        const char *eol = strchr(line, '\n'), *end = eol ? eol : line + strlen(line);
        const char *c1 = memchr(line, ':', (size_t)(end - line));
        const char *c2 = c1 ? memchr(c1 + 1, ':', (size_t)(end - c1 - 1)) : NULL;
        /* (a path outside the namespace's root, "/..", names nothing under root) */
        const char *dots = c2 ? strstr(c2 + 1, "/..") : NULL;
        if (c2 && c2[1] == '/' && !(dots && dots < end)) {
            int v2 = c1 == line + 1 && line[0] == '0' && c2 == c1 + 1;
            long long c = 0;
            if (v2) {
                c = path_limit(root, c2 + 1, (size_t)(end - c2 - 1), 0, dir_limit);
            } else if (has_word(c1 + 1, (size_t)(c2 - c1 - 1), controller)) {
                char base[4096];
                snprintf(base, sizeof(base), "%s/%s", root, controller);
                c = path_limit(base, c2 + 1, (size_t)(end - c2 - 1), 1, dir_limit);
            }
            if (c > 0 && (best == 0 || c < best))
                best = c;
        }
        line = eol ? eol + 1 : NULL;
    }
    return best;
}

int cpus_cgroup_limit(const char *root, const char *proc_cgroup)
{
    long long c = cgroup_limit(root, proc_cgroup, "cpu", cpu_limit);
    return c > 65536 ? 65536 : (int)c;
}

uint64_t mem_cgroup_room(const char *root, const char *proc_cgroup)
{
    return (uint64_t)cgroup_limit(root, proc_cgroup, "memory", mem_room);
}

uint64_t mem_available(void)
{
    char text[4096];
    uint64_t avail = 0;
    unsigned long long kb = 0;
    if (!read_small("/proc/meminfo", text, sizeof(text))) {
        const char *m = strstr(text, "MemAvailable:");
        if (m && sscanf(m + 13, "%llu", &kb) == 1)
            avail = (uint64_t)kb * 1024;
    }
    if (!read_small("/proc/self/cgroup", text, sizeof(text))) {
        uint64_t room = mem_cgroup_room("/sys/fs/cgroup", text);
        if (room && (!avail || room < avail))
            avail = room;
    }
    return avail;
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
