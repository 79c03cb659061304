/* Shard writer and reader: records are buffered in memory, each flush becomes one zstd frame
 * written with pwrite at the committed end and made durable with fdatasync; reading streams
 * the frames with ZSTD_decompressStream and checks that every frame ends on a line end. */
#include "io/shard.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "common/fault.h"
#include "common/log.h"
#include "common/proc.h"

#define SHARD_MAX_LINE ((size_t)1 << 30) /* a decoded line longer than this is corrupt data */

struct io_shard {
    int fd;             /* open file, locked with flock(LOCK_EX) */
    char *path;         /* copy of the path, for messages */
    uint64_t committed; /* durable length: everything before it is whole frames */
    uint64_t records;   /* records in the committed part */
    char *buf;          /* buffered records, each followed by '\n' (owned) */
    size_t buf_len;     /* bytes used in buf */
    size_t buf_cap;     /* bytes allocated for buf */
    size_t pending;     /* records in buf */
    char *zbuf;         /* compressed frame being written (owned) */
    size_t zbuf_cap;    /* bytes allocated for zbuf */
    ZSTD_CCtx *cctx;    /* compressor with level, checksum and content-size set */
    int broken;         /* 1 after an fsync failure: only close is allowed */
};

/* ---- reading ------------------------------------------------------------------------------ */

struct scan {
    io_shard_line_fn fn; /* per-line callback, may be NULL (count only) */
    void *user;          /* passed to fn */
    char *line;          /* partial line carried across output buffers (owned) */
    size_t line_len;     /* bytes in line */
    size_t line_cap;     /* bytes allocated for line */
    uint64_t records;    /* lines seen */
    uint64_t frames;     /* complete frames seen */
};

/* Split decoded bytes into lines. The byte after each complete line ('\n') is overwritten
 * with NUL so that the callback gets a terminated string without a copy. */
static enum status scan_bytes(struct scan *sc, char *p, size_t n, const char *path,
                              struct err_detail *err)
{
    while (n > 0) {
        char *nl = memchr(p, '\n', n);
        size_t seg = nl ? (size_t)(nl - p) : n;
        if (sc->line_len || !nl) {
            if (sc->line_len + seg + 1 > sc->line_cap) {
                if (sc->line_len + seg + 1 > SHARD_MAX_LINE)
                    return err_set(err, ST_ERR_FORMAT, "%s: decoded line longer than %zu bytes",
                                   path, SHARD_MAX_LINE);
                size_t cap = sc->line_cap ? sc->line_cap : 4096;
                while (cap < sc->line_len + seg + 1)
                    cap *= 2;
                char *nb = realloc(sc->line, cap);
                if (!nb)
                    return err_set(err, ST_ERR_NOMEM, "%s: out of memory", path);
                sc->line = nb;
                sc->line_cap = cap;
            }
            memcpy(sc->line + sc->line_len, p, seg);
            sc->line_len += seg;
        }
        if (!nl)
            return ST_OK;
        const char *line = p;
        size_t len = seg;
        if (sc->line_len) {
            sc->line[sc->line_len] = 0;
            line = sc->line;
            len = sc->line_len;
        } else {
            *nl = 0;
        }
        sc->records++;
        if (sc->fn) {
            enum status st = sc->fn(line, len, sc->user);
            if (st != ST_OK)
                return st;
        }
        sc->line_len = 0;
        p = nl + 1;
        n -= seg + 1;
    }
    return ST_OK;
}

static ssize_t pread_full(int fd, void *buf, size_t n, uint64_t off)
{
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        done += (size_t)r;
    }
    return (ssize_t)done;
}

/* Decode [0, limit) of fd (limit already checked against the file size). */
static enum status scan_fd(int fd, const char *path, uint64_t limit, struct scan *sc,
                           struct err_detail *err)
{
    size_t in_cap = ZSTD_DStreamInSize(), out_cap = ZSTD_DStreamOutSize();
    char *inb = malloc(in_cap);
    char *outb = malloc(out_cap + 1);
    ZSTD_DCtx *d = ZSTD_createDCtx();
    enum status st = ST_OK;
    if (!inb || !outb || !d) {
        st = err_set(err, ST_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    uint64_t off = 0;         /* file offset of inb[0] */
    uint64_t frame_start = 0; /* file offset where the current frame began */
    size_t ret = 0;           /* last ZSTD_decompressStream result: 0 = between frames */
    while (off < limit) {
        size_t want = limit - off < in_cap ? (size_t)(limit - off) : in_cap;
        ssize_t got = pread_full(fd, inb, want, off);
        if (got < 0) {
            st = err_set(err, ST_ERR_IO, "%s: read at offset %llu: %s", path,
                         (unsigned long long)off, strerror(errno));
            goto out;
        }
        if ((size_t)got < want) {
            st = err_set(err, ST_ERR_FORMAT, "%s: file ended at %llu bytes, before %llu", path,
                         (unsigned long long)(off + (uint64_t)got), (unsigned long long)limit);
            goto out;
        }
        ZSTD_inBuffer in = {inb, (size_t)got, 0};
        ZSTD_outBuffer o;
        do {
            o = (ZSTD_outBuffer){outb, out_cap, 0};
            ret = ZSTD_decompressStream(d, &o, &in);
            if (ZSTD_isError(ret)) {
                st = err_set(err, ST_ERR_FORMAT, "%s: corrupt zstd frame at offset %llu: %s", path,
                             (unsigned long long)frame_start, ZSTD_getErrorName(ret));
                goto out;
            }
            if ((st = scan_bytes(sc, outb, o.pos, path, err)) != ST_OK)
                goto out;
            if (ret == 0) {
                if (sc->line_len) {
                    st = err_set(err, ST_ERR_FORMAT,
                                 "%s: frame at offset %llu does not end with a newline", path,
                                 (unsigned long long)frame_start);
                    goto out;
                }
                sc->frames++;
                frame_start = off + in.pos;
            }
        } while (in.pos < in.size || (ret != 0 && o.pos == o.size));
        off += (uint64_t)got;
    }
    if (ret != 0)
        st = err_set(err, ST_ERR_FORMAT,
                     "%s: partial zstd frame: frame at offset %llu is cut off at %llu bytes", path,
                     (unsigned long long)frame_start, (unsigned long long)limit);
out:
    ZSTD_freeDCtx(d);
    free(inb);
    free(outb);
    return st;
}

/* Open path read-only and resolve limit against its size. */
static enum status open_for_read(const char *path, uint64_t *limit, int *fd_out,
                                 struct err_detail *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return err_set(err, errno == ENOENT ? ST_ERR_NOT_FOUND : ST_ERR_IO,
                       "%s: cannot open shard: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return err_set(err, ST_ERR_IO, "%s: stat: %s", path, strerror(e));
    }
    if (*limit == IO_SHARD_ALL)
        *limit = (uint64_t)sb.st_size;
    else if ((uint64_t)sb.st_size < *limit) {
        close(fd);
        return err_set(err, ST_ERR_FORMAT, "%s: shard has %llu bytes, fewer than the %llu to read",
                       path, (unsigned long long)sb.st_size, (unsigned long long)*limit);
    }
    *fd_out = fd;
    return ST_OK;
}

enum status io_shard_read(const char *path, uint64_t limit_bytes, io_shard_line_fn fn, void *user,
                          struct err_detail *err)
{
    int fd;
    enum status st = open_for_read(path, &limit_bytes, &fd, err);
    if (st != ST_OK)
        return st;
    struct scan sc = {.fn = fn, .user = user};
    st = scan_fd(fd, path, limit_bytes, &sc, err);
    free(sc.line);
    close(fd);
    return st;
}

enum status io_shard_verify(const char *path, uint64_t limit_bytes, uint64_t *frames,
                            uint64_t *records, struct err_detail *err)
{
    int fd;
    enum status st = open_for_read(path, &limit_bytes, &fd, err);
    if (st != ST_OK)
        return st;
    struct scan sc = {0};
    st = scan_fd(fd, path, limit_bytes, &sc, err);
    free(sc.line);
    close(fd);
    if (frames)
        *frames = sc.frames;
    if (records)
        *records = sc.records;
    return st;
}

/* ---- directories -------------------------------------------------------------------------- */

static enum status write_all(int fd, const char *p, size_t n, const char *path,
                             struct err_detail *err)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return err_set(err, ST_ERR_IO, "%s: write: %s", path,
                           w < 0 ? strerror(errno) : "no progress");
        p += w;
        n -= (size_t)w;
    }
    return ST_OK;
}

/* fault_hit("<fault>.<what>") when fault is set. */
static int fault_at(const char *fault, const char *what)
{
    char site[64];
    if (!fault)
        return 0;
    snprintf(site, sizeof(site), "%s.%s", fault, what);
    return fault_hit(site);
}

/* Remove dir's ".<name>.tmp.<tag>" files whose tag names a process that is certainly gone
 * (io_file_replace's of a writer killed on this host), once per dir and name in a process: the
 * files replaced every second (progress, metrics) would read their directory each time. */
static void replace_sweep(const char *dir, const char *name)
{
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static uint64_t swept[64]; /* FNV-1a of "dir/name" (a collision only skips a sweep) */
    static int n_swept;
    uint64_t h = 14695981039346656037ull;
    for (const char *p = dir; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    h = (h ^ '/') * 1099511628211ull;
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    pthread_mutex_lock(&lock);
    int seen = 0;
    for (int i = 0; i < n_swept && !seen; i++)
        seen = swept[i] == h;
    if (!seen && n_swept < (int)(sizeof(swept) / sizeof(swept[0])))
        swept[n_swept++] = h; /* (past 64 names every call sweeps) */
    pthread_mutex_unlock(&lock);
    if (seen)
        return;
    char prefix[300];
    if (snprintf(prefix, sizeof(prefix), ".%s.tmp.", name) < (int)sizeof(prefix))
        proc_sweep_dead(dir, prefix, 0, "a writer");
}

enum status io_file_replace(const char *dir, const char *name, const char *data, size_t len,
                            const char *fault, struct err_detail *err)
{
    if (!*name)
        return err_set(err, ST_ERR_INVALID_ARG, "%s/: a directory, not a file name", dir);
    char tag[400];
    if (proc_tag_self(tag, sizeof(tag))) { /* (hosts sharing dir may reuse a pid) */
        char host[64] = "";
        gethostname(host, sizeof(host) - 1);
        snprintf(tag, sizeof(tag), "%s.%ld", host, (long)getpid());
    }
    size_t n = strlen(dir) + strlen(name) + 8;
    char *tmp = malloc(n + strlen(tag) + 8), *final = malloc(n);
    enum status st = ST_OK;
    int fd = -1;
    if (!tmp || !final) {
        st = err_set(err, ST_ERR_NOMEM, "out of memory");
        goto out;
    }
    snprintf(final, n, "%s/%s", dir, name);
    snprintf(tmp, n + strlen(tag) + 8, "%s/.%s.tmp.%s", dir, name, tag);
    replace_sweep(dir, name);
    /* never write through whatever is at the temp name (a symlink, a stale file): remove it
     * (unlink does not follow links) and create the file exclusively */
    if (unlink(tmp) != 0 && errno != ENOENT) {
        st = errno == EROFS || errno == EACCES || errno == EPERM
                 ? err_set(err, ST_ERR_IO, "cannot write %s: %s", final, strerror(errno))
                 : err_set(err, ST_ERR_IO, "%s: cannot remove: %s", tmp, strerror(errno));
        goto out;
    }
    /* (0666: the umask decides, as for any output; a file replaced keeps its permissions) */
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0) {
        st = err_set(err, ST_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        goto out;
    }
    struct stat old;
    if (!stat(final, &old) && S_ISREG(old.st_mode))
        (void)fchmod(fd, old.st_mode & 07777);
    st = fault_at(fault, "write") ? err_set(err, ST_ERR_IO, "%s: write: injected fault", tmp)
                                  : write_all(fd, data, len, tmp, err);
    if (st == ST_OK && fault_at(fault, "fsync"))
        st = err_set(err, ST_ERR_IO, "%s: fsync: injected fault", tmp);
    if (st == ST_OK && fsync(fd) != 0)
        st = err_set(err, ST_ERR_IO, "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && st == ST_OK)
        st = err_set(err, ST_ERR_IO, "%s: close: %s", tmp, strerror(errno));
    if (st == ST_OK && fault_at(fault, "rename"))
        st = err_set(err, ST_ERR_IO, "rename %s: injected fault", tmp);
    if (st == ST_OK && rename(tmp, final) != 0)
        st = err_set(err, ST_ERR_IO, "rename %s -> %s: %s", tmp, final, strerror(errno));
    if (st != ST_OK) {
        unlink(tmp);
        /* (the message names the temporary file; the user knows the file it stands for) */
        err_prefix(err, "cannot write %s", final);
    } else {
        st = io_fsync_dir(dir, err);
    }
out:
    free(tmp);
    free(final);
    return st;
}

enum status io_fsync_dir(const char *dir, struct err_detail *err)
{
    if (fault_hit("dir.fsync"))
        return err_set(err, ST_ERR_IO, "%s: fsync: injected fault", dir);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return err_set(err, ST_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    /* some file systems cannot fsync a directory; there is nothing more we can do there */
    if (rc != 0 && e != EINVAL && e != ENOTSUP)
        return err_set(err, ST_ERR_IO, "%s: fsync directory: %s", dir, strerror(e));
    return ST_OK;
}

enum status io_fsync_parent(const char *path, struct err_detail *err)
{
    char *copy = strdup(path);
    if (!copy)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    enum status st = io_fsync_dir(dirname(copy), err);
    free(copy);
    return st;
}

/* ---- writing ------------------------------------------------------------------------------ */

static enum status pwrite_full(int fd, const void *buf, size_t n, uint64_t off, const char *path,
                               struct err_detail *err)
{
    size_t done = 0;
    while (done < n) {
        ssize_t w = pwrite(fd, (const char *)buf + done, n - done, (off_t)(off + done));
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return err_set(err, ST_ERR_IO, "%s: write at offset %llu: %s", path,
                           (unsigned long long)(off + done), strerror(errno));
        if (w == 0)
            return err_set(err, ST_ERR_IO, "%s: write at offset %llu made no progress", path,
                           (unsigned long long)(off + done));
        done += (size_t)w;
    }
    return ST_OK;
}

static enum status sync_fd(int fd, int data_only, const char *path, struct err_detail *err)
{
    int rc;
    do
        rc = data_only ? fdatasync(fd) : fsync(fd);
    while (rc != 0 && errno == EINTR);
    if (rc != 0)
        return err_set(err, ST_ERR_IO, "%s: fsync: %s", path, strerror(errno));
    return ST_OK;
}

/* Open (or with create, exclusively create) the shard file and set up the writer. */
static enum status shard_open(struct io_shard **out, const char *path, uint64_t committed_bytes,
                              int level, int create, struct err_detail *err)
{
    *out = NULL;
    int created = 0;
    int fd = create ? -1 : open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (create || (fd < 0 && errno == ENOENT)) {
        if (committed_bytes != 0)
            return err_set(err, ST_ERR_NOT_FOUND,
                           "%s: shard is missing but %llu bytes of it were committed: "
                           "committed output has been lost",
                           path, (unsigned long long)committed_bytes);
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        created = fd >= 0;
        if (fd < 0 && errno == EEXIST)
            return err_set(err, ST_ERR_EXISTS,
                           "%s: a file is already there; refusing to overwrite it", path);
    }
    if (fd < 0 && errno == ELOOP)
        return err_set(err, ST_ERR_IO, "%s: is a symbolic link; refusing to follow it", path);
    if (fd < 0)
        return err_set(err, ST_ERR_IO, "%s: cannot open shard: %s", path, strerror(errno));

    enum status st = ST_OK;
    struct io_shard *s = calloc(1, sizeof(*s));
    if (!s || !(s->path = strdup(path)) || !(s->cctx = ZSTD_createCCtx())) {
        st = err_set(err, ST_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    s->fd = fd;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        st = err_set(err, ST_ERR_IO, "%s: shard is locked by another writer (%s)", path,
                     strerror(errno));
        goto fail;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = err_set(err, ST_ERR_IO, "%s: stat: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = err_set(err, ST_ERR_INVALID_ARG, "%s: shard is not a regular file", path);
        goto fail;
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < committed_bytes) {
        st = err_set(err, ST_ERR_FORMAT,
                     "%s: shard has %llu bytes but %llu were committed: committed output has "
                     "been lost (file truncated or replaced?)",
                     path, (unsigned long long)size, (unsigned long long)committed_bytes);
        goto fail;
    }
    struct scan sc = {0};
    st = scan_fd(fd, path, committed_bytes, &sc, err);
    free(sc.line);
    if (st != ST_OK) {
        err_prefix(err, "committed part of shard does not verify");
        goto fail;
    }
    s->committed = committed_bytes;
    s->records = sc.records;
    if (size > committed_bytes) {
        LOG_WARN("%s: discarding %llu uncommitted bytes after the committed %llu", path,
                 (unsigned long long)(size - committed_bytes), (unsigned long long)committed_bytes);
        if (ftruncate(fd, (off_t)committed_bytes) != 0) {
            st = err_set(err, ST_ERR_IO, "%s: truncate to %llu: %s", path,
                         (unsigned long long)committed_bytes, strerror(errno));
            goto fail;
        }
        if ((st = sync_fd(fd, 0, path, err)) != ST_OK)
            goto fail;
    }
    if (created && (st = io_fsync_parent(path, err)) != ST_OK)
        goto fail;
    size_t zr = ZSTD_CCtx_setParameter(s->cctx, ZSTD_c_compressionLevel, level);
    if (!ZSTD_isError(zr))
        zr = ZSTD_CCtx_setParameter(s->cctx, ZSTD_c_checksumFlag, 1);
    if (!ZSTD_isError(zr))
        zr = ZSTD_CCtx_setParameter(s->cctx, ZSTD_c_contentSizeFlag, 1);
    if (ZSTD_isError(zr)) {
        st = err_set(err, ST_ERR_INVALID_ARG, "%s: zstd level %d: %s", path, level,
                     ZSTD_getErrorName(zr));
        goto fail;
    }
    *out = s;
    return ST_OK;
fail:
    if (s) {
        s->fd = -1;
        io_shard_close(s);
    }
    close(fd);
    return st;
}

enum status io_shard_open(struct io_shard **out, const char *path, uint64_t committed_bytes,
                          int level, struct err_detail *err)
{
    return shard_open(out, path, committed_bytes, level, 0, err);
}

int io_shard_locked(const char *path)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;
    int held = 0;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0)
        held = errno == EWOULDBLOCK ? 1 : -1;
    close(fd); /* drops our lock, if we took it */
    return held;
}

enum status io_shard_create(struct io_shard **out, const char *path, int level,
                            struct err_detail *err)
{
    return shard_open(out, path, 0, level, 1, err);
}

enum status io_shard_abandon(struct io_shard *s, uint64_t length, struct err_detail *err)
{
    enum status st = ST_OK;
    if (length > s->committed)
        st = err_set(err, ST_ERR_INVALID_ARG, "%s: cannot cut back to %llu, past the committed %llu",
                     s->path, (unsigned long long)length, (unsigned long long)s->committed);
    else if (length < s->committed && ftruncate(s->fd, (off_t)length) != 0)
        st = err_set(err, ST_ERR_IO, "%s: truncate to %llu: %s", s->path,
                     (unsigned long long)length, strerror(errno));
    else if (length < s->committed)
        st = sync_fd(s->fd, 0, s->path, err);
    s->buf_len = 0;
    s->pending = 0;
    io_shard_close(s);
    return st;
}

enum status io_shard_append(struct io_shard *s, const char *line, size_t len,
                            struct err_detail *err)
{
    if (s->broken)
        return err_set(err, ST_ERR_IO, "%s: shard writer failed earlier; reopen it", s->path);
    if (memchr(line, '\n', len))
        return err_set(err, ST_ERR_INVALID_ARG, "%s: record contains a newline", s->path);
    if (len + 1 > s->buf_cap - s->buf_len) {
        if (len + 1 > SIZE_MAX / 2 - s->buf_len)
            return err_set(err, ST_ERR_NOMEM, "%s: record too large", s->path);
        size_t cap = s->buf_cap ? s->buf_cap : 64 * 1024;
        while (cap - s->buf_len < len + 1)
            cap *= 2;
        char *nb = realloc(s->buf, cap);
        if (!nb)
            return err_set(err, ST_ERR_NOMEM, "%s: out of memory buffering records", s->path);
        s->buf = nb;
        s->buf_cap = cap;
    }
    memcpy(s->buf + s->buf_len, line, len);
    s->buf[s->buf_len + len] = '\n';
    s->buf_len += len + 1;
    s->pending++;
    return ST_OK;
}

/* The open file is still the one at its path: a shard whose directory was deleted or moved
 * during the run takes records into a file nobody can read; its items must not be marked done. */
static enum status still_there(const struct io_shard *s, struct err_detail *err)
{
    struct stat a, b;
    if (fstat(s->fd, &a))
        return err_set(err, ST_ERR_IO, "%s: fstat: %s", s->path, strerror(errno));
    if (a.st_nlink == 0 || stat(s->path, &b) || a.st_dev != b.st_dev || a.st_ino != b.st_ino)
        return err_set(err, ST_ERR_IO,
                       "%s: the shard file was removed or replaced while this run wrote it (its "
                       "directory deleted or moved?): its new records are not committed",
                       s->path);
    return ST_OK;
}

enum status io_shard_flush(struct io_shard *s, uint64_t *committed_bytes, uint64_t *records_total,
                           struct err_detail *err)
{
    if (s->broken)
        return err_set(err, ST_ERR_IO, "%s: shard writer failed earlier; reopen it", s->path);
    if (s->pending > 0) {
        size_t bound = ZSTD_compressBound(s->buf_len);
        if (bound > s->zbuf_cap) {
            char *nb = realloc(s->zbuf, bound);
            if (!nb)
                return err_set(err, ST_ERR_NOMEM, "%s: out of memory compressing", s->path);
            s->zbuf = nb;
            s->zbuf_cap = bound;
        }
        size_t n = ZSTD_compress2(s->cctx, s->zbuf, s->zbuf_cap, s->buf, s->buf_len);
        if (ZSTD_isError(n))
            return err_set(err, ST_ERR_INTERNAL, "%s: zstd compress: %s", s->path,
                           ZSTD_getErrorName(n));
        /* shard.write fails before writing; shard.torn after half the frame (a torn write) */
        size_t half = n / 2;
        enum status st = fault_hit("shard.write")
                             ? err_set(err, ST_ERR_IO, "%s: write: injected fault", s->path)
                             : pwrite_full(s->fd, s->zbuf, half, s->committed, s->path, err);
        if (st == ST_OK && fault_hit("shard.torn"))
            st = err_set(err, ST_ERR_IO, "%s: write: injected fault", s->path);
        if (st == ST_OK)
            st = pwrite_full(s->fd, s->zbuf + half, n - half, s->committed + half, s->path, err);
        if (st != ST_OK) {
            /* leave the file as committed so a retry (or a reopen) starts clean */
            if (ftruncate(s->fd, (off_t)s->committed) != 0)
                s->broken = 1;
            return st;
        }
        if (fault_hit("shard.fsync"))
            st = err_set(err, ST_ERR_IO, "%s: fsync: injected fault", s->path);
        if (st != ST_OK || (st = sync_fd(s->fd, 1, s->path, err)) != ST_OK ||
            (st = still_there(s, err)) != ST_OK) {
            s->broken = 1;
            return st;
        }
        s->committed += n;
        s->records += s->pending;
        s->buf_len = 0;
        s->pending = 0;
    }
    if (committed_bytes)
        *committed_bytes = s->committed;
    if (records_total)
        *records_total = s->records;
    return ST_OK;
}

size_t io_shard_pending_bytes(const struct io_shard *s)
{
    return s->buf_len;
}

size_t io_shard_pending_records(const struct io_shard *s)
{
    return s->pending;
}

uint64_t io_shard_committed_bytes(const struct io_shard *s)
{
    return s->committed;
}

uint64_t io_shard_records_total(const struct io_shard *s)
{
    return s->records;
}

void io_shard_close(struct io_shard *s)
{
    if (!s)
        return;
    if (s->pending)
        LOG_WARN("%s: closing with %zu records not yet written, dropped (their items are not "
                 "committed: they go back to the queue)",
                 s->path, s->pending);
    if (s->fd >= 0)
        close(s->fd);
    ZSTD_freeCCtx(s->cctx);
    free(s->buf);
    free(s->zbuf);
    free(s->path);
    free(s);
}
