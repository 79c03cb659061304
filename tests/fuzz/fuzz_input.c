/* libFuzzer harness for the input reader (io/input.c), the untrusted input of `quern submit`:
 * any bytes (plain text, compressed streams, tar and zip archives, with gzip's own checks on
 * the way) must read to the end or fail with a sticky error, never crash, hang or leak; every
 * line handed out is at most max_line bytes and holds no newline, its position counts up. The
 * bytes are given to io_input_open as a file (a memfd, through /proc/self/fd). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/log.h"
#include "io/input.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_LINE 256

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    log_set_level(
        LOG_LEVEL_ERROR); /* (the reader's notes on skipped members: megabytes a second) */
    int fd = memfd_create("fuzz_input", MFD_CLOEXEC);
    if (fd < 0)
        abort();
    if (size && write(fd, data, size) != (ssize_t)size)
        abort();
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    struct io_input *in = NULL;
    struct err_detail err = {0};
    enum status st = io_input_open(&in, path, MAX_LINE, &err);
    if (st) {
        if (in || !err.msg[0])
            abort(); /* a refusal has no reader, and says why */
        close(fd);
        return 0;
    }
    uint64_t last = 0; /* the last line number handed out: they count up within a member */
    for (;;) {
        const char *line;
        size_t len;
        struct io_input_pos pos;
        st = io_input_next(in, &line, &len, &pos, &err);
        if (st == IO_INPUT_END)
            break;
        if (st == ST_ERR_RANGE) /* a long line: reported, reading goes on */
            continue;
        if (st) { /* fatal: sticky, with a message */
            struct err_detail again = {0};
            if (!err.msg[0] || io_input_next(in, &line, &len, NULL, &again) != st)
                abort();
            break;
        }
        /* (a reader that loops is libFuzzer's -timeout to find: compressed input may hold far
         * more lines than bytes) */
        if (len > MAX_LINE || (len && memchr(line, '\n', len)) || pos.line == 0 ||
            (pos.line <= last && pos.line != 1)) /* (a new member counts from 1 again) */
            abort();
        last = pos.line;
    }
    io_input_close(in);
    close(fd);
    return 0;
}
