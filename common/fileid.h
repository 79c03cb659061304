/* A file's version as stat sees it: device, inode, size, modification and change times. Two
 * equal versions are taken as the same, unchanged file (a model kept loaded across jobs, a
 * model's hash recorded in the queue, a part's progress file that a live run replaces). A write
 * within one timestamp tick of the file system can hide behind an equal version: callers that
 * trust it for content wait until the file has settled (file_version_settled). */
#ifndef COMMON_FILEID_H
#define COMMON_FILEID_H

#include <stdint.h>
#include <sys/stat.h>

struct file_version {
    int64_t dev, ino, size, mtime_ns, ctime_ns;
};

void file_version_of(const struct stat *sb, struct file_version *v);
/* stat(path): 0, or -1 with errno set. */
int file_version_get(const char *path, struct file_version *v);
int file_version_same(const struct file_version *a, const struct file_version *b);
/* Last modified or changed more than ns nanoseconds before now (the real-time clock)? */
int file_version_settled(const struct file_version *v, int64_t ns);

#endif
