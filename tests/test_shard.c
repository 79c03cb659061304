/* Unit tests for io/shard (zstd JSONL shards and their exactly-once protocol), common/sha256
 * and io/manifest: round trips over several flushes, torn tails discarded on reopen, lost
 * committed data detected, frames readable by plain libzstd and the zstd CLI, a writer
 * SIGKILLed at random moments, FIPS 180-4 vectors, manifest.json parsed back, and the sweep of
 * temporary files that killed writers left. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include "common/proc.h"
#include "common/sha256.h"
#include "io/manifest.h"
#include "io/shard.h"
#include "tests/test_util.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static char tmpdir[256];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static int setup_dir(void **state)
{
    (void)state;
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof(tmpdir), "%s/quern_shard_XXXXXX", t && *t ? t : "/tmp");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    return nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void path_in(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s", tmpdir, name);
}

/* Deterministic record i: JSON text of varying length (0..~2.3 KB of padding). */
static size_t make_record(uint64_t i, char *buf, size_t cap)
{
    size_t pad = (size_t)((i * 7919u) % 2300u);
    int n = snprintf(buf, cap, "{\"custom_id\":\"req-%llu\",\"pad\":\"", (unsigned long long)i);
    size_t len = (size_t)n;
    for (size_t k = 0; k < pad && len + 3 < cap; k++)
        buf[len++] = (char)('a' + (i + k) % 26);
    buf[len++] = '"';
    buf[len++] = '}';
    buf[len] = 0;
    return len;
}

/* Collects lines read back from a shard. */
struct collect {
    char **lines;   /* copies (owned) */
    size_t *lens;   /* their lengths */
    size_t n, cap;  /* used / allocated */
    size_t stop_at; /* return ST_ERR_INTERNAL on this line (0-based) when nonzero */
};

static enum status collect_line(const char *line, size_t len, void *user)
{
    struct collect *c = user;
    assert_int_equal(line[len], 0); /* the reader NUL-terminates */
    if (c->stop_at && c->n == c->stop_at)
        return ST_ERR_INTERNAL;
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 64;
        c->lines = realloc(c->lines, c->cap * sizeof(*c->lines));
        c->lens = realloc(c->lens, c->cap * sizeof(*c->lens));
        assert_non_null(c->lines);
        assert_non_null(c->lens);
    }
    c->lines[c->n] = malloc(len + 1);
    memcpy(c->lines[c->n], line, len + 1);
    c->lens[c->n] = len;
    c->n++;
    return ST_OK;
}

static void collect_free(struct collect *c)
{
    for (size_t i = 0; i < c->n; i++)
        free(c->lines[i]);
    free(c->lines);
    free(c->lens);
    memset(c, 0, sizeof(*c));
}

/* Read path up to limit and check it holds exactly records 0..n-1. */
static void expect_records(const char *path, uint64_t limit, uint64_t n)
{
    struct collect c = {0};
    struct err_detail err = {0};
    enum status st = io_shard_read(path, limit, collect_line, &c, &err);
    if (st != ST_OK)
        fail_msg("read %s: %s", path, err.msg);
    assert_int_equal(c.n, n);
    static char buf[4096];
    for (uint64_t i = 0; i < n; i++) {
        size_t len = make_record(i, buf, sizeof(buf));
        assert_int_equal(c.lens[i], len);
        assert_memory_equal(c.lines[i], buf, len);
    }
    collect_free(&c);
}

static uint64_t file_size(const char *path)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    return (uint64_t)sb.st_size;
}

/* Append records [from, to) to s. */
static void append_range(struct io_shard *s, uint64_t from, uint64_t to)
{
    char buf[4096];
    struct err_detail err = {0};
    for (uint64_t i = from; i < to; i++) {
        size_t len = make_record(i, buf, sizeof(buf));
        assert_int_equal(io_shard_append(s, buf, len, &err), ST_OK);
    }
}

static uint64_t flush_ok(struct io_shard *s, uint64_t *records)
{
    uint64_t committed = 0;
    struct err_detail err = {0};
    enum status st = io_shard_flush(s, &committed, records, &err);
    if (st != ST_OK)
        fail_msg("flush: %s", err.msg);
    return committed;
}

/* ---- shard ------------------------------------------------------------------------------ */

static void test_shard_roundtrip(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "results-00000.jsonl.zst");
    struct io_shard *s = NULL;
    struct err_detail err = {0};
    assert_int_equal(io_shard_open(&s, path, 0, 3, &err), ST_OK);
    const uint64_t cuts[] = {0, 1, 50, 51, 400, 1000, 1003, 2500};
    uint64_t committed = 0, records = 0;
    for (size_t k = 1; k < sizeof(cuts) / sizeof(cuts[0]); k++) {
        append_range(s, cuts[k - 1], cuts[k]);
        assert_int_equal(io_shard_pending_records(s), cuts[k] - cuts[k - 1]);
        assert_true(io_shard_pending_bytes(s) > 0);
        uint64_t c = flush_ok(s, &records);
        assert_true(c > committed);
        committed = c;
        assert_int_equal(records, cuts[k]);
        assert_int_equal(io_shard_pending_records(s), 0);
        assert_int_equal(io_shard_pending_bytes(s), 0);
        assert_int_equal(file_size(path), committed);
    }
    /* nothing buffered: a no-op that reports the same numbers */
    uint64_t c2 = 0, r2 = 0;
    assert_int_equal(io_shard_flush(s, &c2, &r2, &err), ST_OK);
    assert_int_equal(c2, committed);
    assert_int_equal(r2, 2500);
    /* a record with a newline is refused and changes nothing */
    assert_int_equal(io_shard_append(s, "a\nb", 3, &err), ST_ERR_INVALID_ARG);
    assert_int_equal(io_shard_pending_records(s), 0);
    io_shard_close(s);

    expect_records(path, IO_SHARD_ALL, 2500);
    expect_records(path, committed, 2500);
    uint64_t frames = 0, recs = 0;
    assert_int_equal(io_shard_verify(path, IO_SHARD_ALL, &frames, &recs, &err), ST_OK);
    assert_int_equal(frames, 7);
    assert_int_equal(recs, 2500);

    /* reopening at the full length counts the records and continues after them */
    assert_int_equal(io_shard_open(&s, path, committed, 3, &err), ST_OK);
    assert_int_equal(io_shard_records_total(s), 2500);
    assert_int_equal(io_shard_committed_bytes(s), committed);
    append_range(s, 2500, 2600);
    flush_ok(s, &records);
    assert_int_equal(records, 2600);
    io_shard_close(s);
    expect_records(path, IO_SHARD_ALL, 2600);
}

static void test_shard_empty_and_odd_records(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "odd.jsonl.zst");
    struct io_shard *s = NULL;
    struct err_detail err = {0};
    assert_int_equal(io_shard_open(&s, path, 0, 1, &err), ST_OK);
    /* an empty record, a big one (several decoder output buffers long), one with '\r' */
    size_t big_len = 3u << 20;
    char *big = malloc(big_len);
    for (size_t i = 0; i < big_len; i++)
        big[i] = (char)('A' + (i * 31 + i / 977) % 26);
    assert_int_equal(io_shard_append(s, "", 0, &err), ST_OK);
    assert_int_equal(io_shard_append(s, big, big_len, &err), ST_OK);
    assert_int_equal(io_shard_append(s, "x\ry", 3, &err), ST_OK);
    uint64_t recs = 0;
    uint64_t committed = flush_ok(s, &recs);
    assert_int_equal(recs, 3);
    io_shard_close(s);
    struct collect c = {0};
    assert_int_equal(io_shard_read(path, committed, collect_line, &c, &err), ST_OK);
    assert_int_equal(c.n, 3);
    assert_int_equal(c.lens[0], 0);
    assert_int_equal(c.lens[1], big_len);
    assert_memory_equal(c.lines[1], big, big_len);
    assert_int_equal(c.lens[2], 3);
    assert_memory_equal(c.lines[2], "x\ry", 3);
    collect_free(&c);
    /* a callback error stops the read and is returned */
    c.stop_at = 1;
    assert_int_equal(io_shard_read(path, committed, collect_line, &c, &err), ST_ERR_INTERNAL);
    assert_int_equal(c.n, 1);
    collect_free(&c);
    free(big);
}

/* Append raw bytes at the end of a file (a torn write from a killed run). */
static void append_bytes(const char *path, const void *p, size_t n)
{
    int fd = open(path, O_WRONLY | O_APPEND);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, p, n), (ssize_t)n);
    close(fd);
}

static void test_shard_torn_tail(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "torn.jsonl.zst");
    struct io_shard *s = NULL;
    struct err_detail err = {0};
    uint64_t recs = 0;

    assert_int_equal(io_shard_open(&s, path, 0, 3, &err), ST_OK);
    append_range(s, 0, 100);
    uint64_t c1 = flush_ok(s, &recs);
    /* a second frame that is written but whose commit never reached the queue, then half of
     * a third frame (a write torn by the kill) */
    append_range(s, 100, 180);
    uint64_t c2 = flush_ok(s, &recs);
    append_range(s, 180, 300);
    uint64_t c3 = flush_ok(s, &recs);
    io_shard_close(s);
    assert_int_equal(truncate(path, (off_t)(c2 + (c3 - c2) / 2)), 0);
    /* reading past the committed length sees a partial frame */
    assert_int_equal(io_shard_read(path, IO_SHARD_ALL, NULL, NULL, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "partial"));

    /* reopen with the committed length c1: records 100.. are gone; new ones continue */
    assert_int_equal(io_shard_open(&s, path, c1, 3, &err), ST_OK);
    assert_int_equal(file_size(path), c1);
    assert_int_equal(io_shard_records_total(s), 100);
    append_range(s, 100, 150);
    uint64_t c4 = flush_ok(s, &recs);
    assert_int_equal(recs, 150);
    io_shard_close(s);
    expect_records(path, IO_SHARD_ALL, 150);

    /* random garbage after the committed length is discarded as well */
    unsigned char junk[777];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (unsigned char)(i * 131 + 7);
    append_bytes(path, junk, sizeof(junk));
    assert_int_not_equal(io_shard_read(path, IO_SHARD_ALL, NULL, NULL, &err), ST_OK);
    assert_int_equal(io_shard_open(&s, path, c4, 3, &err), ST_OK);
    assert_int_equal(file_size(path), c4);
    append_range(s, 150, 160);
    flush_ok(s, &recs);
    assert_int_equal(recs, 160);
    io_shard_close(s);
    expect_records(path, IO_SHARD_ALL, 160);
}

static void test_shard_open_errors(void **state)
{
    (void)state;
    char path[300], missing[300];
    path_in(path, sizeof(path), "short.jsonl.zst");
    path_in(missing, sizeof(missing), "missing.jsonl.zst");
    struct io_shard *s = NULL;
    struct err_detail err = {0};
    uint64_t recs = 0;

    /* committed data but no file: lost output, said so */
    assert_int_equal(io_shard_open(&s, missing, 10, 3, &err), ST_ERR_NOT_FOUND);
    assert_null(s);
    assert_non_null(strstr(err.msg, "lost"));
    assert_int_equal(access(missing, F_OK), -1); /* not created */

    assert_int_equal(io_shard_open(&s, path, 0, 3, &err), ST_OK);
    append_range(s, 0, 40);
    uint64_t c1 = flush_ok(s, &recs);
    append_range(s, 40, 80);
    uint64_t c2 = flush_ok(s, &recs);
    /* a second writer on the same shard is refused while the first holds it */
    struct io_shard *s2 = NULL;
    assert_int_equal(io_shard_open(&s2, path, c2, 3, &err), ST_ERR_IO);
    assert_null(s2);
    assert_non_null(strstr(err.msg, "locked"));
    io_shard_close(s);

    /* committed length beyond the file: data lost, file left alone */
    assert_int_equal(io_shard_open(&s, path, c2 + 1, 3, &err), ST_ERR_FORMAT);
    assert_null(s);
    assert_non_null(strstr(err.msg, "lost"));
    assert_int_equal(file_size(path), c2);

    /* a committed length that is not a frame boundary fails verification, file unchanged */
    assert_int_equal(io_shard_open(&s, path, c1 + 5, 3, &err), ST_ERR_FORMAT);
    assert_null(s);
    assert_int_equal(file_size(path), c2);

    /* reading more than the file holds is an error too */
    assert_int_equal(io_shard_read(path, c2 + 100, NULL, NULL, &err), ST_ERR_FORMAT);

    /* a bad zstd level */
    assert_int_equal(io_shard_open(&s, path, c2, 1000, &err), ST_OK); /* zstd clamps */
    io_shard_close(s);
    expect_records(path, IO_SHARD_ALL, 80);
    io_shard_close(NULL);
}

static void test_shard_read_rejects_bad_frames(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "bad.jsonl.zst");
    struct err_detail err = {0};
    /* a valid zstd frame whose text does not end with '\n' */
    char z[256];
    size_t n = ZSTD_compress(z, sizeof(z), "{\"a\":1}\n{\"b\"", 13, 3);
    assert_false(ZSTD_isError(n));
    FILE *f = fopen(path, "wb");
    fwrite(z, 1, n, f);
    fclose(f);
    struct collect c = {0};
    assert_int_equal(io_shard_read(path, IO_SHARD_ALL, collect_line, &c, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "newline"));
    collect_free(&c);

    /* a flipped byte inside a frame: detected (block data or the checksum) */
    struct io_shard *s = NULL;
    uint64_t recs = 0;
    unlink(path);
    assert_int_equal(io_shard_open(&s, path, 0, 3, &err), ST_OK);
    append_range(s, 0, 200);
    uint64_t c1 = flush_ok(s, &recs);
    io_shard_close(s);
    size_t len = 0;
    char *data = test_read_file(path, &len);
    assert_int_equal(len, c1);
    data[len / 2] ^= 0x40;
    f = fopen(path, "wb");
    fwrite(data, 1, len, f);
    fclose(f);
    free(data);
    assert_int_equal(io_shard_read(path, IO_SHARD_ALL, NULL, NULL, &err), ST_ERR_FORMAT);
    assert_int_equal(io_shard_open(&s, path, c1, 3, &err), ST_ERR_FORMAT);
    assert_null(s);

    /* not zstd at all */
    f = fopen(path, "wb");
    fputs("{\"plain\":\"json\"}\n", f);
    fclose(f);
    assert_int_equal(io_shard_read(path, IO_SHARD_ALL, NULL, NULL, &err), ST_ERR_FORMAT);
}

/* Each frame decodes on its own with plain libzstd (content size and checksum present), and
 * the zstd command line tool decodes the whole file when it is installed. */
static void test_shard_plain_zstd(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "plain.jsonl.zst");
    struct io_shard *s = NULL;
    struct err_detail err = {0};
    uint64_t recs = 0;
    assert_int_equal(io_shard_open(&s, path, 0, 5, &err), ST_OK);
    const uint64_t cuts[] = {0, 10, 11, 300, 1000};
    for (size_t k = 1; k < 5; k++) {
        append_range(s, cuts[k - 1], cuts[k]);
        flush_ok(s, &recs);
    }
    io_shard_close(s);

    /* expected text */
    size_t exp_cap = 4u << 20, exp_len = 0;
    char *expect = malloc(exp_cap);
    for (uint64_t i = 0; i < 1000; i++) {
        exp_len += make_record(i, expect + exp_len, exp_cap - exp_len);
        expect[exp_len++] = '\n';
    }

    size_t len = 0;
    char *data = test_read_file(path, &len);
    char *got = malloc(exp_cap);
    size_t off = 0, got_len = 0, frames = 0;
    while (off < len) {
        size_t fs = ZSTD_findFrameCompressedSize(data + off, len - off);
        assert_false(ZSTD_isError(fs));
        /* Frame_Header_Descriptor follows the 4-byte magic; bit 2 is Content_Checksum_flag */
        assert_int_equal((unsigned char)data[off + 4] >> 2 & 1, 1);
        unsigned long long cs = ZSTD_getFrameContentSize(data + off, fs);
        assert_true(cs != ZSTD_CONTENTSIZE_UNKNOWN && cs != ZSTD_CONTENTSIZE_ERROR);
        size_t d = ZSTD_decompress(got + got_len, exp_cap - got_len, data + off, fs);
        assert_false(ZSTD_isError(d));
        assert_int_equal(d, cs);
        assert_int_equal(got[got_len + d - 1], '\n'); /* frames hold whole lines */
        got_len += d;
        off += fs;
        frames++;
    }
    assert_int_equal(frames, 4);
    assert_int_equal(got_len, exp_len);
    assert_memory_equal(got, expect, exp_len);

    if (system("command -v zstd >/dev/null 2>&1") == 0) {
        char cmd[800], out[300];
        path_in(out, sizeof(out), "plain.jsonl");
        snprintf(cmd, sizeof(cmd), "zstd -q -d -f -c '%s' > '%s'", path, out);
        assert_int_equal(system(cmd), 0);
        size_t cli_len = 0;
        char *cli = test_read_file(out, &cli_len);
        assert_int_equal(cli_len, exp_len);
        assert_memory_equal(cli, expect, exp_len);
        free(cli);
    } else {
        print_message("zstd CLI not installed: skipping the CLI check\n");
    }
    free(got);
    free(data);
    free(expect);
}

/* A child appends and flushes in a loop, reporting each committed length through a pipe,
 * and is SIGKILLed at a random moment; the parent resumes from the last reported length.
 * Repeated rounds must leave exactly records 0..n-1, in order, with nothing duplicated. */
static void test_shard_kill(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "killed.jsonl.zst");
    uint64_t committed = 0, records = 0;
    unsigned seed = (unsigned)time(NULL) ^ (unsigned)getpid();
    print_message("kill test seed %u\n", seed);
    srand(seed);
    /* at least 6 rounds in which the child committed something (a loaded machine may need
     * more rounds), at most 40 */
    int rounds_with_progress = 0, round;
    for (round = 0; round < 40 && rounds_with_progress < 6; round++) {
        int fds[2];
        assert_int_equal(pipe(fds), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(fds[0]);
            struct io_shard *s = NULL;
            struct err_detail err = {0};
            if (io_shard_open(&s, path, committed, 1, &err) != ST_OK) {
                fprintf(stderr, "child open: %s\n", err.msg);
                _exit(3);
            }
            uint64_t next = io_shard_records_total(s);
            if (next != records)
                _exit(4);
            for (uint64_t k = 0;; k++) {
                uint64_t batch = 1 + (next * 13 + k) % 40;
                char buf[4096];
                for (uint64_t i = next; i < next + batch; i++) {
                    size_t len = make_record(i, buf, sizeof(buf));
                    if (io_shard_append(s, buf, len, &err) != ST_OK)
                        _exit(5);
                }
                uint64_t msg[2];
                if (io_shard_flush(s, &msg[0], &msg[1], &err) != ST_OK)
                    _exit(6);
                next += batch;
                if (write(fds[1], msg, sizeof(msg)) != (ssize_t)sizeof(msg))
                    _exit(7);
            }
        }
        close(fds[1]);
        struct timespec ts = {0, (long)(10 + rand() % 60) * 1000000L};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        int wst = 0;
        assert_int_equal(waitpid(pid, &wst, 0), pid);
        if (!(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL))
            fail_msg("child exited with status %d instead of being killed", wst);
        uint64_t msg[2];
        uint64_t before = records;
        ssize_t r;
        while ((r = read(fds[0], msg, sizeof(msg))) == (ssize_t)sizeof(msg)) {
            assert_true(msg[0] > committed);
            assert_true(msg[1] > records);
            committed = msg[0];
            records = msg[1];
        }
        assert_int_equal(r, 0);
        close(fds[0]);
        if (records > before)
            rounds_with_progress++;
        /* what the queue would see on restart: the committed prefix verifies exactly */
        struct io_shard *s = NULL;
        struct err_detail err = {0};
        enum status st = io_shard_open(&s, path, committed, 1, &err);
        if (st != ST_OK)
            fail_msg("round %d: reopen at %llu: %s", round, (unsigned long long)committed, err.msg);
        assert_int_equal(io_shard_records_total(s), records);
        io_shard_close(s);
        assert_int_equal(file_size(path), committed);
    }
    print_message("kill test: %llu records in %llu bytes after %d kills\n",
                  (unsigned long long)records, (unsigned long long)committed, round);
    assert_true(rounds_with_progress >= 6);
    expect_records(path, IO_SHARD_ALL, records);
}

/* ---- sha256 ----------------------------------------------------------------------------- */

/* The SHA extensions' path (where this CPU has them) and the portable one give the same
 * digests: random messages of every length up to 1,100 bytes, fed whole and in pieces, and the
 * standard vectors through each (test_sha256_vectors runs on whichever is in use). */
static void test_sha256_shani(void **state)
{
    (void)state;
    int accel = sha256_force_scalar(0);
    if (!accel)
        print_message("(no SHA extensions on this CPU: only the portable path is checked)\n");
    unsigned char *msg = malloc(1100);
    assert_non_null(msg);
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < 1100; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        msg[i] = (unsigned char)x;
    }
    for (size_t len = 0; len <= 1100; len += len < 200 ? 1 : 37) {
        char a[SHA256_HEX_LEN], b[SHA256_HEX_LEN], c[SHA256_HEX_LEN];
        sha256_force_scalar(1);
        sha256_buf_hex(msg, len, a);
        sha256_force_scalar(0);
        sha256_buf_hex(msg, len, b);
        struct sha256 s; /* pieces of 1..191 bytes: whole blocks and partial ones mixed */
        uint8_t d[SHA256_DIGEST_LEN];
        sha256_init(&s);
        for (size_t off = 0, step = 1; off < len; step = step * 7 % 191 + 1) {
            size_t n = step < len - off ? step : len - off;
            sha256_update(&s, msg + off, n);
            off += n;
        }
        sha256_final(&s, d);
        sha256_hex(d, c);
        assert_string_equal(a, b);
        assert_string_equal(a, c);
    }
    char hex[SHA256_HEX_LEN];
    sha256_force_scalar(1);
    sha256_buf_hex("abc", 3, hex);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    sha256_force_scalar(0);
    sha256_buf_hex("abc", 3, hex);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    free(msg);
}

static void test_sha256_vectors(void **state)
{
    (void)state;
    static const struct {
        const char *msg;
        const char *hex;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklm"
         "nopqrlmnopqrsmnopqrstnopqrstu",
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    char hex[SHA256_HEX_LEN];
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        sha256_buf_hex(v[i].msg, strlen(v[i].msg), hex);
        assert_string_equal(hex, v[i].hex);
    }
    /* one million 'a', fed in uneven pieces */
    char *a = malloc(1000000);
    memset(a, 'a', 1000000);
    struct sha256 s;
    uint8_t d[SHA256_DIGEST_LEN];
    sha256_init(&s);
    size_t off = 0, step = 1;
    while (off < 1000000) {
        size_t n = step < 1000000 - off ? step : 1000000 - off;
        sha256_update(&s, a + off, n);
        off += n;
        step = step * 3 % 997 + 1;
    }
    sha256_final(&s, d);
    sha256_hex(d, hex);
    assert_string_equal(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(a);

    /* every split of a 200-byte message into two updates gives the one-shot digest */
    unsigned char msg[200];
    for (size_t i = 0; i < sizeof(msg); i++)
        msg[i] = (unsigned char)(i * 37 + 11);
    for (size_t len = 0; len <= sizeof(msg); len += 13) {
        char one[SHA256_HEX_LEN];
        sha256_buf_hex(msg, len, one);
        for (size_t cut = 0; cut <= len; cut++) {
            sha256_init(&s);
            sha256_update(&s, msg, cut);
            sha256_update(&s, msg + cut, len - cut);
            sha256_final(&s, d);
            sha256_hex(d, hex);
            assert_string_equal(hex, one);
        }
    }
}

static void test_sha256_file(void **state)
{
    (void)state;
    char path[300];
    path_in(path, sizeof(path), "random.bin");
    size_t n = (3u << 20) + 17;
    unsigned char *buf = malloc(n);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (unsigned char)x;
    }
    FILE *f = fopen(path, "wb");
    assert_int_equal(fwrite(buf, 1, n, f), n);
    fclose(f);
    char hex[SHA256_HEX_LEN], ref[SHA256_HEX_LEN];
    struct err_detail err = {0};
    assert_int_equal(sha256_file(path, SHA256_WHOLE_FILE, hex, &err), ST_OK);
    sha256_buf_hex(buf, n, ref);
    assert_string_equal(hex, ref);
    /* a prefix */
    assert_int_equal(sha256_file(path, 1000, hex, &err), ST_OK);
    sha256_buf_hex(buf, 1000, ref);
    assert_string_equal(hex, ref);
    assert_int_equal(sha256_file(path, n + 1, hex, &err), ST_ERR_FORMAT);
    assert_int_equal(sha256_file("/nonexistent/x", SHA256_WHOLE_FILE, hex, &err), ST_ERR_IO);
    /* against coreutils */
    if (system("command -v sha256sum >/dev/null 2>&1") == 0) {
        char cmd[400];
        snprintf(cmd, sizeof(cmd), "sha256sum '%s'", path);
        FILE *p = popen(cmd, "r");
        char line[200] = {0};
        assert_non_null(fgets(line, sizeof(line), p));
        pclose(p);
        assert_int_equal(sha256_file(path, SHA256_WHOLE_FILE, hex, &err), ST_OK);
        assert_memory_equal(line, hex, 64);
    } else {
        print_message("sha256sum not installed: skipping the coreutils check\n");
    }
    free(buf);
}

/* ---- manifest --------------------------------------------------------------------------- */

static const cJSON *get(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v)
        fail_msg("manifest lacks \"%s\"", key);
    return v;
}

static void test_manifest_roundtrip(void **state)
{
    (void)state;
    char dir[300], path[512], model[300];
    path_in(dir, sizeof(dir), "job-7");
    assert_int_equal(mkdir(dir, 0755), 0);
    struct err_detail err = {0};
    uint64_t recs = 0;

    /* two real shards */
    struct io_manifest_shard sh[2] = {
        {.name = "results-00000.jsonl.zst", .kind = IO_SHARD_RESULTS},
        {.name = "errors-00000.jsonl.zst", .kind = IO_SHARD_ERRORS},
    };
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof(path), "%s/%s", dir, sh[k].name);
        struct io_shard *s = NULL;
        assert_int_equal(io_shard_open(&s, path, 0, 3, &err), ST_OK);
        append_range(s, 0, k ? 3 : 120);
        sh[k].bytes = flush_ok(s, &recs);
        sh[k].records = recs;
        io_shard_close(s);
    }
    /* the results checksum is given, the errors one is computed by the writer */
    assert_int_equal(sha256_file(path, SHA256_WHOLE_FILE, sh[1].sha256, &err), ST_OK);
    char errors_sum[SHA256_HEX_LEN];
    memcpy(errors_sum, sh[1].sha256, sizeof(errors_sum));
    sh[1].sha256[0] = 0;
    snprintf(path, sizeof(path), "%s/%s", dir, sh[0].name);
    assert_int_equal(sha256_file(path, SHA256_WHOLE_FILE, sh[0].sha256, &err), ST_OK);

    path_in(model, sizeof(model), "model.gguf");
    FILE *f = fopen(model, "wb");
    fputs("GGUF not really a model", f);
    fclose(f);
    char model_sum[SHA256_HEX_LEN];
    sha256_buf_hex("GGUF not really a model", 23, model_sum);

    struct io_manifest m = {
        .job_id = "job-7",
        .params_json = "{\"temperature\":0.7,\"max_tokens\":64,\"seed\":1,\"stop\":[\"\\n\\n\"]}",
        .model_path = model,
        .complete = 1,
        .created_unix = 1700000000,
        .shards = sh,
        .n_shards = 2,
    };
    assert_int_equal(io_manifest_write(dir, &m, &err), ST_OK);

    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    size_t len = 0;
    char *text = test_read_file(path, &len);
    assert_non_null(text);
    assert_int_equal(text[len - 1], '\n');
    cJSON *root = cJSON_Parse(text);
    assert_non_null(root);
    assert_int_equal(get(root, "manifest_version")->valueint, IO_MANIFEST_VERSION);
    assert_string_equal(get(root, "job_id")->valuestring, "job-7");
    assert_true(cJSON_IsTrue(get(root, "complete")));
    assert_true(get(root, "created_unix")->valuedouble == 1700000000.0);
    const cJSON *params = get(root, "params");
    assert_true(get(params, "temperature")->valuedouble == 0.7);
    assert_int_equal(get(params, "max_tokens")->valueint, 64);
    assert_string_equal(cJSON_GetArrayItem(get(params, "stop"), 0)->valuestring, "\n\n");
    const cJSON *mo = get(root, "model");
    assert_string_equal(get(mo, "path")->valuestring, model);
    assert_string_equal(get(mo, "sha256")->valuestring, model_sum);
    const cJSON *shards = get(root, "shards");
    assert_int_equal(cJSON_GetArraySize(shards), 2);
    const char *want_sum[2] = {sh[0].sha256, errors_sum};
    for (int k = 0; k < 2; k++) {
        const cJSON *o = cJSON_GetArrayItem(shards, k);
        assert_string_equal(get(o, "file")->valuestring, sh[k].name);
        assert_string_equal(get(o, "kind")->valuestring, k ? "errors" : "results");
        assert_true(get(o, "records")->valuedouble == (double)sh[k].records);
        assert_true(get(o, "bytes")->valuedouble == (double)sh[k].bytes);
        assert_string_equal(get(o, "sha256")->valuestring, want_sum[k]);
    }
    const cJSON *tot = get(root, "totals");
    assert_int_equal(get(get(tot, "results"), "records")->valueint, 120);
    assert_int_equal(get(get(tot, "errors"), "records")->valueint, 3);
    assert_int_equal(get(get(tot, "errors"), "shards")->valueint, 1);
    cJSON_Delete(root);
    free(text);

    /* a cJSON params object, and no model; rewrite replaces the file, no temp left over */
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "format", "openai-batch");
    struct io_manifest m2 = {.params = p, .shards = sh, .n_shards = 1};
    assert_int_equal(io_manifest_write(dir, &m2, &err), ST_OK);
    cJSON_Delete(p);
    text = test_read_file(path, &len);
    root = cJSON_Parse(text);
    assert_non_null(root);
    assert_string_equal(get(get(root, "params"), "format")->valuestring, "openai-batch");
    assert_false(cJSON_IsTrue(get(root, "complete")));
    assert_int_equal(cJSON_GetArraySize(get(root, "shards")), 1);
    cJSON_Delete(root);
    free(text);

    /* bad input fails and leaves the previous manifest in place */
    size_t before_len = 0;
    char *before = test_read_file(path, &before_len);
    struct io_manifest bad = {.params_json = "[1,2]"};
    assert_int_equal(io_manifest_write(dir, &bad, &err), ST_ERR_INVALID_ARG);
    struct io_manifest_shard bad_sh = {.name = "../x", .kind = IO_SHARD_RESULTS};
    struct io_manifest bad2 = {.shards = &bad_sh, .n_shards = 1};
    assert_int_equal(io_manifest_write(dir, &bad2, &err), ST_ERR_INVALID_ARG);
    struct io_manifest_shard gone = {.name = "results-00009.jsonl.zst", .bytes = 10};
    struct io_manifest bad3 = {.shards = &gone, .n_shards = 1};
    assert_int_equal(io_manifest_write(dir, &bad3, &err), ST_ERR_IO);
    char *after = test_read_file(path, &len);
    assert_int_equal(len, before_len);
    assert_memory_equal(after, before, len);
    free(before);
    free(after);
    /* only the two shards and manifest.json remain in the directory */
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "test $(ls -A '%s' | wc -l) -eq 3", dir);
    assert_int_equal(system(cmd), 0);
}

/* Never clobber: io_shard_create refuses an existing file and a planted symbolic link (the
 * link's target untouched), io_shard_open refuses to follow a link; io_shard_locked sees a live
 * writer's lock; io_shard_abandon cuts frames flushed after the given length. */
static void test_shard_no_clobber(void **state)
{
    (void)state;
    char path[512], victim[512], link_path[512];
    struct err_detail err = {0};
    struct io_shard *s = NULL;
    path_in(victim, sizeof(victim), "victim.txt");
    FILE *f = fopen(victim, "w");
    assert_non_null(f);
    fputs("precious\n", f);
    fclose(f);

    path_in(path, sizeof(path), "existing.jsonl.zst");
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("someone else's\n", f);
    fclose(f);
    assert_int_equal(io_shard_create(&s, path, 3, &err), ST_ERR_EXISTS);
    assert_null(s);
    assert_int_equal(file_size(path), 15);

    path_in(link_path, sizeof(link_path), "link.jsonl.zst");
    assert_int_equal(symlink(victim, link_path), 0);
    assert_int_not_equal(io_shard_create(&s, link_path, 3, &err), ST_OK);
    assert_int_not_equal(io_shard_open(&s, link_path, 0, 3, &err), ST_OK);
    assert_null(s);
    assert_int_equal(file_size(victim), 9);

    path_in(path, sizeof(path), "fresh.jsonl.zst");
    assert_int_equal(io_shard_locked(path), 0); /* no file */
    assert_int_equal(io_shard_create(&s, path, 3, &err), ST_OK);
    assert_int_equal(io_shard_locked(path), 1); /* our own writer holds it */
    append_range(s, 0, 5);
    uint64_t recs = 0, first = flush_ok(s, &recs);
    append_range(s, 5, 9);
    uint64_t second = flush_ok(s, &recs);
    assert_true(second > first);
    assert_int_equal(io_shard_abandon(s, first, &err), ST_OK);
    assert_int_equal(file_size(path), first);
    assert_int_equal(io_shard_locked(path), 0);
    assert_int_equal(io_shard_verify(path, IO_SHARD_ALL, NULL, &recs, &err), ST_OK);
    assert_int_equal(recs, 5);
}

static void touch_in(const char *name)
{
    char path[1024];
    path_in(path, sizeof(path), name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fclose(f);
}

static int exists_in(const char *name)
{
    char path[1024];
    struct stat sb;
    path_in(path, sizeof(path), name);
    return !lstat(path, &sb);
}

/* io_file_replace removes the temp files of its name's dead writers (not a live one's, not
 * another name's), once per directory and name in a process; proc_sweep_dead with random
 * characters (export's "<name>.tmp.XXXXXX.<tag>") wants exactly that many. */
static void test_replace_sweep(void **state)
{
    (void)state;
    char dead[400], self[400], name[600];
    struct err_detail err = {0};
    assert_int_equal(test_dead_proc_tag(dead, sizeof(dead)), 0);
    assert_int_equal(proc_tag_liveness(dead), PROC_DEAD);
    assert_int_equal(proc_tag_self(self, sizeof(self)), 0);
    const char *made[] = {".m.json.tmp.%s", ".m.json.tmp.x%s", ".other.tmp.%s", "m.json.tmp.%s"};
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof(name), made[i], dead);
        touch_in(name);
    }
    snprintf(name, sizeof(name), ".m.json.tmp.%s.live", self); /* not a tag: unknown, kept */
    touch_in(name);
    assert_int_equal(io_file_replace(tmpdir, "m.json", "{}\n", 3, NULL, &err), ST_OK);
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof(name), made[i], dead);
        assert_int_equal(exists_in(name), i != 0);
    }
    snprintf(name, sizeof(name), ".m.json.tmp.%s.live", self);
    assert_true(exists_in(name));
    /* a second replace in this process does not read the directory again */
    snprintf(name, sizeof(name), made[0], dead);
    touch_in(name);
    assert_int_equal(io_file_replace(tmpdir, "m.json", "{}\n", 3, NULL, &err), ST_OK);
    assert_true(exists_in(name));
    assert_true(exists_in("m.json"));

    const char *exp[] = {"o.tar.tmp.AbC123.%s", "o.tar.tmp.AbC12.%s", "o.tar.tmp.AbC1234.%s",
                         "o.tar.tmp.AbC-23.%s"};
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof(name), exp[i], dead);
        touch_in(name);
    }
    proc_sweep_dead(tmpdir, "o.tar.tmp.", 6, "a test");
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof(name), exp[i], dead);
        assert_int_equal(exists_in(name), i != 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_roundtrip),
        cmocka_unit_test(test_shard_empty_and_odd_records),
        cmocka_unit_test(test_shard_torn_tail),
        cmocka_unit_test(test_shard_open_errors),
        cmocka_unit_test(test_shard_read_rejects_bad_frames),
        cmocka_unit_test(test_shard_plain_zstd),
        cmocka_unit_test(test_shard_kill),
        cmocka_unit_test(test_sha256_vectors),
        cmocka_unit_test(test_sha256_shani),
        cmocka_unit_test(test_sha256_file),
        cmocka_unit_test(test_manifest_roundtrip),
        cmocka_unit_test(test_shard_no_clobber),
        cmocka_unit_test(test_replace_sweep),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
