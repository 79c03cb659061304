/* Job-level defaults (sampling parameters, max_tokens) as stored in the queue's
 * jobs.params_json, and back. */
#ifndef JOBS_PARAMS_H
#define JOBS_PARAMS_H

#include "common/err.h"
#include "jobs/request.h"

/* JSON object text for d (caller frees). NULL on out of memory. */
char *job_params_to_json(const struct job_defaults *d);

/* Fill d from JSON text written by job_params_to_json; keys that are absent keep the values
 * already in d. ST_ERR_FORMAT names a bad key. d->default_id is left untouched. */
enum status job_params_from_json(const char *json, struct job_defaults *d, struct err_detail *err);

#endif
