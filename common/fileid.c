/* File versions (common/fileid.h). */
#include "common/fileid.h"

#include <time.h>

void file_version_of(const struct stat *sb, struct file_version *v)
{
    v->dev = (int64_t)sb->st_dev;
    v->ino = (int64_t)sb->st_ino;
    v->size = (int64_t)sb->st_size;
    v->mtime_ns = (int64_t)sb->st_mtim.tv_sec * 1000000000LL + sb->st_mtim.tv_nsec;
    v->ctime_ns = (int64_t)sb->st_ctim.tv_sec * 1000000000LL + sb->st_ctim.tv_nsec;
}

int file_version_get(const char *path, struct file_version *v)
{
    struct stat sb;
    if (stat(path, &sb))
        return -1;
    file_version_of(&sb, v);
    return 0;
}

int file_version_same(const struct file_version *a, const struct file_version *b)
{
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime_ns == b->mtime_ns && a->ctime_ns == b->ctime_ns;
}

int file_version_settled(const struct file_version *v, int64_t ns)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    int64_t now_ns = (int64_t)now.tv_sec * 1000000000LL + now.tv_nsec;
    int64_t changed = v->mtime_ns > v->ctime_ns ? v->mtime_ns : v->ctime_ns;
    return now_ns - changed > ns;
}
