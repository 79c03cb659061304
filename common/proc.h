/* Who a process is, in a form another process (on the same host or not) can check later: host
 * name, boot id, PID namespace, PID and the process's start time. A run records its identity
 * in the queue; a later run on the same host, same boot and same PID namespace can then tell
 * for certain whether that process still exists. Anywhere else only a lease can tell. */
#ifndef COMMON_PROC_H
#define COMMON_PROC_H

#include <stddef.h>
#include <stdint.h>

struct proc_identity {
    char host[256];      /* gethostname(), "" if unknown */
    char boot_id[64];    /* /proc/sys/kernel/random/boot_id, "" if unknown */
    char pid_ns[64];     /* readlink /proc/self/ns/pid ("pid:[4026531836]"), "" if unknown */
    int64_t pid;         /* process id, > 0 */
    int64_t start_ticks; /* field 22 of /proc/PID/stat: start time in clock ticks after boot;
                            0 if unknown */
};

enum proc_liveness {
    PROC_UNKNOWN = 0, /* another host, boot or PID namespace, or not enough facts: ask the lease */
    PROC_ALIVE,       /* that very process still runs here (not a zombie) */
    PROC_DEAD,        /* same host, boot and namespace, and the process is gone (kill(pid, 0)
                         says no such process), or its PID now belongs to a process started at
                         another time, or it is a zombie */
};

/* Fill *id for the calling process. Never fails: unknown facts are left empty/0. */
void proc_identity_self(struct proc_identity *id);

/* Start time of process pid (field 22 of /proc/PID/stat) into *ticks and its state letter
 * ('R', 'S', 'Z', ...) into *state. 0 on success, -1 if there is no such process. */
int proc_stat_start(int64_t pid, int64_t *ticks, char *state);

/* Can `self` tell whether `other` is alive? See enum proc_liveness. The identities must both
 * have a host, boot id, namespace and start time for anything but PROC_UNKNOWN. */
enum proc_liveness proc_liveness(const struct proc_identity *self,
                                 const struct proc_identity *other);

/* A file-name-safe tag naming the calling process, "PID.TICKS.NS.BOOT.HOST" (NS the PID
 * namespace's inode number, BOOT the boot id's first 12 characters), for temporary files that a
 * later process may remove once their writer is dead. 0, or -1 when a fact is unknown, the host
 * name holds a character other than letters, digits, '-' and '.', or the tag does not fit. */
int proc_tag_self(char *buf, size_t cap);

/* Liveness of the process a tag from proc_tag_self names, as proc_liveness tells it; a malformed
 * tag is PROC_UNKNOWN. */
enum proc_liveness proc_tag_liveness(const char *tag);

/* Remove dir's files named prefix, then random_len characters of [A-Za-z0-9] and a '.' (neither
 * when random_len is 0), then a tag from proc_tag_self whose process is certainly gone: the
 * temporary files of writers killed on this host. Each removal is logged as left by who (e.g.
 * "an export"). A directory that cannot be read is left alone. */
void proc_sweep_dead(const char *dir, const char *prefix, size_t random_len, const char *who);

/* "unknown", "alive" or "dead". */
const char *proc_liveness_str(enum proc_liveness l);

#endif
