/* How many CPUs this process may use: the CPUs of its affinity mask (taskset, Slurm's and
 * containers' cpusets), at most its cgroup CPU quota rounded up (of its cgroup and of every
 * ancestor: Kubernetes' and systemd's CPU limits). Default thread counts come from here:
 * the online CPUs of a 64-core node under a 4-CPU cpuset would put 16 spinning threads on each
 * CPU. And how much memory it can take (host memory available, at most its cgroup's room). */
#ifndef COMMON_CPUS_H
#define COMMON_CPUS_H

#include <stdint.h>

/* The CPUs this process may use, at least 1. */
int cpus_usable(void);

/* The CPU limit of the cgroups named by a /proc/self/cgroup text, the hierarchies mounted
 * under root (v2 at root, v1's cpu controller at root/cpu): the smallest ceil(quota / period)
 * of the cgroup and every ancestor (v2 cpu.max; v1 cpu.cfs_quota_us / cpu.cfs_period_us), 0
 * when none is set. */
int cpus_cgroup_limit(const char *root, const char *proc_cgroup);

/* The bytes the cgroups named by a /proc/self/cgroup text may still take (mounted as for
 * cpus_cgroup_limit, v1's memory controller at root/memory): the smallest limit less use of
 * the cgroup and every ancestor (v2 memory.max - memory.current; v1 memory.limit_in_bytes -
 * memory.usage_in_bytes), 0 when none is set. */
uint64_t mem_cgroup_room(const char *root, const char *proc_cgroup);

/* Memory this process can take now without swapping or meeting its cgroup's limit (a Slurm
 * job's --mem, a container's): the host's MemAvailable, at most mem_cgroup_room; 0 when
 * neither can be read. */
uint64_t mem_available(void);

#endif
