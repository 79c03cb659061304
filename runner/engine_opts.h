/* The engine and backend flags, parsed the same way by every command that runs the model
 * (run, bench, generate) or plans its memory (plan): one struct with their defaults, a fragment
 * of getopt_long's option table, one function that handles them, and the help text that lists
 * them, so each command's --help says the same thing about them. */
#ifndef RUNNER_ENGINE_OPTS_H
#define RUNNER_ENGINE_OPTS_H

#include <getopt.h>
#include <stdio.h>

#include "engine/engine.h"
#include "engine/model.h"
#include "kernels/kernels.h"

/* Groups of flags a command takes (or-ed together). */
#define RUNNER_EO_BACKEND 0x1 /* --device --threads --isa --matmul */
#define RUNNER_EO_KV      0x2 /* --kv-mem --kv-block --kv-dtype */
#define RUNNER_EO_BATCH   0x4 /* --max-seqs --max-batch-tokens */
#define RUNNER_EO_DUMMY   0x8 /* --dummy (commands that load a model by path, not run) */
#define RUNNER_EO_SPEC    0x10 /* --spec --spec-max-k --spec-budget --draft-model */
#define RUNNER_EO_PREFIX  0x20 /* --no-prefix-cache (commands whose requests can share one) */
#define RUNNER_EO_ALL     (RUNNER_EO_BACKEND | RUNNER_EO_KV | RUNNER_EO_BATCH | RUNNER_EO_PREFIX)

/* getopt_long values of these flags; a command's own options use values below 512. */
enum {
    RUNNER_EO_OPT_DEVICE = 512,
    RUNNER_EO_OPT_TP,
    RUNNER_EO_OPT_THREADS,
    RUNNER_EO_OPT_ISA,
    RUNNER_EO_OPT_MATMUL,
    RUNNER_EO_OPT_KVMEM,
    RUNNER_EO_OPT_KVBLOCK,
    RUNNER_EO_OPT_KVDTYPE,
    RUNNER_EO_OPT_SEQS,
    RUNNER_EO_OPT_BATCH,
    RUNNER_EO_OPT_NOPREFIX,
    RUNNER_EO_OPT_NOWINDOW,
    RUNNER_EO_OPT_DUMMY,
    RUNNER_EO_OPT_SPEC,
    RUNNER_EO_OPT_SPEC_K,
    RUNNER_EO_OPT_SPEC_BUDGET,
    RUNNER_EO_OPT_DRAFT_MODEL,
    RUNNER_EO_OPT_END /* not an option: one past the last */
};
/* Entries the fragment adds at most: each of its flags has its own value above. */
#define RUNNER_EO_MAX_LONGOPTS (RUNNER_EO_OPT_END - RUNNER_EO_OPT_DEVICE)

struct runner_engine_opts {
    const char *device;      /* --device: NULL (auto), "auto", "cpu" or "cuda" (borrowed) */
    long threads;            /* --threads (default: all online CPUs) */
    long tp;                 /* --tp: tensor-parallel ranks (default 1) */
    const char *isa;         /* --isa, NULL = auto (borrowed) */
    int act;                 /* --matmul: enum kern_act, or RUNNER_ACT_DEFAULT (the device's) */
    struct engine_params ep; /* --kv-*, --max-seqs, --max-batch-tokens, --no-prefix-cache,
                              * --spec* */
    const char *dummy;       /* --dummy PRESET, or NULL (borrowed) */
    const char *draft_model; /* --draft-model PATH (with --spec model), or NULL (borrowed) */
    const char *spec_tuned;  /* --spec-max-k or --spec-budget when given (needs --spec) */
};

/* --matmul unset: the device's default mode, which runner_engine_backend settles
 * (kern_default_act). On the CPU that is q8, the fastest mode whose perplexity is within 0.5 %
 * of exact's on `make eval`'s text (docs/BENCHMARKS.md, 2026-12-02), and bf16 where the kernel
 * table has AMX-BF16 tiles (exact's perplexity, and faster: 2026-12-04); on CUDA exact. */
#define RUNNER_ACT_DEFAULT (-1)

/* Every field at its default. */
void runner_engine_opts_default(struct runner_engine_opts *o);

/* The command's own options (own, ended by an all-zero entry) followed by the flags of groups,
 * and the all-zero entry, into dst (cap entries, at least own's + RUNNER_EO_MAX_LONGOPTS + 1). */
void runner_engine_longopts(struct option *dst, size_t cap, const struct option *own,
                            unsigned groups);

/* Handle getopt_long's result c with its optarg: 1 it was an engine flag and is stored, 0 it is
 * not one, -1 its value is bad (a message naming cmd and the flag went to stderr). */
int runner_engine_opt(const char *cmd, int c, const char *arg, struct runner_engine_opts *o);

/* The help lines of groups, as every command prints them. */
void runner_engine_help(FILE *f, unsigned groups);

/* The rules across options, after parsing (a usage error: 0, with a message naming cmd):
 * --spec model and --draft-model go together; --max-batch-tokens >= --max-seqs. */
int runner_engine_opts_check(const char *cmd, const struct runner_engine_opts *o);
/* With --spec model, the draft model (--draft-model) on grp into *out and o->ep.draft_model;
 * else *out = NULL. */
enum status runner_draft_load(struct engine_model **out, struct runner_engine_opts *o,
                              const struct kern_group *grp, struct err_detail *err);

/* The command's model: the GGUF at path, or with o->dummy a dummy model of that preset
 * (engine/dummy.h) with path's tokenizer and chat template; split over grp, or with grp NULL
 * loaded without a backend (dummy weights then stay untouched zero pages: quern plan). */
enum status runner_model_load(struct engine_model **out, const char *path,
                              const struct runner_engine_opts *o, const struct kern_group *grp,
                              struct err_detail *err);

/* The model's name for logs and reports: path, or "dummy PRESET (tokenizer of PATH)". */
const char *runner_model_label(const char *path, const struct runner_engine_opts *o, char *buf,
                               size_t size);

/* The backend factory's options (strings borrowed from o); settles o->act first when it is
 * RUNNER_ACT_DEFAULT (so o->act names the mode that runs). */
struct kern_backend_opts runner_engine_backend(struct runner_engine_opts *o);

#endif
