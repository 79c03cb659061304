/* Output shards: files of concatenated zstd frames, each frame holding whole JSONL lines.
 * Exactly-once protocol: the writer buffers records, io_shard_flush writes them as ONE frame
 * and fsyncs, and only then does the caller record the returned committed length (in
 * SQLite, in the same transaction that marks the items done). On restart io_shard_open
 * truncates the file back to that length, dropping any torn or uncommitted tail.
 * A writer is not thread-safe: one thread uses it at a time. */
#ifndef IO_SHARD_H
#define IO_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#define IO_SHARD_ALL UINT64_MAX /* io_shard_read/verify limit: the whole file */

struct io_shard;

/* Open the shard at path for appending, with committed_bytes the length last recorded as
 * committed (0 for a new shard). A missing file is created (committed_bytes must be 0) and
 * its directory fsynced. An existing file must be at least committed_bytes long (shorter
 * means committed data was lost: ST_ERR_FORMAT, nothing is changed); its committed prefix is
 * verified to decode as whole frames (checksums included, see io_shard_verify) and counted,
 * then anything after it is truncated away and the file fsynced. The file is locked
 * (flock LOCK_EX|LOCK_NB) so a second writer fails with ST_ERR_IO instead of interleaving.
 * A symbolic link at path is refused (O_NOFOLLOW), never followed.
 * level is the zstd level (0: zstd's default). On success *out owns the writer; close it
 * with io_shard_close. On failure *out is NULL. */
enum status io_shard_open(struct io_shard **out, const char *path, uint64_t committed_bytes,
                          int level, struct err_detail *err);

/* Create a new, empty shard at path for appending: exclusively (O_EXCL|O_NOFOLLOW), so an
 * existing file or a symbolic link there is never followed or overwritten (ST_ERR_EXISTS);
 * the directory is fsynced. Otherwise as io_shard_open with committed_bytes 0. */
enum status io_shard_create(struct io_shard **out, const char *path, int level,
                            struct err_detail *err);

/* Is a writer (in any process on this host) holding the shard at path open? 1 yes, 0 no or
 * no file, -1 when it cannot be told (the file cannot be opened). A writer holds its flock
 * until it closes or its process dies (kill -9 included), so a locked shard's writer is alive. */
int io_shard_locked(const char *path);

/* Give the shard up: cut the file back to length (a committed length the caller recorded,
 * at most the writer's committed length; frames flushed after it are dropped), fsync,
 * discard buffered records and free the writer, also on error. For a shard that is no longer
 * the caller's: its owner's commits end at length. */
enum status io_shard_abandon(struct io_shard *s, uint64_t length, struct err_detail *err);

/* Buffer one record: line is len bytes WITHOUT a trailing newline (the writer adds '\n');
 * a line containing '\n' is ST_ERR_INVALID_ARG. Nothing reaches the file before a flush. */
enum status io_shard_append(struct io_shard *s, const char *line, size_t len,
                            struct err_detail *err);

/* Compress every buffered record as one zstd frame (content size + checksum), write it at
 * the committed end, and fdatasync. On ST_OK the records are durable, *committed_bytes is
 * the new file length and *records_total the records in the shard (either pointer may be
 * NULL); the caller may now commit both. With nothing buffered this is a no-op returning
 * the current values. On a write error the file is cut back to the committed length and the
 * records stay buffered (a retry may succeed). After an fsync failure the page cache can no
 * longer be trusted: the writer refuses further work (ST_ERR_IO) and must be closed and
 * reopened with the last committed length. */
enum status io_shard_flush(struct io_shard *s, uint64_t *committed_bytes, uint64_t *records_total,
                           struct err_detail *err);

/* Buffered (not yet flushed) uncompressed bytes, newlines included, and records: for
 * rotating on size or count and for deciding when to flush. */
size_t io_shard_pending_bytes(const struct io_shard *s);
size_t io_shard_pending_records(const struct io_shard *s);

/* Committed length and record count as of the last successful open or flush. */
uint64_t io_shard_committed_bytes(const struct io_shard *s);
uint64_t io_shard_records_total(const struct io_shard *s);

/* Close the file and free the writer; buffered records are DISCARDED (flush first).
 * NULL is a no-op. */
void io_shard_close(struct io_shard *s);

/* Called once per record by io_shard_read: line is len bytes without its '\n', valid only
 * during the call (and NUL-terminated for convenience). A status other than ST_OK stops the
 * read and is returned from it. */
typedef enum status (*io_shard_line_fn)(const char *line, size_t len, void *user);

/* Stream-decode the first limit_bytes of the shard at path (IO_SHARD_ALL: the whole file)
 * and call fn for each line. ST_ERR_FORMAT when the data is not zstd, a frame is corrupt
 * (checksum) or cut off at the limit, a frame does not end with '\n', or the file is shorter
 * than limit_bytes. Memory is bounded by the longest line. */
enum status io_shard_read(const char *path, uint64_t limit_bytes, io_shard_line_fn fn, void *user,
                          struct err_detail *err);

/* Check that the first limit_bytes of the shard decode as whole frames of whole lines;
 * count frames and records (either pointer may be NULL). */
enum status io_shard_verify(const char *path, uint64_t limit_bytes, uint64_t *frames,
                            uint64_t *records, struct err_detail *err);

/* Replace dir/name with data[0..len) atomically and durably: written to a temporary file in
 * dir, ".<name>.tmp.<tag>" (created exclusively, never through a link; the tag names this
 * process, common/proc.h, so that a later call removes the file of a writer killed on this
 * host), fsynced, renamed over name (keeping the old file's permissions), and the directory
 * fsynced; readers see the old file or the new one, never a mix. `fault` (may be NULL) names
 * the fault-injection sites "<fault>.write", ".fsync" and ".rename". */
enum status io_file_replace(const char *dir, const char *name, const char *data, size_t len,
                            const char *fault, struct err_detail *err);

/* fsync the directory dir, making entries created or renamed in it durable. */
enum status io_fsync_dir(const char *dir, struct err_detail *err);

/* fsync the directory that holds the file at path (its dirname, "." when none). */
enum status io_fsync_parent(const char *path, struct err_detail *err);

#endif
