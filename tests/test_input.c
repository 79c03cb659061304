/* Unit tests for io/input: the same lines from .jsonl, .jsonl.gz, .jsonl.zst, .tar, .tar.gz,
 * .tar.zst and .zip inputs (written here with libarchive's writer) with member names and
 * line numbers; CRLF and empty lines; over-long lines reported alone; truncated, corrupt
 * and binary input; and memory that stays flat over a large input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <archive.h>
#include <archive_entry.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "io/input.h"
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
    snprintf(tmpdir, sizeof(tmpdir), "%s/quern_input_XXXXXX", t && *t ? t : "/tmp");
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

enum filter { F_NONE, F_GZIP, F_ZSTD };

/* One archive member to write; dir != 0 writes a directory entry. */
struct member {
    const char *name; /* path inside the archive */
    const char *data; /* contents */
    size_t len;       /* bytes of data */
    int dir;          /* 1 for a directory entry */
};

static void add_filter(struct archive *a, enum filter f)
{
    if (f == F_GZIP)
        assert_int_equal(archive_write_add_filter_gzip(a), ARCHIVE_OK);
    else if (f == F_ZSTD)
        assert_int_equal(archive_write_add_filter_zstd(a), ARCHIVE_OK);
}

static void write_entry(struct archive *a, const struct member *m)
{
    struct archive_entry *e = archive_entry_new();
    archive_entry_set_pathname(e, m->name);
    archive_entry_set_filetype(e, m->dir ? AE_IFDIR : AE_IFREG);
    archive_entry_set_perm(e, m->dir ? 0755 : 0644);
    archive_entry_set_size(e, m->dir ? 0 : (la_int64_t)m->len);
    archive_entry_set_mtime(e, 1700000000, 0);
    if (archive_write_header(a, e) != ARCHIVE_OK)
        fail_msg("write header %s: %s", m->name, archive_error_string(a));
    if (!m->dir && m->len)
        assert_int_equal(archive_write_data(a, m->data, m->len), (la_ssize_t)m->len);
    archive_entry_free(e);
}

/* A single (possibly compressed) file holding data. */
static void write_single(const char *path, enum filter f, const char *data, size_t len)
{
    if (f == F_NONE) {
        FILE *fp = fopen(path, "wb");
        assert_non_null(fp);
        assert_int_equal(fwrite(data, 1, len, fp), len);
        fclose(fp);
        return;
    }
    struct archive *a = archive_write_new();
    add_filter(a, f);
    assert_int_equal(archive_write_set_format_raw(a), ARCHIVE_OK);
    assert_int_equal(archive_write_open_filename(a, path), ARCHIVE_OK);
    struct member m = {"data", data, len, 0};
    write_entry(a, &m);
    assert_int_equal(archive_write_close(a), ARCHIVE_OK);
    archive_write_free(a);
}

/* A tar (pax) or zip archive of the given members. */
static void write_archive(const char *path, int zip, enum filter f, const struct member *m,
                          size_t n)
{
    struct archive *a = archive_write_new();
    if (zip)
        assert_int_equal(archive_write_set_format_zip(a), ARCHIVE_OK);
    else
        assert_int_equal(archive_write_set_format_pax_restricted(a), ARCHIVE_OK);
    add_filter(a, f);
    assert_int_equal(archive_write_open_filename(a, path), ARCHIVE_OK);
    for (size_t i = 0; i < n; i++)
        write_entry(a, &m[i]);
    assert_int_equal(archive_write_close(a), ARCHIVE_OK);
    archive_write_free(a);
}

/* One line as read back. */
struct got {
    char text[512];     /* copy of the line (lines in these tests are short) */
    size_t len;         /* its length */
    char member[64];    /* member name, "" for single files */
    uint64_t line;      /* line number */
    enum status status; /* ST_OK or ST_ERR_RANGE */
};

/* Read everything from path; returns the number of lines (or line errors) and stores the
 * final status in *final (IO_INPUT_END when all went well). */
static size_t read_all(const char *path, size_t max_line, struct got *out, size_t cap,
                       enum status *final, struct err_detail *err)
{
    struct io_input *in = NULL;
    enum status st = io_input_open(&in, path, max_line, err);
    if (st != ST_OK) {
        *final = st;
        return 0;
    }
    size_t n = 0;
    for (;;) {
        const char *line;
        size_t len;
        struct io_input_pos pos;
        st = io_input_next(in, &line, &len, &pos, err);
        if (st != ST_OK && st != ST_ERR_RANGE)
            break;
        assert_true(n < cap);
        assert_string_equal(pos.path, path);
        out[n].status = st;
        out[n].len = st == ST_OK ? len : 0;
        assert_true(out[n].len < sizeof(out[n].text));
        if (st == ST_OK)
            memcpy(out[n].text, line, len);
        out[n].text[out[n].len] = 0;
        snprintf(out[n].member, sizeof(out[n].member), "%s", pos.member ? pos.member : "");
        out[n].line = pos.line;
        n++;
    }
    *final = st;
    /* the end is sticky */
    if (st == IO_INPUT_END) {
        const char *line;
        size_t len;
        assert_int_equal(io_input_next(in, &line, &len, NULL, err), IO_INPUT_END);
    }
    io_input_close(in);
    return n;
}

#define N_LINES 50

static char lines[N_LINES][200];

static void make_lines(void)
{
    for (int i = 0; i < N_LINES; i++)
        snprintf(lines[i], sizeof(lines[i]),
                 "{\"custom_id\":\"r%02d\",\"body\":{\"messages\":[{\"role\":\"user\",\"content\":"
                 "\"question %d %.*s\"}]}}",
                 i, i * i, i % 37, "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFG");
}

/* Lines [from, to) joined with '\n', the last one terminated too. */
static char *join(int from, int to, size_t *len)
{
    char *buf = malloc(200 * N_LINES);
    size_t n = 0;
    for (int i = from; i < to; i++) {
        size_t l = strlen(lines[i]);
        memcpy(buf + n, lines[i], l);
        n += l;
        buf[n++] = '\n';
    }
    *len = n;
    return buf;
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_same_lines_every_format(void **state)
{
    (void)state;
    make_lines();
    size_t all_len, a_len, b_len, c_len;
    char *all = join(0, N_LINES, &all_len);
    char *part_a = join(0, 20, &a_len);
    char *part_b = join(20, 45, &b_len);
    char *part_c = join(45, N_LINES, &c_len);
    static const char readme[] = "not jsonl\n";
    static const char junk[] = "\x00\x05\x16\x07binary resource fork";
    const struct member members[] = {
        {"data/", "", 0, 1},
        {"data/part-a.jsonl", part_a, a_len, 0},
        {"README.txt", readme, sizeof(readme) - 1, 0},
        {"data/._part-b.jsonl", junk, sizeof(junk) - 1, 0},
        {"data/part-b.JSONL", part_b, b_len, 0},
        {"notes.json", readme, sizeof(readme) - 1, 0},
        {"part-c.jsonl", part_c, c_len, 0},
    };
    const size_t n_members = sizeof(members) / sizeof(members[0]);

    static const struct {
        const char *name;   /* file name */
        int archive;        /* 0 single, 1 tar, 2 zip */
        enum filter filter; /* compression */
        const char *format; /* expected io_input_format */
    } cases[] = {
        {"in.jsonl", 0, F_NONE, "raw"},
        {"in.jsonl.gz", 0, F_GZIP, "raw+gzip"},
        {"in.jsonl.zst", 0, F_ZSTD, "raw+zstd"},
        {"in.tar", 1, F_NONE, "tar"},
        {"in.tar.gz", 1, F_GZIP, "tar+gzip"},
        {"in.tar.zst", 1, F_ZSTD, "tar+zstd"},
        {"in.zip", 2, F_NONE, "zip"},
        /* content decides, not the name: a gzip file called .jsonl, a zip called .dat */
        {"gz-named.jsonl", 0, F_GZIP, "raw+gzip"},
        {"zip-named.dat", 2, F_NONE, "zip"},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        char path[300];
        path_in(path, sizeof(path), cases[c].name);
        if (cases[c].archive == 0)
            write_single(path, cases[c].filter, all, all_len);
        else
            write_archive(path, cases[c].archive == 2, cases[c].filter, members, n_members);

        struct io_input *in = NULL;
        struct err_detail err = {0};
        if (io_input_open(&in, path, 1024, &err) != ST_OK)
            fail_msg("%s: %s", cases[c].name, err.msg);
        assert_string_equal(io_input_format(in), cases[c].format);
        io_input_close(in);

        struct got got[N_LINES + 5];
        enum status final;
        size_t n = read_all(path, 1024, got, N_LINES + 5, &final, &err);
        if (final != IO_INPUT_END)
            fail_msg("%s: %s", cases[c].name, err.msg);
        assert_int_equal(n, N_LINES);
        for (int i = 0; i < N_LINES; i++) {
            assert_int_equal(got[i].status, ST_OK);
            assert_string_equal(got[i].text, lines[i]);
            const char *want_member;
            uint64_t want_line;
            if (cases[c].archive == 0) {
                want_member = "";
                want_line = (uint64_t)i + 1;
            } else if (i < 20) {
                want_member = "data/part-a.jsonl";
                want_line = (uint64_t)i + 1;
            } else if (i < 45) {
                want_member = "data/part-b.JSONL";
                want_line = (uint64_t)i - 19;
            } else {
                want_member = "part-c.jsonl";
                want_line = (uint64_t)i - 44;
            }
            assert_string_equal(got[i].member, want_member);
            assert_int_equal(got[i].line, want_line);
        }
    }
    free(all);
    free(part_a);
    free(part_b);
    free(part_c);
}

static void test_crlf_empty_and_unterminated(void **state)
{
    (void)state;
    static const char text[] = "a\r\nb\r\n\r\n\nx\ry\n\n{\"k\":1}\r\n\r\nlast\r";
    static const char *want[] = {"a", "b", "", "", "x\ry", "", "{\"k\":1}", "", "last"};
    const size_t n_want = sizeof(want) / sizeof(want[0]);
    for (int f = 0; f < 3; f++) {
        char path[300];
        path_in(path, sizeof(path), f == 0 ? "crlf.jsonl" : f == 1 ? "crlf.gz" : "crlf.zst");
        write_single(path, (enum filter)f, text, sizeof(text) - 1);
        struct got got[16];
        enum status final;
        struct err_detail err = {0};
        size_t n = read_all(path, 100, got, 16, &final, &err);
        assert_int_equal(final, IO_INPUT_END);
        assert_int_equal(n, n_want);
        for (size_t i = 0; i < n_want; i++) {
            assert_int_equal(got[i].status, ST_OK);
            assert_int_equal(got[i].len, strlen(want[i]));
            assert_string_equal(got[i].text, want[i]);
            assert_int_equal(got[i].line, i + 1);
        }
    }
    /* an empty file and an empty archive member give no lines, no error */
    char path[300];
    path_in(path, sizeof(path), "empty.jsonl");
    write_single(path, F_NONE, "", 0);
    struct got got[4];
    enum status final;
    struct err_detail err = {0};
    assert_int_equal(read_all(path, 100, got, 4, &final, &err), 0);
    assert_int_equal(final, IO_INPUT_END);
    path_in(path, sizeof(path), "empty.jsonl.zst");
    write_single(path, F_ZSTD, "", 0);
    assert_int_equal(read_all(path, 100, got, 4, &final, &err), 0);
    assert_int_equal(final, IO_INPUT_END);
    const struct member m[] = {{"empty.jsonl", "", 0, 0}, {"one.jsonl", "{}", 2, 0}};
    path_in(path, sizeof(path), "empty-member.tar");
    write_archive(path, 0, F_NONE, m, 2);
    assert_int_equal(read_all(path, 100, got, 4, &final, &err), 1);
    assert_int_equal(final, IO_INPUT_END);
    assert_string_equal(got[0].text, "{}");
    assert_string_equal(got[0].member, "one.jsonl");
}

static void test_long_line_skipped(void **state)
{
    (void)state;
    const size_t max_line = 64 << 10;
    size_t big = 1 << 20;
    char *text = malloc(big + 100);
    size_t n = 0;
    n += (size_t)sprintf(text + n, "{\"first\":1}\n");
    memset(text + n, 'x', big);
    n += big;
    text[n++] = '\n';
    n += (size_t)sprintf(text + n, "{\"third\":3}\r\n");
    memcpy(text + n, "\n", 1);
    n += 1;
    n += (size_t)sprintf(text + n, "{\"fifth\":5}");
    for (int f = 0; f < 3; f++) {
        char path[300];
        path_in(path, sizeof(path), f == 0 ? "long.jsonl" : f == 1 ? "long.gz" : "long.zst");
        write_single(path, (enum filter)f, text, n);
        struct got got[8];
        enum status final;
        struct err_detail err = {0};
        size_t k = read_all(path, max_line, got, 8, &final, &err);
        assert_int_equal(final, IO_INPUT_END);
        assert_int_equal(k, 5);
        assert_int_equal(got[0].status, ST_OK);
        assert_string_equal(got[0].text, "{\"first\":1}");
        assert_int_equal(got[1].status, ST_ERR_RANGE);
        assert_int_equal(got[1].line, 2);
        assert_int_equal(got[2].status, ST_OK);
        assert_string_equal(got[2].text, "{\"third\":3}");
        assert_int_equal(got[2].line, 3);
        assert_int_equal(got[3].len, 0);
        assert_string_equal(got[4].text, "{\"fifth\":5}");
        assert_int_equal(got[4].line, 5);
    }
    /* the error message names the line */
    char path[300];
    path_in(path, sizeof(path), "long.jsonl");
    struct io_input *in = NULL;
    struct err_detail err = {0};
    assert_int_equal(io_input_open(&in, path, max_line, &err), ST_OK);
    const char *line;
    size_t len;
    assert_int_equal(io_input_next(in, &line, &len, NULL, &err), ST_OK);
    assert_int_equal(io_input_next(in, &line, &len, NULL, &err), ST_ERR_RANGE);
    assert_non_null(strstr(err.msg, "line 2"));
    assert_non_null(strstr(err.msg, "long.jsonl"));
    io_input_close(in);
    free(text);
}

/* Lines of length around max_line, many straddling the reader's chunk boundaries: each is
 * returned whole when it fits (with or without '\r') and reported when it does not. */
static void test_max_line_boundaries(void **state)
{
    (void)state;
    const size_t max_line = 1000;
    const int count = 3000;
    size_t cap = (size_t)count * 1020;
    char *text = malloc(cap);
    size_t n = 0;
    for (int i = 0; i < count; i++) {
        size_t len = 990 + (size_t)(i * 8) % 21; /* 990..1010 */
        for (size_t k = 0; k < len; k++)
            text[n + k] = (char)('a' + (i + (int)k) % 26);
        n += len;
        if (i % 3 == 0)
            text[n++] = '\r';
        text[n++] = '\n';
    }
    for (int f = 0; f < 3; f += 2) {
        char path[300];
        path_in(path, sizeof(path), f == 0 ? "edge.jsonl" : "edge.zst");
        write_single(path, (enum filter)f, text, n);
        struct io_input *in = NULL;
        struct err_detail err = {0};
        assert_int_equal(io_input_open(&in, path, max_line, &err), ST_OK);
        for (int i = 0; i < count; i++) {
            size_t len = 990 + (size_t)(i * 8) % 21;
            const char *line;
            size_t got;
            struct io_input_pos pos;
            enum status st = io_input_next(in, &line, &got, &pos, &err);
            assert_int_equal(pos.line, (uint64_t)i + 1);
            if (len <= max_line) {
                assert_int_equal(st, ST_OK);
                assert_int_equal(got, len);
                for (size_t k = 0; k < len; k++)
                    if (line[k] != (char)('a' + (i + (int)k) % 26))
                        fail_msg("line %d byte %zu differs", i + 1, k);
            } else {
                assert_int_equal(st, ST_ERR_RANGE);
            }
        }
        const char *line;
        size_t got;
        assert_int_equal(io_input_next(in, &line, &got, NULL, &err), IO_INPUT_END);
        io_input_close(in);
    }
    free(text);
}

/* Enough varied text that compressed files are many blocks long. */
static char *varied_text(size_t n_lines, size_t *len)
{
    char *buf = malloc(n_lines * 120);
    size_t n = 0;
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < n_lines; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        n += (size_t)sprintf(buf + n, "{\"custom_id\":\"%zu\",\"prompt\":\"%016llx%016llx\"}\n", i,
                             (unsigned long long)x, (unsigned long long)(x * 31));
    }
    *len = n;
    return buf;
}

static void truncate_file(const char *path, double keep)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(truncate(path, (off_t)((double)sb.st_size * keep)), 0);
}

static void test_truncated_and_corrupt(void **state)
{
    (void)state;
    size_t len;
    char *text = varied_text(40000, &len);
    const struct member m[] = {{"a.jsonl", text, len, 0}, {"b.jsonl", text, len, 0}};
    static const struct {
        const char *name; /* file name */
        int archive;      /* 0 single, 1 tar, 2 zip */
        enum filter f;    /* compression */
    } cases[] = {
        {"t.jsonl.zst", 0, F_ZSTD}, {"t.jsonl.gz", 0, F_GZIP}, {"t.tar.zst", 1, F_ZSTD},
        {"t.tar.gz", 1, F_GZIP},    {"t.tar", 1, F_NONE},      {"t.zip", 2, F_NONE},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        char path[300];
        path_in(path, sizeof(path), cases[c].name);
        if (cases[c].archive)
            write_archive(path, cases[c].archive == 2, cases[c].f, m, 2);
        else
            write_single(path, cases[c].f, text, len);
        truncate_file(path, 0.6);
        struct io_input *in = NULL;
        struct err_detail err = {0};
        enum status st = io_input_open(&in, path, 4096, &err);
        uint64_t lines_ok = 0;
        struct io_input_pos pos = {0};
        if (st == ST_OK) {
            const char *line;
            size_t l;
            while ((st = io_input_next(in, &line, &l, &pos, &err)) == ST_OK)
                lines_ok++;
            /* a fatal error is sticky */
            enum status again = io_input_next(in, &line, &l, NULL, &err);
            assert_int_equal(again, st);
            io_input_close(in);
        }
        if (st == IO_INPUT_END || st == ST_OK || st == ST_ERR_RANGE)
            fail_msg("%s: truncated input read to the end (%llu lines) without error",
                     cases[c].name, (unsigned long long)lines_ok);
        assert_int_equal(st, ST_ERR_FORMAT);
        assert_non_null(strstr(err.msg, path));
        assert_non_null(strstr(err.msg, "line"));
        print_message("%-12s -> %s\n", cases[c].name, err.msg);
    }

    /* a zip member whose CRC does not match its data (every copy of the CRC: the local
     * header, the data descriptor, the central directory): an error, not lines lost */
    {
        char zpath[300];
        path_in(zpath, sizeof(zpath), "badcrc.zip");
        write_archive(zpath, 1, F_NONE, m, 2);
        FILE *zf = fopen(zpath, "r+b");
        assert_non_null(zf);
        fseek(zf, 0, SEEK_END);
        const long zn = ftell(zf);
        unsigned char *z = malloc((size_t)zn);
        fseek(zf, 0, SEEK_SET);
        assert_int_equal(fread(z, 1, (size_t)zn, zf), (size_t)zn);
        int flipped = 0;
        for (long i = 0; i + 20 < zn; i++) {
            if (z[i] != 'P' || z[i + 1] != 'K')
                continue;
            const int at = z[i + 2] == 3 && z[i + 3] == 4   ? 14 /* local header */
                           : z[i + 2] == 7 && z[i + 3] == 8 ? 4  /* data descriptor */
                           : z[i + 2] == 1 && z[i + 3] == 2 ? 16 /* central directory */
                                                            : -1;
            if (at > 0 && (z[i + at] | z[i + at + 1] | z[i + at + 2] | z[i + at + 3])) {
                z[i + at] ^= 0x5a;
                flipped++;
            }
        }
        assert_true(flipped >= 2);
        fseek(zf, 0, SEEK_SET);
        assert_int_equal(fwrite(z, 1, (size_t)zn, zf), (size_t)zn);
        fclose(zf);
        free(z);
        struct io_input *zi = NULL;
        struct err_detail zerr = {0};
        enum status zst = io_input_open(&zi, zpath, 4096, &zerr);
        uint64_t zlines = 0;
        if (zst == ST_OK) {
            const char *line;
            size_t l;
            while ((zst = io_input_next(zi, &line, &l, NULL, &zerr)) == ST_OK)
                zlines++;
            io_input_close(zi);
        }
        if (zst != ST_ERR_FORMAT)
            fail_msg("zip with bad CRCs: status %d after %llu lines (%s)", (int)zst,
                     (unsigned long long)zlines, zerr.msg);
        assert_non_null(strstr(zerr.msg, zpath));
        print_message("%-12s -> %s\n", "badcrc.zip", zerr.msg);
    }

    /* random bytes: a clear error at open */
    char path[300];
    path_in(path, sizeof(path), "garbage.jsonl");
    unsigned char *g = malloc(70000);
    uint64_t x = 0x1234567ull;
    for (size_t i = 0; i < 70000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        g[i] = (unsigned char)(x >> 56);
    }
    write_single(path, F_NONE, (const char *)g, 70000);
    struct io_input *in = NULL;
    struct err_detail err = {0};
    assert_int_equal(io_input_open(&in, path, 4096, &err), ST_ERR_FORMAT);
    assert_null(in);
    assert_non_null(strstr(err.msg, path));
    assert_non_null(strstr(err.msg, "binary"));
    /* garbage behind a valid zstd magic number */
    memcpy(g, "\x28\xb5\x2f\xfd", 4);
    path_in(path, sizeof(path), "garbage.zst");
    write_single(path, F_NONE, (const char *)g, 70000);
    enum status st = io_input_open(&in, path, 4096, &err);
    if (st == ST_OK) {
        const char *line;
        size_t l;
        while ((st = io_input_next(in, &line, &l, NULL, &err)) == ST_OK)
            ;
        io_input_close(in);
    }
    assert_int_equal(st, ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, path));
    free(g);

    /* an archive without .jsonl members, a missing file, a directory */
    const struct member only_txt[] = {{"a.txt", "x\n", 2, 0}};
    path_in(path, sizeof(path), "nojsonl.tar");
    write_archive(path, 0, F_NONE, only_txt, 1);
    assert_int_equal(io_input_open(&in, path, 4096, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "no .jsonl member"));
    path_in(path, sizeof(path), "does-not-exist.jsonl");
    assert_int_equal(io_input_open(&in, path, 4096, &err), ST_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "does-not-exist.jsonl"));
    assert_int_equal(io_input_open(&in, tmpdir, 4096, &err), ST_ERR_INVALID_ARG);
    io_input_close(NULL);
    free(text);
}

/* Read path to its end: the lines (status IO_INPUT_END) or the fatal status, err its message. */
static enum status count_lines(const char *path, uint64_t *n_lines, struct err_detail *err)
{
    struct io_input *in = NULL;
    *n_lines = 0;
    enum status st = io_input_open(&in, path, 4096, err);
    if (st)
        return st;
    const char *line;
    size_t l;
    while ((st = io_input_next(in, &line, &l, NULL, err)) == ST_OK)
        ++*n_lines;
    io_input_close(in);
    return st;
}

/* gzip members written by zlib ("wb0": stored, so a flipped data byte alters a line and only
 * the CRC-32 can tell), appended to path (append) or replacing it. */
static void write_gz(const char *path, const char *mode, const char *data, size_t len)
{
    gzFile g = gzopen(path, mode);
    assert_non_null(g);
    assert_int_equal(gzwrite(g, data, (unsigned)len), (int)len);
    assert_int_equal(gzclose(g), Z_OK);
}

static void flip_byte(const char *path, long at_from_end, unsigned char mask)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, at_from_end, at_from_end < 0 ? SEEK_END : SEEK_SET), 0);
    int c = fgetc(f);
    assert_true(c != EOF);
    assert_int_equal(fseek(f, -1, SEEK_CUR), 0);
    fputc(c ^ mask, f);
    fclose(f);
}

/* gzip's own checks, which libarchive 3.6's gzip filter skips: a member's CRC-32 and length,
 * and data after the stream. Each was read "successfully" with altered or lost lines before. */
static void test_gzip_checks(void **state)
{
    (void)state;
    size_t len;
    char *text = varied_text(3000, &len);
    char path[300];
    uint64_t nl;
    struct err_detail err = {0};
    path_in(path, sizeof(path), "c.jsonl.gz");
    /* sound: one member; two members and gzip's allowed zero padding */
    write_gz(path, "wb0", text, len);
    assert_int_equal(count_lines(path, &nl, &err), IO_INPUT_END);
    assert_int_equal(nl, 3000);
    write_gz(path, "ab9", text, len);
    FILE *f = fopen(path, "ab");
    assert_non_null(f);
    for (int i = 0; i < 1000; i++)
        fputc(0, f);
    fclose(f);
    assert_int_equal(count_lines(path, &nl, &err), IO_INPUT_END);
    assert_int_equal(nl, 6000);
    /* a data byte altered in a stored member: a line changes, the CRC-32 says so */
    write_gz(path, "wb0", text, len);
    flip_byte(path, 5000, 0x01);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "incorrect data check"));
    assert_non_null(strstr(err.msg, path));
    /* the trailer's CRC-32, then its length */
    write_gz(path, "wb6", text, len);
    flip_byte(path, -6, 0x10);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "incorrect data check"));
    write_gz(path, "wb6", text, len);
    flip_byte(path, -2, 0x10);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "incorrect length check"));
    /* plain lines appended to a .gz: an error, not lines dropped */
    write_gz(path, "wb6", text, len);
    f = fopen(path, "ab");
    assert_non_null(f);
    fputs("{\"prompt\": \"appended\"}\n", f);
    fclose(f);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "data after the end of the gzip stream"));
    /* a tar.gz: the trailer after the tar's end is checked too */
    const struct member m[] = {{"a.jsonl", text, len, 0}};
    path_in(path, sizeof(path), "c.tar.gz");
    write_archive(path, 0, F_GZIP, m, 1);
    assert_int_equal(count_lines(path, &nl, &err), IO_INPUT_END);
    assert_int_equal(nl, 3000);
    flip_byte(path, -7, 0x04);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "incorrect data check"));
    free(text);
}

/* A NUL in a later line of a text file is that line's (a per-line error upstream), as it is past
 * the first 64 KiB: the whole file was refused as binary, naming line 1. UTF-16 is named. */
static void test_nul_lines(void **state)
{
    (void)state;
    char path[300];
    uint64_t nl;
    struct err_detail err = {0};
    static const char text[] = "{\"a\": 1}\n{\"b\": 2}\n{\"c\": \"\0\"}\n{\"d\": 4}\n";
    path_in(path, sizeof(path), "nul.jsonl");
    write_single(path, F_NONE, text, sizeof(text) - 1);
    assert_int_equal(count_lines(path, &nl, &err), IO_INPUT_END);
    assert_int_equal(nl, 4);
    /* in the first line, or many: binary, at its line */
    static const char first[] = "{\"a\": \"\0\"}\n{\"b\": 2}\n";
    write_single(path, F_NONE, first, sizeof(first) - 1);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "binary data"));
    static const char u16[] = "\xff\xfe{\0\"\0a\0\"\0:\0 \0001\0}\0\n\0";
    path_in(path, sizeof(path), "u16.jsonl");
    write_single(path, F_NONE, u16, sizeof(u16) - 1);
    assert_int_equal(count_lines(path, &nl, &err), ST_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "UTF-16"));
}

static long rss_kb(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, resident = 0;
    if (!f)
        return -1;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
        resident = -1;
    fclose(f);
    return resident < 0 ? -1 : resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 1M lines (~200 MB of JSONL) as .jsonl.zst: every line comes back in order and resident
 * memory does not grow with the input. */
static void test_large_input_flat_memory(void **state)
{
    (void)state;
    const uint64_t n_lines = 1000000;
    char path[300];
    path_in(path, sizeof(path), "big.jsonl.zst");
    struct archive *a = archive_write_new();
    add_filter(a, F_ZSTD);
    assert_int_equal(archive_write_set_format_raw(a), ARCHIVE_OK);
    assert_int_equal(archive_write_open_filename(a, path), ARCHIVE_OK);
    struct archive_entry *e = archive_entry_new();
    archive_entry_set_pathname(e, "data");
    archive_entry_set_filetype(e, AE_IFREG);
    assert_int_equal(archive_write_header(a, e), ARCHIVE_OK);
    archive_entry_free(e);
    char *block = malloc(1 << 20);
    size_t used = 0;
    uint64_t total = 0, h_written = 0xCBF29CE484222325ull;
    char line[400];
    static const char *tags[] = {"eval-sweep", "synthetic-dataset-v2", "nightly-report", "codegen",
                                 "regression-check-long-tag"};
    for (uint64_t i = 0; i < n_lines; i++) {
        int l = snprintf(line, sizeof(line),
                         "{\"custom_id\":\"req-%08llu\",\"body\":{\"messages\":[{\"role\":\"user\","
                         "\"content\":\"Summarise item %llu in %llu words, please.\"}],"
                         "\"max_tokens\":%llu,\"metadata\":{\"user\":\"user-%llu@example.org\","
                         "\"tag\":\"%s\"}}}",
                         (unsigned long long)i, (unsigned long long)(i * 2654435761u % 1000003),
                         (unsigned long long)(i % 97), (unsigned long long)(i % 512),
                         (unsigned long long)(i * 40503u % 65521), tags[i % 5]);
        h_written = (h_written ^ test_fnv1a64(line, (size_t)l)) * 0x100000001B3ull;
        if (used + (size_t)l + 1 > (1 << 20)) {
            assert_int_equal(archive_write_data(a, block, used), (la_ssize_t)used);
            used = 0;
        }
        memcpy(block + used, line, (size_t)l);
        used += (size_t)l;
        block[used++] = '\n';
        total += (uint64_t)l + 1;
    }
    assert_int_equal(archive_write_data(a, block, used), (la_ssize_t)used);
    assert_int_equal(archive_write_close(a), ARCHIVE_OK);
    archive_write_free(a);
    free(block);

    long base = rss_kb(), peak = base;
    double t0 = now_s();
    struct io_input *in = NULL;
    struct err_detail err = {0};
    assert_int_equal(io_input_open(&in, path, 1 << 20, &err), ST_OK);
    uint64_t n = 0, h_read = 0xCBF29CE484222325ull;
    const char *p;
    size_t len;
    struct io_input_pos pos;
    enum status st;
    while ((st = io_input_next(in, &p, &len, &pos, &err)) == ST_OK) {
        h_read = (h_read ^ test_fnv1a64(p, len)) * 0x100000001B3ull;
        n++;
        if (pos.line != n)
            fail_msg("line number %llu, expected %llu", (unsigned long long)pos.line,
                     (unsigned long long)n);
        if ((n & 0xFFFF) == 0) {
            long r = rss_kb();
            if (r > peak)
                peak = r;
        }
    }
    double dt = now_s() - t0;
    assert_int_equal(st, IO_INPUT_END);
    io_input_close(in);
    assert_int_equal(n, n_lines);
    assert_true(h_read == h_written);
    print_message("%llu lines, %.0f MB uncompressed: %.2f s, %.0f lines/s, %.0f MB/s; RSS %ld KB "
                  "-> peak %ld KB\n",
                  (unsigned long long)n, (double)total / 1e6, dt, (double)n / dt,
                  (double)total / 1e6 / dt, base, peak);
    /* a reader needs a few MB (chunk, line buffer, decoder windows), never the input size */
    assert_true(base > 0);
    assert_true(peak - base < 32 * 1024);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_lines_every_format),
        cmocka_unit_test(test_crlf_empty_and_unterminated),
        cmocka_unit_test(test_long_line_skipped),
        cmocka_unit_test(test_max_line_boundaries),
        cmocka_unit_test(test_truncated_and_corrupt),
        cmocka_unit_test(test_gzip_checks),
        cmocka_unit_test(test_nul_lines),
        cmocka_unit_test(test_large_input_flat_memory),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
