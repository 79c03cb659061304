/* Input reader for `quern submit`: streams lines out of JSONL files, compressed JSONL
 * (.gz, .zst, anything libarchive can decompress) and tar/zip archives of .jsonl members,
 * in bounded memory and without extracting anything to disk. */
#ifndef IO_INPUT_H
#define IO_INPUT_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

/* io_input_next's end-of-input status: not an error, err is left untouched. err.h has no
 * dedicated "end" code, so this aliases ST_ERR_NOT_FOUND ("no more lines"). */
#define IO_INPUT_END ST_ERR_NOT_FOUND

#define IO_INPUT_DEFAULT_MAX_LINE (16u << 20) /* a sensible max_line: 16 MiB */

/* Where a line (or a line error) came from. Strings are reader-owned and valid until the
 * next io_input_next call or io_input_close. */
struct io_input_pos {
    const char *path;   /* the input file as passed to io_input_open */
    const char *member; /* archive member name; NULL for a single (possibly compressed) file */
    uint64_t line;      /* 1-based line number within the member (or file) */
    uint64_t offset;    /* uncompressed byte offset of the line's start within the member */
};

struct io_input;

/* What io_input_open checks before it reads: path exists, is not a directory and is readable
 * (a command can check all its inputs before it creates anything). */
enum status io_input_check(const char *path, struct err_detail *err);

/* Open the file at path and detect its format by content (compression filter, then tar, zip
 * or plain data). Lines longer than max_line bytes (excluding the line ending) are reported
 * as per-line errors. On success *out owns the reader (close with io_input_close); on
 * failure *out is NULL and err names the file and the problem (missing, unreadable, binary,
 * corrupt header). */
enum status io_input_open(struct io_input **out, const char *path, size_t max_line,
                          struct err_detail *err);

/* Next line, without its "\n" or "\r\n". Returns:
 *   ST_OK        *line and *len hold the line (len may be 0: empty lines are returned as such);
 *                *line points into reader-owned memory valid until the next call; it is
 *                not NUL-terminated.
 *   ST_ERR_RANGE the line at *pos is longer than max_line; err says so. Reading may go on:
 *                the next call returns the line after it. The long line is never held in
 *                memory beyond max_line bytes.
 *   IO_INPUT_END no more lines (err untouched).
 *   other        fatal (ST_ERR_FORMAT for corrupt/truncated/binary data, ST_ERR_IO,
 *                ST_ERR_NOMEM): err names the file, member, line and offset; every later
 *                call returns the same status.
 * In archives only regular-file members whose names end in ".jsonl" (any case) are read, in
 * archive order; other members are skipped with a log line (AppleDouble "._*" and
 * "__MACOSX/" entries too). An archive holding no .jsonl member is a ST_ERR_FORMAT error.
 * pos may be NULL. */
enum status io_input_next(struct io_input *in, const char **line, size_t *len,
                          struct io_input_pos *pos, struct err_detail *err);

/* Short description of the detected format, e.g. "raw+zstd", "tar+gzip", "zip". */
const char *io_input_format(const struct io_input *in);

/* Close the file and free the reader; NULL is a no-op. */
void io_input_close(struct io_input *in);

#endif
