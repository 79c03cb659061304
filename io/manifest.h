/* manifest.json for a job's output directory: job parameters, the model and its sha256,
 * every shard with its kind, record count, byte length and sha256 and the runs that wrote its
 * records, and those runs with their host and engine (docs/ARCHITECTURE.md, "Provenance"). Written
 * atomically (temporary file, fsync, rename, fsync of the directory), so readers see the old or the
 * new manifest, never a mix. */
#ifndef IO_MANIFEST_H
#define IO_MANIFEST_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/err.h"
#include "common/sha256.h"

#define IO_MANIFEST_VERSION 1 /* "manifest_version" written into the file */

enum io_shard_kind {
    IO_SHARD_RESULTS = 0, /* results-NNNNN.jsonl.zst: one output object per done item */
    IO_SHARD_ERRORS,      /* errors-NNNNN.jsonl.zst: one output object per failed item */
};

/* How many of a shard's records one run wrote. */
struct io_manifest_writer {
    int64_t run_id;   /* the run (0: unknown) */
    uint64_t records; /* its records in the shard */
};

/* A run that wrote records, listed once. Strings are borrowed from the caller. */
struct io_manifest_run {
    int64_t id;              /* the run */
    const char *host;        /* its host, or NULL */
    const char *engine_json; /* its engine as JSON object text, or NULL (unknown) */
};

/* One shard as listed in the manifest. Strings are borrowed from the caller. */
struct io_manifest_shard {
    const char *name;            /* file name inside the output directory, no '/' */
    enum io_shard_kind kind;     /* results or errors */
    uint64_t records;            /* lines in the shard */
    uint64_t superseded;         /* of those, records of items retried since (their current
                                    record is elsewhere): no run in writers counts them */
    uint64_t bytes;              /* committed length in bytes */
    char sha256[SHA256_HEX_LEN]; /* hex sha256 of the first `bytes` bytes; an empty string
                                    makes io_manifest_write hash DIR/name itself */
    const struct io_manifest_writer *writers; /* n_writers entries, the runs that wrote the */
    size_t n_writers;                         /* records of the shard's finished items */
};

/* Everything written to manifest.json. Pointers are borrowed for the duration of the call. */
struct io_manifest {
    const char *job_id;                     /* job identifier (may be NULL) */
    const cJSON *params;                    /* job parameters as an object, or NULL */
    const char *params_json;                /* ...or as JSON object text (used when params is
                                               NULL; both NULL writes {}) */
    const char *model_path;                 /* model file as given to the job (may be NULL) */
    const char *model_sha256;               /* its hex sha256; NULL or "" hashes model_path */
    int complete;                           /* 1 when every item of the job is done or failed
                                               (or cancelled) and no shard is open */
    int cancelled;                          /* 1: the job was cancelled ("cancelled": true; its
                                               cancelled items have no record) */
    int64_t created_unix;                   /* seconds since the epoch; 0 means now */
    const struct io_manifest_shard *shards; /* n_shards entries, in shard order */
    size_t n_shards;                        /* number of shards */
    const struct io_manifest_run *runs;     /* n_runs entries: the runs the shards name */
    size_t n_runs;
};

/* Write dir/manifest.json atomically. Totals (records and bytes per kind) are added. Fails
 * with ST_ERR_INVALID_ARG for bad params JSON or shard names, ST_ERR_IO for file errors.
 * Missing checksums are computed here (reading the shards / the model). */
enum status io_manifest_write(const char *dir, const struct io_manifest *m, struct err_detail *err);

/* A run's fingerprint from its engine JSON text (exactly as stored): "fp_" and the first 16 hex
 * digits of its sha256. Records carry it as system_fingerprint, the manifest's runs as
 * "fingerprint". */
#define IO_FINGERPRINT_LEN 20 /* with its NUL */
void io_manifest_fingerprint(const char *engine_json, char out[IO_FINGERPRINT_LEN]);
/* "results" or "errors". */
const char *io_shard_kind_name(enum io_shard_kind k);

#endif
