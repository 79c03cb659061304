/* SHA-256 (FIPS 180-4): an incremental hasher and a helper that hashes a file prefix, used for
 * shard and model checksums in manifest.json. */
#ifndef COMMON_SHA256_H
#define COMMON_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#define SHA256_DIGEST_LEN 32         /* bytes in a digest */
#define SHA256_HEX_LEN    65         /* lowercase hex digest plus NUL */
#define SHA256_WHOLE_FILE UINT64_MAX /* sha256_file limit meaning "to the end of the file" */

/* Hashing state; plain value, no heap. Initialise with sha256_init before use. */
struct sha256 {
    uint32_t h[8];     /* chaining value */
    uint64_t nbytes;   /* message bytes absorbed so far */
    uint8_t block[64]; /* partial input block */
    size_t block_len;  /* bytes used in block (0..63) */
};

/* Hashes use the CPU's SHA extensions where it has them (x86 SHA-NI), else the portable code:
 * the same digests. For tests: sha256_force_scalar(1) makes later hashes use the portable code,
 * (0) lets them choose again; returns whether the extensions were in use before. */
int sha256_force_scalar(int scalar);

void sha256_init(struct sha256 *s);
void sha256_update(struct sha256 *s, const void *data, size_t len);
/* Finish and write the 32-byte digest; s must be re-initialised before reuse. */
void sha256_final(struct sha256 *s, uint8_t digest[SHA256_DIGEST_LEN]);

/* Lowercase hex of a digest into hex (65 bytes incl. NUL). */
void sha256_hex(const uint8_t digest[SHA256_DIGEST_LEN], char hex[SHA256_HEX_LEN]);

/* One-shot hash of a buffer, as lowercase hex. */
void sha256_buf_hex(const void *data, size_t len, char hex[SHA256_HEX_LEN]);

/* Hash the first `limit` bytes of the file at path (SHA256_WHOLE_FILE: all of it) into hex.
 * ST_ERR_IO when the file cannot be read, ST_ERR_FORMAT when it is shorter than limit. */
enum status sha256_file(const char *path, uint64_t limit, char hex[SHA256_HEX_LEN],
                        struct err_detail *err);

#endif
