/* Unit tests for common/cpus: the cgroup CPU limit read from a fake hierarchy (v2 cpu.max and
 * v1 cfs quota/period, on the cgroup and its ancestors, the smallest winning, "max" and -1 as
 * no limit, rounding up), and cpus_usable against the process's affinity mask; the memory a
 * cgroup has room for (limit less use, v2 and v1, ancestors, "max" and v1's unlimited). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cpus.h"

static char root[64];

static void put(const char *rel, const char *text)
{
    char path[512], dir[512];
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    snprintf(dir, sizeof(dir), "%s", path);
    for (char *p = dir + strlen(root) + 1; *p; p++) /* make the directories on the way */
        if (*p == '/') {
            *p = 0;
            mkdir(dir, 0777);
            *p = '/';
        }
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static int setup(void **state)
{
    (void)state;
    snprintf(root, sizeof(root), "/tmp/quern-test-cpus-XXXXXX");
    return mkdtemp(root) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    return system(cmd) == 0 ? 0 : -1;
}

static void test_v2(void **state)
{
    (void)state;
    const char *self = "0::/kubepods/pod1/c1\n";
    assert_int_equal(cpus_cgroup_limit(root, self), 0); /* no files: no limit */
    put("kubepods/pod1/c1/cpu.max", "max 100000\n");
    assert_int_equal(cpus_cgroup_limit(root, self), 0);
    put("kubepods/pod1/cpu.max", "250000 100000\n"); /* 2.5 CPUs: 3 threads */
    assert_int_equal(cpus_cgroup_limit(root, self), 3);
    put("kubepods/cpu.max", "100000 100000\n"); /* an ancestor's smaller limit wins */
    assert_int_equal(cpus_cgroup_limit(root, self), 1);
    put("kubepods/pod1/c1/cpu.max", "50000 100000\n"); /* half a CPU is one thread */
    assert_int_equal(cpus_cgroup_limit(root, self), 1);
    /* the root itself (a container's namespace shows its own cgroup as "/") */
    put("cpu.max", "400000 100000\n");
    assert_int_equal(cpus_cgroup_limit(root, "0::/\n"), 4);
    put("cpu.max", "garbage\n");
    assert_int_equal(cpus_cgroup_limit(root, "0::/\n"), 0);
    assert_int_equal(cpus_cgroup_limit(root, ""), 0);
    /* a cgroup outside the namespace's root names nothing under it */
    put("x/cpu.max", "100000 100000\n");
    assert_int_equal(cpus_cgroup_limit(root, "0::/../x\n"), 0);
    assert_int_equal(cpus_cgroup_limit(root, "0::/x\n"), 1);
    assert_int_equal(cpus_cgroup_limit(root, "no colons here"), 0);
}

static void test_v1(void **state)
{
    (void)state;
    /* a hybrid host: v1 controllers and an empty v2 line */
    const char *self = "4:memory:/slurm/job7\n3:cpu,cpuacct:/slurm/job7\n0::/\n";
    put("cpu/slurm/job7/cpu.cfs_quota_us", "-1\n");
    put("cpu/slurm/job7/cpu.cfs_period_us", "100000\n");
    assert_int_equal(cpus_cgroup_limit(root, self), 0);
    put("cpu/slurm/cpu.cfs_quota_us", "600000\n");
    put("cpu/slurm/cpu.cfs_period_us", "100000\n");
    assert_int_equal(cpus_cgroup_limit(root, self), 6);
    put("cpu/slurm/job7/cpu.cfs_quota_us", "150000\n");
    assert_int_equal(cpus_cgroup_limit(root, self), 2);
    /* "cpuacct" alone, or "cpuset", is not the cpu controller */
    assert_int_equal(cpus_cgroup_limit(root, "3:cpuacct:/slurm/job7\n2:cpuset:/slurm/job7\n"), 0);
}

static void test_mem_room(void **state)
{
    (void)state;
    const char *v2 = "0::/system.slice/slurmstepd/job9\n";
    assert_int_equal(mem_cgroup_room(root, v2), 0); /* no files: no limit */
    put("system.slice/slurmstepd/job9/memory.max", "max\n");
    put("system.slice/slurmstepd/job9/memory.current", "1000\n");
    assert_int_equal(mem_cgroup_room(root, v2), 0);
    put("system.slice/slurmstepd/job9/memory.max", "8589934592\n"); /* --mem=8G */
    assert_int_equal(mem_cgroup_room(root, v2), 8589934592ull - 1000);
    put("system.slice/memory.max", "4294967296\n"); /* an ancestor's smaller room wins */
    put("system.slice/memory.current", "4294967000\n");
    assert_int_equal(mem_cgroup_room(root, v2), 296);
    put("system.slice/memory.current", "5000000000\n"); /* over: at least 1 */
    assert_int_equal(mem_cgroup_room(root, v2), 1);
    /* inactive file cache (reclaimable) is room */
    put("system.slice/memory.stat", "anon 100\nfile 3000000000\ninactive_file 2000000000\n");
    assert_int_equal(mem_cgroup_room(root, v2), 4294967296ull - 3000000000ull);
    put("system.slice/memory.stat", "inactive_file 7000000000\n"); /* (first line; > use) */
    assert_int_equal(mem_cgroup_room(root, v2), 4294967296ull);
    /* v1: the memory controller's hierarchy, its "unlimited" (2^63 rounded to pages) */
    const char *v1 = "4:memory:/slurm/job7\n3:cpu,cpuacct:/slurm/job7\n0::/\n";
    put("memory/slurm/job7/memory.limit_in_bytes", "9223372036854771712\n");
    put("memory/slurm/job7/memory.usage_in_bytes", "123\n");
    assert_int_equal(mem_cgroup_room(root, v1), 0);
    put("memory/slurm/memory.limit_in_bytes", "2000000\n");
    put("memory/slurm/memory.usage_in_bytes", "500000\n");
    assert_int_equal(mem_cgroup_room(root, v1), 1500000);
    put("memory/slurm/memory.stat", "cache 9\ninactive_file 7\ntotal_inactive_file 400000\n");
    assert_int_equal(mem_cgroup_room(root, v1), 1900000);
    /* the cpu controller's line names no memory limit */
    assert_int_equal(mem_cgroup_room(root, "3:cpu,cpuacct:/slurm\n"), 0);
    /* this process: whatever it is, no more than the host has */
    uint64_t avail = mem_available();
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    assert_true(avail > 0 && avail <= (uint64_t)pages * (uint64_t)page);
}

static void test_usable(void **state)
{
    (void)state;
    cpu_set_t set;
    assert_int_equal(sched_getaffinity(0, sizeof(set), &set), 0);
    int n = cpus_usable();
    assert_true(n >= 1 && n <= CPU_COUNT(&set));
    /* one CPU of the mask: one thread */
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) {
            CPU_SET(c, &one);
            break;
        }
    assert_int_equal(sched_setaffinity(0, sizeof(one), &one), 0);
    assert_int_equal(cpus_usable(), 1);
    assert_int_equal(sched_setaffinity(0, sizeof(set), &set), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_v2, setup, teardown),
        cmocka_unit_test_setup_teardown(test_mem_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_v1, setup, teardown),
        cmocka_unit_test(test_usable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
