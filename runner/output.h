/* A job's output directory, shared by `run`, `status` and `export`: where it is (the job's
 * out_dir unless --out names the same place), the marker that ties it to one job of one queue
 * database, and manifest.json (written from the queue's shard rows, checked against them). */
#ifndef RUNNER_OUTPUT_H
#define RUNNER_OUTPUT_H

#include <stddef.h>

#include "common/err.h"
#include "queue/queue.h"

#define RUNNER_MARKER_NAME ".quern-job.json" /* the marker file inside OUT/<job> */

/* The job's output directory OUT/<name> into dir (absolute). OUT is the job's out_dir (absolute,
 * or relative to the database's directory) unless out_flag (relative to the working directory)
 * is given: then it must be where the job's shards already are, else ST_ERR_INVALID_ARG (a job
 * never splits across directories); a job without shards yet records it as its out_dir. With
 * create, the directories are made and the marker is checked or written (runner_outdir_claim). */
enum status runner_job_dir(struct queue *q, const struct queue_job *job, const char *out_flag,
                           int create, char *dir, size_t cap, struct err_detail *err);

/* Claim dir for the job: create the marker (exclusively, never through a link) or check that
 * the one there names this database (its db_uuid) and job id; a directory that belongs to
 * another job or database is refused with ST_ERR_EXISTS, naming its owner. */
enum status runner_outdir_claim(struct queue *q, const struct queue_job *job, const char *dir,
                                struct err_detail *err);

/* Write dir/manifest.json from the job's closed, non-empty shards (atomic, see io/manifest.h). */
enum status runner_manifest_write(struct queue *q, const struct queue_job *job, const char *dir,
                                  int complete, struct err_detail *err);

/* 1 when dir/manifest.json says complete and lists exactly the job's closed, non-empty shards
 * with their bytes, records and sha256; 0 otherwise (missing, unreadable, stale, incomplete). */
int runner_manifest_current(struct queue *q, const struct queue_job *job, const char *dir);

#endif
