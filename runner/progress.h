/* How a job's live progress (struct batch_progress, batch/batch.h) is shown by `quern run` and
 * `quern status`: the live line on a terminal, a key=value log line, and the closing summary
 * line. */
#ifndef RUNNER_PROGRESS_H
#define RUNNER_PROGRESS_H

#include <stddef.h>

#include "batch/batch.h"

#define RUNNER_PROGRESS_TTY_S 1.0 /* live line refresh period */

/* The live line, fitted to width - 1 columns by dropping the least useful fields first:
 * "NAME [####----] 64/256 25%  0 failed  gen 769.5 tok/s  prompt 3.4k tok/s  seqs 64  KV 34%
 *  0:12  ETA 0:32" (ETA "--" while unknown). Colour sequences only with color. */
void runner_progress_line(const struct batch_progress *p, int width, int color, char *buf,
                          size_t cap);
/* The log line: "progress: job=NAME done=.. failed=.. cancelled=.. total=.. pct=.. gen_tok_s=..
 * prompt_tok_s=.. gen_tokens=.. prompt_tokens=.. running=.. waiting=.. kv_pct=.. runs=..
 * elapsed_s=.. eta_s=N|--" (the name with blanks, '=' and quotes as '_'). */
void runner_progress_log(const struct batch_progress *p, char *buf, size_t cap);
/* The summary: "job NAME: 24/24 finished (0 failed, 0 cancelled) in 0:06; 1152 tokens
 * generated (190.3 tok/s), 720 prompt tokens (120.0 tok/s)" with averages over elapsed_s. */
void runner_progress_summary(const struct batch_progress *p, char *buf, size_t cap);

#endif
