/* Process identity and same-host liveness checks through /proc (see common/proc.h). */
#include "common/proc.h"

#include "common/log.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* First line of a small file into buf without its newline; "" when unreadable. */
static void read_line(const char *path, char *buf, size_t cap)
{
    buf[0] = 0;
    FILE *f = fopen(path, "re");
    if (!f)
        return;
    if (fgets(buf, (int)cap, f))
        buf[strcspn(buf, "\n")] = 0;
    else
        buf[0] = 0;
    fclose(f);
}

int proc_stat_start(int64_t pid, int64_t *ticks, char *state)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    /* "pid (comm) S ppid ...": comm may hold spaces and ')', so parse after the last ')' */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ')
        return -1;
    p += 2;
    if (state)
        *state = *p;
    /* fields 3.. start at p; the start time is field 22, i.e. 19 more fields after the state */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p)
            return -1;
        p++;
    }
    char *end;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    if (errno || end == p)
        return -1;
    if (ticks)
        *ticks = v;
    return 0;
}

void proc_identity_self(struct proc_identity *id)
{
    memset(id, 0, sizeof(*id));
    if (gethostname(id->host, sizeof(id->host) - 1))
        id->host[0] = 0;
    read_line("/proc/sys/kernel/random/boot_id", id->boot_id, sizeof(id->boot_id));
    ssize_t n = readlink("/proc/self/ns/pid", id->pid_ns, sizeof(id->pid_ns) - 1);
    id->pid_ns[n > 0 ? n : 0] = 0;
    id->pid = (int64_t)getpid();
    if (proc_stat_start(id->pid, &id->start_ticks, NULL))
        id->start_ticks = 0;
}

enum proc_liveness proc_liveness(const struct proc_identity *self,
                                 const struct proc_identity *other)
{
    if (!self->host[0] || !self->boot_id[0] || !self->pid_ns[0] || !other->boot_id[0] ||
        !other->pid_ns[0] || other->pid <= 0 || other->start_ticks <= 0)
        return PROC_UNKNOWN;
    if (strcmp(self->host, other->host) || strcmp(self->boot_id, other->boot_id) ||
        strcmp(self->pid_ns, other->pid_ns))
        return PROC_UNKNOWN;
    int64_t ticks = 0;
    char state = 0;
    if (proc_stat_start(other->pid, &ticks, &state)) {
        /* /proc may hide other users' processes (hidepid): only "no such process" is dead */
        if (kill((pid_t)other->pid, 0) != 0 && errno == ESRCH)
            return PROC_DEAD;
        return PROC_UNKNOWN;
    }
    if (ticks != other->start_ticks)
        return PROC_DEAD; /* the PID was reused by a later process */
    if (state == 'Z' || state == 'X')
        return PROC_DEAD; /* exited, not yet reaped by its parent */
    return PROC_ALIVE;
}

#define PROC_TAG_BOOT 12 /* boot id characters in a tag */

int proc_tag_self(char *buf, size_t cap)
{
    struct proc_identity id;
    proc_identity_self(&id);
    unsigned long long ns = 0;
    if (!id.host[0] || strlen(id.boot_id) < PROC_TAG_BOOT || !id.start_ticks ||
        sscanf(id.pid_ns, "pid:[%llu]", &ns) != 1 ||
        strspn(id.host, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.") !=
            strlen(id.host))
        return -1;
    int n = snprintf(buf, cap, "%lld.%lld.%llu.%.*s.%s", (long long)id.pid,
                     (long long)id.start_ticks, ns, PROC_TAG_BOOT, id.boot_id, id.host);
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

enum proc_liveness proc_tag_liveness(const char *tag)
{
    struct proc_identity self, other;
    proc_identity_self(&self);
    memset(&other, 0, sizeof(other));
    long long pid, ticks;
    unsigned long long ns;
    char boot[PROC_TAG_BOOT + 1];
    int used = 0;
    if (sscanf(tag, "%lld.%lld.%llu.%12[0-9a-f-].%n", &pid, &ticks, &ns, boot, &used) != 4 ||
        !used || strlen(boot) != PROC_TAG_BOOT || !tag[used] ||
        strlen(tag + used) >= sizeof(other.host))
        return PROC_UNKNOWN;
    /* the boot id is known by its first characters only: the same boot where they match */
    if (strncmp(self.boot_id, boot, PROC_TAG_BOOT))
        return PROC_UNKNOWN;
    snprintf(other.host, sizeof(other.host), "%s", tag + used);
    snprintf(other.boot_id, sizeof(other.boot_id), "%s", self.boot_id);
    snprintf(other.pid_ns, sizeof(other.pid_ns), "pid:[%llu]", ns);
    other.pid = pid;
    other.start_ticks = ticks;
    return proc_liveness(&self, &other);
}

void proc_sweep_dead(const char *dir, const char *prefix, size_t random_len, const char *who)
{
    static const char alnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    DIR *d = opendir(dir);
    if (!d)
        return;
    const size_t pl = strlen(prefix);
    const struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const char *nm = de->d_name;
        if (strncmp(nm, prefix, pl))
            continue;
        const char *r = nm + pl;
        if (random_len && (strspn(r, alnum) < random_len || r[random_len] != '.'))
            continue;
        if (proc_tag_liveness(r + (random_len ? random_len + 1 : 0)) == PROC_DEAD &&
            !unlinkat(dirfd(d), nm, 0))
            LOG_INFO("removed %s/%s, left by %s that was killed", dir, nm, who);
    }
    closedir(d);
}

const char *proc_liveness_str(enum proc_liveness l)
{
    switch (l) {
    case PROC_ALIVE:
        return "alive";
    case PROC_DEAD:
        return "dead";
    default:
        return "unknown";
    }
}
