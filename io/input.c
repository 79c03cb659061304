/* Input reader: one libarchive read handle per file (all compression filters; tar, zip, raw
 * and empty formats) and a line splitter over fixed-size chunks of decompressed data. Lines
 * that fit in a chunk are returned in place; lines that straddle chunks are gathered in a
 * buffer of max_line + 1 bytes, and longer lines are skipped to their newline. */
#include "io/input.h"

#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "common/log.h"

#define INPUT_CHUNK (256u << 10) /* decompressed bytes read from libarchive at a time */
#define INPUT_SNIFF (64u << 10)  /* leading bytes of each member checked for NUL bytes */
#define INPUT_BLOCK (64u << 10)  /* compressed read size handed to libarchive */

/* gzip's own checks, which libarchive's gzip filter skips (3.6: a member's CRC-32 and length
 * are never compared, and data after the last member is dropped as if the file ended): the
 * compressed bytes as libarchive reads them, inflated again by zlib into a scratch buffer. */
enum gz_state { GZ_OFF, GZ_MEMBER, GZ_BETWEEN, GZ_ZEROS, GZ_BAD };

struct gz_check {
    enum gz_state state; /* GZ_OFF: the file is not gzip (or was read out of order) */
    z_stream z;          /* zlib's gzip decoder (ready while state != GZ_OFF) */
    int z_ready;         /* inflateInit2 done */
    int magic1;          /* between members: the first magic byte (0x1f) seen */
    uint64_t fed;        /* compressed bytes checked */
    unsigned char *out;  /* GZ_OUT scratch bytes (owned) */
    char msg[200];       /* what GZ_BAD found */
};

#define GZ_OUT (64u << 10)

struct io_input {
    struct archive *a;     /* libarchive read handle (reader-owned) */
    int fd;                /* the input file, read by libarchive; -1 when closed */
    int regular;           /* fd is a regular file (seekable) */
    unsigned char *raw;    /* INPUT_BLOCK bytes: what the read callback hands libarchive */
    uint64_t raw_read;     /* bytes read from fd */
    struct gz_check gz;    /* gzip's checks on those bytes */
    char *path;            /* copy of the input path */
    char *member;          /* current member name (owned), NULL for single files */
    char format[64];       /* "tar+gzip", "raw+zstd", ... (set at the first header) */
    int is_archive;        /* 1 for tar/zip, 0 for a single (raw) stream */
    int started;           /* 1 once the first header has been read */
    uint64_t members_read; /* .jsonl members opened so far */
    uint64_t members_seen; /* archive entries seen so far */
    int in_member;         /* 1 while reading a member's data */
    int done;              /* 1 after the end of the input was reached */
    int member_eof;        /* 1 when the current member's data is exhausted */
    size_t max_line;       /* longest accepted line, excluding the line ending */
    char *chunk;           /* INPUT_CHUNK bytes of decompressed data (owned) */
    size_t chunk_len;      /* valid bytes in chunk */
    size_t chunk_pos;      /* next unscanned byte in chunk */
    uint64_t chunk_off;    /* member offset of chunk[0] */
    char *acc;             /* max_line + 1 bytes: a line that straddles chunks (owned) */
    size_t acc_len;        /* bytes gathered in acc */
    int in_line;           /* 1 when a line has started but not been returned */
    int overlong;          /* 1 while skipping the rest of a too-long line */
    uint64_t line_no;      /* number of the current (or last) line, 1-based */
    uint64_t line_off;     /* member offset where the current line starts */
    enum status fatal;     /* sticky fatal status, ST_OK while healthy */
    char fatal_msg[sizeof(((struct err_detail *)0)->msg)]; /* its message */
};

static void fill_pos(const struct io_input *in, struct io_input_pos *pos)
{
    if (!pos)
        return;
    pos->path = in->path;
    pos->member = in->member;
    pos->line = in->line_no;
    pos->offset = in->line_off;
}

/* Record a fatal error (sticky) with the file, member and position as context. */
static enum status fail(struct io_input *in, enum status st, struct err_detail *err,
                        const char *what)
{
    char where[160];
    if (in->member)
        snprintf(where, sizeof(where), "member %.100s, ", in->member);
    else
        where[0] = 0;
    struct err_detail tmp;
    err_set(&tmp, st, "%s: %sline %llu (uncompressed offset %llu): %s", in->path, where,
            (unsigned long long)(in->line_no + (in->in_line ? 0 : 1)),
            (unsigned long long)(in->chunk_off + in->chunk_pos), what);
    in->fatal = st;
    memcpy(in->fatal_msg, tmp.msg, sizeof(in->fatal_msg));
    return err_set(err, st, "%s", tmp.msg);
}

static void gz_bad(struct gz_check *g, const char *what)
{
    g->state = GZ_BAD;
    snprintf(g->msg, sizeof(g->msg), "corrupt gzip data (compressed byte %llu): %s",
             (unsigned long long)g->fed, what);
}

/* Inflate up to n bytes of a member into the scratch buffer; the bytes consumed. At the
 * member's end (its CRC-32 and length checked by zlib) the state becomes GZ_BETWEEN. */
static size_t gz_inflate(struct gz_check *g, const unsigned char *p, size_t n)
{
    g->z.next_in = (unsigned char *)p;
    g->z.avail_in = n > (1u << 30) ? 1u << 30 : (uInt)n;
    const size_t given = g->z.avail_in;
    for (;;) {
        g->z.next_out = g->out;
        g->z.avail_out = GZ_OUT;
        int r = inflate(&g->z, Z_NO_FLUSH);
        if (r == Z_STREAM_END) {
            g->state = GZ_BETWEEN;
            break;
        }
        if (r != Z_OK && r != Z_BUF_ERROR) {
            g->fed += given - g->z.avail_in;
            gz_bad(g, g->z.msg ? g->z.msg : "zlib error");
            return given - g->z.avail_in;
        }
        if (!g->z.avail_in && g->z.avail_out)
            break;
        if (r == Z_BUF_ERROR)
            break;
    }
    size_t used = given - g->z.avail_in;
    g->fed += used;
    return used;
}

/* Check the next n compressed bytes: members one after another (a multi-member file), then
 * nothing but zero padding (which gzip itself allows). */
static void gz_feed(struct gz_check *g, const unsigned char *p, size_t n)
{
    while (n && g->state != GZ_BAD && g->state != GZ_OFF) {
        if (g->state == GZ_MEMBER) {
            size_t used = gz_inflate(g, p, n);
            p += used;
            n -= used;
            continue;
        }
        if (g->magic1) { /* a member starts with 0x1f 0x8b */
            g->magic1 = 0;
            if (*p != 0x8b) {
                gz_bad(g, "data after the end of the gzip stream (not gzip: a file appended "
                          "to a .gz? compress it, or give it to submit as a file of its own)");
                return;
            }
            static const unsigned char m1 = 0x1f;
            inflateReset(&g->z);
            g->state = GZ_MEMBER;
            g->fed--;
            gz_inflate(g, &m1, 1);
            continue;
        }
        if (*p == 0) {
            g->state = GZ_ZEROS;
        } else if (*p == 0x1f && g->state == GZ_BETWEEN) {
            g->magic1 = 1;
        } else {
            gz_bad(g, "data after the end of the gzip stream (not gzip: a file appended to a "
                      ".gz? compress it, or give it to submit as a file of its own)");
            return;
        }
        p++;
        n--;
        g->fed++;
    }
}

/* The file's first bytes: gzip's magic turns the checks on. */
static void gz_start(struct gz_check *g, const unsigned char *p, size_t n)
{
    if (n < 2 || p[0] != 0x1f || p[1] != 0x8b)
        return;
    if (!g->out && !(g->out = malloc(GZ_OUT)))
        return; /* (no checks then: libarchive's decoding goes on as before) */
    memset(&g->z, 0, sizeof(g->z));
    if (inflateInit2(&g->z, 15 + 16) != Z_OK)
        return;
    g->z_ready = 1;
    g->state = GZ_MEMBER;
}

static la_ssize_t input_read_cb(struct archive *a, void *data, const void **buf)
{
    struct io_input *in = data;
    ssize_t n;
    do
        n = read(in->fd, in->raw, INPUT_BLOCK);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        archive_set_error(a, errno, "read error: %s", strerror(errno));
        return -1;
    }
    if (!in->raw_read)
        gz_start(&in->gz, in->raw, (size_t)n);
    gz_feed(&in->gz, in->raw, (size_t)n);
    in->raw_read += (uint64_t)n;
    *buf = in->raw;
    return n;
}

/* Skipping compressed bytes (tar over a plain file) is a seek; with gzip's checks on nothing
 * is skipped (libarchive reads it instead). */
static la_int64_t input_skip_cb(struct archive *a, void *data, la_int64_t request)
{
    (void)a;
    struct io_input *in = data;
    if (!in->regular || in->gz.state != GZ_OFF || request <= 0)
        return 0;
    off_t here = lseek(in->fd, 0, SEEK_CUR);
    if (here < 0 || lseek(in->fd, (off_t)request, SEEK_CUR) < 0)
        return 0;
    in->raw_read += (uint64_t)request;
    return request;
}

/* zip's reader seeks to the central directory; gzip's checks, sequential, stop then. */
static la_int64_t input_seek_cb(struct archive *a, void *data, la_int64_t offset, int whence)
{
    struct io_input *in = data;
    off_t r = lseek(in->fd, (off_t)offset, whence);
    if (r < 0) {
        archive_set_error(a, errno, "seek error: %s", strerror(errno));
        return ARCHIVE_FATAL;
    }
    in->gz.state = GZ_OFF;
    return (la_int64_t)r;
}

/* A fatal error when gzip's checks have found one (mid-stream: reported at once), else ST_OK. */
static enum status gz_error(struct io_input *in, struct err_detail *err)
{
    if (in->gz.state != GZ_BAD)
        return ST_OK;
    /* (no line: the compressed data is checked ahead of the lines read) */
    struct err_detail tmp;
    err_set(&tmp, ST_ERR_FORMAT, "%s: %s", in->path, in->gz.msg);
    in->fatal = ST_ERR_FORMAT;
    memcpy(in->fatal_msg, tmp.msg, sizeof(in->fatal_msg));
    return err_set(err, ST_ERR_FORMAT, "%s", tmp.msg);
}

/* After the decoded input's end: the compressed bytes libarchive left unread (a tar's
 * trailing blocks, data after the gzip stream) go through gzip's checks too; then a member
 * still open means the file was cut. ST_OK or a fatal error. */
static enum status gz_finish(struct io_input *in, struct err_detail *err)
{
    while (in->gz.state != GZ_OFF && in->gz.state != GZ_BAD) {
        ssize_t n = read(in->fd, in->raw, INPUT_BLOCK);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return fail(in, ST_ERR_IO, err, strerror(errno));
        if (!n)
            break;
        in->raw_read += (uint64_t)n;
        gz_feed(&in->gz, in->raw, (size_t)n);
    }
    if (in->gz.state == GZ_MEMBER || in->gz.magic1)
        gz_bad(&in->gz, "the file ends inside a gzip member (truncated)");
    return gz_error(in, err);
}

static int ends_with_jsonl(const char *name)
{
    size_t n = strlen(name);
    return n >= 6 && strcasecmp(name + n - 6, ".jsonl") == 0;
}

/* AppleDouble resource forks and macOS metadata folders that zip tools add. */
static int is_mac_junk(const char *name)
{
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    return strncmp(base, "._", 2) == 0 || strncmp(name, "__MACOSX/", 9) == 0 ||
           strstr(name, "/__MACOSX/") != NULL;
}

static void set_format(struct io_input *in)
{
    int fmt = archive_format(in->a);
    int base = fmt & ARCHIVE_FORMAT_BASE_MASK;
    in->is_archive = base == ARCHIVE_FORMAT_TAR || base == ARCHIVE_FORMAT_ZIP;
    const char *fname = base == ARCHIVE_FORMAT_TAR   ? "tar"
                        : base == ARCHIVE_FORMAT_ZIP ? "zip"
                        : base == ARCHIVE_FORMAT_RAW ? "raw"
                                                     : "empty";
    int nf = archive_filter_count(in->a);
    /* filter 0 is the outermost decoder seen by the format; "none" is the file itself */
    if (nf > 1 && archive_filter_code(in->a, 0) != ARCHIVE_FILTER_NONE)
        snprintf(in->format, sizeof(in->format), "%s+%s", fname, archive_filter_name(in->a, 0));
    else
        snprintf(in->format, sizeof(in->format), "%s", fname);
}

/* Advance to the next member to read. ST_OK with in_member set, IO_INPUT_END, or fatal. */
static enum status next_member(struct io_input *in, struct err_detail *err)
{
    for (;;) {
        struct archive_entry *e = NULL;
        int r = archive_read_next_header(in->a, &e);
        if (!in->started && r != ARCHIVE_FATAL) {
            in->started = 1;
            set_format(in);
        }
        if (r == ARCHIVE_EOF) {
            in->done = 1;
            enum status gst = gz_finish(in, err);
            if (gst)
                return gst;
            if (in->is_archive && in->members_read == 0) {
                in->line_no = 0;
                return fail(in, ST_ERR_FORMAT, err,
                            "archive holds no .jsonl member (only regular files named "
                            "*.jsonl are read)");
            }
            return IO_INPUT_END;
        }
        /* (a name libarchive could not convert to the locale is read as UTF-8 below) */
        if (r == ARCHIVE_WARN &&
            !(e && !archive_entry_pathname(e) && archive_entry_pathname_utf8(e))) {
            LOG_WARN("%s: %s", in->path, archive_error_string(in->a));
        } else if (r == ARCHIVE_WARN) {
        } else if (r != ARCHIVE_OK) {
            enum status gst = gz_error(in, err); /* (the more precise message) */
            if (gst)
                return gst;
            const char *msg = archive_error_string(in->a);
            char buf[300];
            snprintf(buf, sizeof(buf), "%s%s",
                     in->started ? "corrupt archive: " : "unreadable input: ",
                     msg ? msg : "unknown libarchive error");
            return fail(in, ST_ERR_FORMAT, err, buf);
        }
        free(in->member);
        in->member = NULL;
        in->members_seen++;
        if (in->is_archive) {
            /* in the C locale (quern sets none) libarchive cannot convert a zip's UTF-8-flagged
             * name to the locale's charset and gives NULL: "café.jsonl" was skipped unread */
            const char *name = archive_entry_pathname(e);
            if (!name)
                name = archive_entry_pathname_utf8(e);
            if (!name) {
                char what[200];
                snprintf(what, sizeof(what),
                         "member %llu of the archive has a name that cannot be read (%s): its "
                         "lines would be lost; rename it",
                         (unsigned long long)in->members_seen,
                         archive_error_string(in->a) ? archive_error_string(in->a) : "no name");
                return fail(in, ST_ERR_FORMAT, err, what);
            }
            if (archive_entry_filetype(e) == AE_IFDIR) {
                LOG_DEBUG("%s: skipping directory %s", in->path, name);
                continue;
            }
            if (archive_entry_filetype(e) != AE_IFREG) {
                LOG_INFO("%s: skipping member %s (not a regular file)", in->path, name);
                continue;
            }
            if (is_mac_junk(name)) {
                LOG_INFO("%s: skipping member %s (macOS metadata)", in->path, name);
                continue;
            }
            if (!ends_with_jsonl(name)) {
                LOG_INFO("%s: skipping member %s (name does not end in .jsonl)", in->path, name);
                continue;
            }
            in->member = strdup(name);
            if (!in->member)
                return fail(in, ST_ERR_NOMEM, err, "out of memory");
        }
        in->members_read++;
        in->in_member = 1;
        in->member_eof = 0;
        in->chunk_len = in->chunk_pos = 0;
        in->chunk_off = 0;
        in->acc_len = 0;
        in->in_line = 0;
        in->overlong = 0;
        in->line_no = 0;
        in->line_off = 0;
        return ST_OK;
    }
}

/* Read the next chunk of the current member; sets member_eof at its end. */
static enum status read_chunk(struct io_input *in, struct err_detail *err)
{
    in->chunk_off += in->chunk_len;
    in->chunk_pos = in->chunk_len = 0;
    la_ssize_t n;
    do
        n = archive_read_data(in->a, in->chunk, INPUT_CHUNK);
    while (n == ARCHIVE_RETRY);
    /* ARCHIVE_WARN from a data read (a zip member's bad CRC) is an error too: libarchive
     * returns it instead of the bytes the call read, so going on would lose them */
    enum status gst = gz_error(in, err);
    if (gst)
        return gst;
    if (n < 0) {
        const char *msg = archive_error_string(in->a);
        char buf[300];
        snprintf(buf, sizeof(buf), "corrupt or truncated data: %s",
                 msg ? msg : "unknown libarchive error");
        return fail(in, ST_ERR_FORMAT, err, buf);
    }
    if (n <= 0) {
        in->member_eof = 1;
        return ST_OK;
    }
    in->chunk_len = (size_t)n;
    if (in->chunk_off < INPUT_SNIFF) {
        size_t look = INPUT_SNIFF - (size_t)in->chunk_off;
        if (look > in->chunk_len)
            look = in->chunk_len;
        const char *z = memchr(in->chunk, 0, look);
        /* binary: a NUL in the first line, or several (0.1 %: random bytes have 0.4 %); a NUL
         * in a later line of a text file is that line's error (as past the first 64 KiB) */
        const char *nl = z ? memchr(in->chunk, '\n', look) : NULL;
        size_t nuls = 0;
        for (size_t i = 0; z && i < look; i++)
            nuls += !in->chunk[i];
        const unsigned char *u = (const unsigned char *)in->chunk;
        const int utf16 = in->chunk_off == 0 && look >= 2 &&
                          ((u[0] == 0xFF && u[1] == 0xFE) || (u[0] == 0xFE && u[1] == 0xFF));
        if (z && (utf16 || !nl || z < nl || (nuls >= 2 && nuls * 1000 >= look))) {
            in->chunk_pos = (size_t)(z - in->chunk);
            for (const char *p = in->chunk; p < z; p++) /* (the line the NUL is on) */
                in->line_no += *p == '\n';
            return fail(in, ST_ERR_FORMAT, err,
                        utf16 ? "UTF-16 text (its byte order mark): convert it to UTF-8, e.g. "
                                "`iconv -f UTF-16 -t UTF-8`"
                        : in->is_archive
                            ? "binary data (NUL byte) in a .jsonl member: not JSONL text"
                            : "binary data (NUL byte): not JSONL text, nor a recognized "
                              "compressed file (gzip, zstd, xz, bzip2, ...) or tar/zip "
                              "archive");
        }
    }
    return ST_OK;
}

/* Finish the current line: check its length, strip '\r', hand it out. */
static enum status emit(struct io_input *in, const char *p, size_t n, const char **line,
                        size_t *len, struct io_input_pos *pos, struct err_detail *err)
{
    int was_overlong = in->overlong;
    in->in_line = 0;
    in->overlong = 0;
    in->acc_len = 0;
    fill_pos(in, pos);
    if (!was_overlong && n > 0 && p[n - 1] == '\r')
        n--;
    if (was_overlong || n > in->max_line) {
        char where[160];
        if (in->member)
            snprintf(where, sizeof(where), "member %.100s, ", in->member);
        else
            where[0] = 0;
        return err_set(err, ST_ERR_RANGE, "%s: %sline %llu: line longer than %zu bytes", in->path,
                       where, (unsigned long long)in->line_no, in->max_line);
    }
    *line = p;
    *len = n;
    return ST_OK;
}

enum status io_input_next(struct io_input *in, const char **line, size_t *len,
                          struct io_input_pos *pos, struct err_detail *err)
{
    *line = NULL;
    *len = 0;
    for (;;) {
        if (in->fatal != ST_OK) {
            fill_pos(in, pos);
            return err_set(err, in->fatal, "%s", in->fatal_msg);
        }
        if (!in->in_member) {
            if (in->done)
                return IO_INPUT_END;
            enum status st = next_member(in, err);
            if (st != ST_OK) {
                fill_pos(in, pos);
                return st;
            }
        }
        if (in->chunk_pos == in->chunk_len) {
            if (in->member_eof) {
                in->in_member = 0;
                if (in->in_line) /* last line without a newline */
                    return emit(in, in->acc, in->acc_len, line, len, pos, err);
                continue;
            }
            enum status st = read_chunk(in, err);
            if (st != ST_OK) {
                fill_pos(in, pos);
                return st;
            }
            continue;
        }
        if (!in->in_line) {
            in->in_line = 1;
            in->line_no++;
            in->line_off = in->chunk_off + in->chunk_pos;
        }
        char *seg = in->chunk + in->chunk_pos;
        size_t avail = in->chunk_len - in->chunk_pos;
        char *nl = memchr(seg, '\n', avail);
        size_t seglen = nl ? (size_t)(nl - seg) : avail;
        in->chunk_pos += nl ? seglen + 1 : seglen;
        if (in->overlong) {
            if (nl)
                return emit(in, NULL, 0, line, len, pos, err);
            continue;
        }
        if (nl && in->acc_len == 0) /* whole line inside the chunk: hand it out in place */
            return emit(in, seg, seglen, line, len, pos, err);
        /* gather; +1 leaves room for the '\r' of a max_line-long line */
        if (in->acc_len + seglen > in->max_line + 1) {
            in->overlong = 1;
            in->acc_len = 0;
            if (nl)
                return emit(in, NULL, 0, line, len, pos, err);
            continue;
        }
        memcpy(in->acc + in->acc_len, seg, seglen);
        in->acc_len += seglen;
        if (nl)
            return emit(in, in->acc, in->acc_len, line, len, pos, err);
    }
}

enum status io_input_check(const char *path, struct err_detail *err)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return err_set(err, errno == ENOENT ? ST_ERR_NOT_FOUND : ST_ERR_IO,
                       "%s: cannot open input: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode))
        return err_set(err, ST_ERR_INVALID_ARG, "%s: is a directory, not an input file", path);
    if (access(path, R_OK) != 0)
        return err_set(err, ST_ERR_IO, "%s: cannot open input: %s", path, strerror(errno));
    return ST_OK;
}

enum status io_input_open(struct io_input **out, const char *path, size_t max_line,
                          struct err_detail *err)
{
    *out = NULL;
    if (max_line == 0 || max_line > ((size_t)1 << 40))
        return err_set(err, ST_ERR_INVALID_ARG, "%s: max_line %zu out of range", path, max_line);
    enum status cst = io_input_check(path, err);
    if (cst)
        return cst;

    struct io_input *in = calloc(1, sizeof(*in));
    if (!in)
        return err_set(err, ST_ERR_NOMEM, "%s: out of memory", path);
    in->max_line = max_line;
    in->fd = -1;
    in->path = strdup(path);
    in->chunk = malloc(INPUT_CHUNK);
    in->raw = malloc(INPUT_BLOCK);
    in->acc = malloc(max_line + 1);
    in->a = archive_read_new();
    if (!in->path || !in->chunk || !in->raw || !in->acc || !in->a) {
        io_input_close(in);
        return err_set(err, ST_ERR_NOMEM, "%s: out of memory", path);
    }
    archive_read_support_filter_all(in->a);
    archive_read_support_format_tar(in->a);
    archive_read_support_format_zip(in->a);
    archive_read_support_format_empty(in->a);
    archive_read_support_format_raw(in->a);
    in->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (in->fd < 0) {
        enum status st =
            err_set(err, ST_ERR_IO, "%s: cannot open input: %s", path, strerror(errno));
        io_input_close(in);
        return st;
    }
    struct stat sb;
    in->regular = !fstat(in->fd, &sb) && S_ISREG(sb.st_mode);
    /* our own callbacks over fd (as archive_read_open_fd's, plus gzip's checks on the way) */
    archive_read_set_callback_data(in->a, in);
    archive_read_set_read_callback(in->a, input_read_cb);
    archive_read_set_skip_callback(in->a, input_skip_cb);
    if (in->regular)
        archive_read_set_seek_callback(in->a, input_seek_cb);
    /* the file is readable, so a failure here is about its content (a corrupt header) */
    if (archive_read_open1(in->a) != ARCHIVE_OK) {
        const char *msg = archive_error_string(in->a);
        enum status st = err_set(err, ST_ERR_FORMAT, "%s: unreadable input: %s", path,
                                 msg ? msg : "unknown libarchive error");
        io_input_close(in);
        return st;
    }
    /* Read the first header now so that unreadable or binary input fails at open. */
    enum status st = next_member(in, err);
    if (st == ST_OK)
        st = read_chunk(in, err);
    if (st != ST_OK && st != IO_INPUT_END) {
        io_input_close(in);
        return st;
    }
    if (st == IO_INPUT_END) /* empty input: remember that there is nothing to read */
        in->in_member = 0;
    *out = in;
    return ST_OK;
}

const char *io_input_format(const struct io_input *in)
{
    return in->format[0] ? in->format : "unknown";
}

void io_input_close(struct io_input *in)
{
    if (!in)
        return;
    if (in->a)
        archive_read_free(in->a);
    if (in->fd >= 0)
        close(in->fd);
    if (in->gz.z_ready)
        inflateEnd(&in->gz.z);
    free(in->gz.out);
    free(in->raw);
    free(in->path);
    free(in->member);
    free(in->chunk);
    free(in->acc);
    free(in);
}
