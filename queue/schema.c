/* Every piece of SQL the queue runs: the forward migrations that build the schema (version n is
 * PRAGMA user_version n) and the text of each prepared statement. To change the schema, append
 * a migration with the next version and raise QUEUE_SCHEMA_VERSION; never edit a shipped one
 * (tests/fixtures/queue_schema.txt holds the schema each version makes, and test_queue's
 * test_schema_versions fails when one changes). Raise the version too when the tables stay
 * but an older quern would misread what a newer one writes: the version is the only thing an
 * older binary checks, and it refuses a newer one. */
#include <stdio.h>

#include "queue/queue_internal.h"

/* Version 1. States are readable text (CHECKed) so the file can be inspected with sqlite3.
 * items.lease_owner names the run holding the lease, and after done/failed/cancelled the run
 * that last held it. items.shard_id is the shard holding the item's record. */
static const char SCHEMA_V1[] =
    "CREATE TABLE jobs ("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  name TEXT NOT NULL UNIQUE,"
    "  created INTEGER NOT NULL,"
    "  finished INTEGER,"
    "  state TEXT NOT NULL DEFAULT 'queued'"
    "    CHECK (state IN ('queued','running','done','cancelled')),"
    "  model_path TEXT NOT NULL,"
    "  model_sha256 TEXT,"
    "  params_json TEXT NOT NULL DEFAULT '{}',"
    "  out_dir TEXT NOT NULL,"
    "  seed INTEGER NOT NULL DEFAULT 0,"
    "  n_items INTEGER NOT NULL DEFAULT 0"
    ");"
    "CREATE TABLE runs ("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  job_id INTEGER REFERENCES jobs(id),"
    "  worker_id TEXT,"
    "  host TEXT,"
    "  pid INTEGER,"
    "  started INTEGER NOT NULL,"
    "  heartbeat INTEGER NOT NULL,"
    "  ended INTEGER,"
    "  exit_reason TEXT,"
    "  summary_json TEXT"
    ");"
    "CREATE TABLE shards ("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  job_id INTEGER NOT NULL REFERENCES jobs(id),"
    "  kind TEXT NOT NULL CHECK (kind IN ('results','errors')),"
    "  seq INTEGER NOT NULL CHECK (seq >= 0),"
    "  path TEXT NOT NULL UNIQUE,"
    "  run_id INTEGER NOT NULL REFERENCES runs(id),"
    "  committed_bytes INTEGER NOT NULL DEFAULT 0,"
    "  records INTEGER NOT NULL DEFAULT 0,"
    "  superseded INTEGER NOT NULL DEFAULT 0,"
    "  state TEXT NOT NULL DEFAULT 'open' CHECK (state IN ('open','closed')),"
    "  sha256 TEXT,"
    "  created INTEGER NOT NULL,"
    "  closed INTEGER,"
    "  UNIQUE (job_id, kind, seq)"
    ");"
    "CREATE TABLE items ("
    "  id INTEGER PRIMARY KEY,"
    "  job_id INTEGER NOT NULL REFERENCES jobs(id),"
    "  custom_id TEXT,"
    "  source TEXT,"
    "  line_no INTEGER,"
    "  payload TEXT,"
    "  state TEXT NOT NULL"
    "    CHECK (state IN ('queued','leased','done','failed','cancelled')),"
    "  priority INTEGER NOT NULL DEFAULT 0,"
    "  attempts INTEGER NOT NULL DEFAULT 0,"
    "  max_attempts INTEGER NOT NULL DEFAULT 3,"
    "  lease_owner INTEGER REFERENCES runs(id),"
    "  lease_expiry INTEGER,"
    "  shard_id INTEGER REFERENCES shards(id),"
    "  error_code TEXT,"
    "  error_msg TEXT,"
    "  prompt_tokens INTEGER,"
    "  completion_tokens INTEGER,"
    "  finished INTEGER,"
    "  UNIQUE (job_id, custom_id)"
    ");"
    /* claiming from one job (and per-job state counts, the job-finished test) */
    "CREATE INDEX items_claim_job ON items (job_id, state, priority DESC, id);"
    /* claiming from any job; partial, so the planner never takes it for leased items */
    "CREATE INDEX items_claim_any ON items (priority DESC, id) WHERE state = 'queued';"
    /* expiry sweep and per-run lease work only ever look at leased items */
    "CREATE INDEX items_lease_expiry ON items (lease_expiry) WHERE state = 'leased';"
    "CREATE INDEX items_lease_owner ON items (lease_owner) WHERE state = 'leased';"
    "CREATE INDEX items_shard ON items (shard_id) WHERE shard_id IS NOT NULL;"
    "CREATE INDEX shards_run ON shards (run_id);";

/* Version 2: what the reliability rules need.
 * runs: the process identity (boot id, PID namespace, process start time) so a run on the
 *   same host can tell for certain that another run's process is gone (queue_reap_dead), and
 *   kind ('run' or 'submit': a submit records itself as a run while it writes a job).
 * items.shard_record: index (0-based) of the item's record among its shard's records, so
 *   export keeps exactly that record even when a retried item was written to one shard twice.
 * jobs.ready: 0 while the submit that creates the job is still adding items (runs leave such
 *   a job alone; a dead submit's job is deleted); jobs.submit_run names that submit.
 * meta: facts about the database itself; db_uuid names it in output directory markers, and a
 *   part of a partitioned queue says which (queue_meta_set: 'part', 'parts', 'part_set'). */
static const char SCHEMA_V2[] =
    "ALTER TABLE runs ADD COLUMN boot_id TEXT;"
    "ALTER TABLE runs ADD COLUMN pid_ns TEXT;"
    "ALTER TABLE runs ADD COLUMN pstart INTEGER;"
    "ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'run'"
    "  CHECK (kind IN ('run','submit'));"
    "ALTER TABLE items ADD COLUMN shard_record INTEGER;"
    "ALTER TABLE jobs ADD COLUMN ready INTEGER NOT NULL DEFAULT 1;"
    "ALTER TABLE jobs ADD COLUMN submit_run INTEGER REFERENCES runs(id);"
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "INSERT INTO meta (key, value) VALUES ('db_uuid', lower(hex(randomblob(16))));"
    "CREATE INDEX runs_active ON runs (host) WHERE ended IS NULL;";

/* Version 3: runs.progress_json, the live numbers (token rates, running sequences, KV use) a
 * run stores with its heartbeat about once a second, so `quern status` in another process can
 * show them (queue_run_progress). */
static const char SCHEMA_V3[] = "ALTER TABLE runs ADD COLUMN progress_json TEXT;";

/* Version 4: items.ttft_ms and tpot_ms, a finished request's time to first token and time per
 * output token after it (NULL: unknown, or an error record); and samples, a run's time series: every few seconds (and when a job's work ends) its
 * numbers for the job (queue_sample_add): the job's finished items, the run's engine counters
 * since the job's engine started (tokens, prefix-cache hits, steps, batch tokens, speculation)
 * and its load (sequences, KV blocks); for `quern status --json` and `quern report`. */
static const char SCHEMA_V4[] =
    "CREATE TABLE samples ("
    "  id INTEGER PRIMARY KEY,"
    "  run_id INTEGER NOT NULL REFERENCES runs(id),"
    "  job_id INTEGER NOT NULL REFERENCES jobs(id),"
    "  t INTEGER NOT NULL,"
    "  done INTEGER NOT NULL,"
    "  failed INTEGER NOT NULL,"
    "  gen_tokens INTEGER NOT NULL,"
    "  prompt_tokens INTEGER NOT NULL,"
    "  cached_tokens INTEGER NOT NULL,"
    "  running INTEGER NOT NULL,"
    "  waiting INTEGER NOT NULL,"
    "  kv_used INTEGER NOT NULL,"
    "  kv_total INTEGER NOT NULL,"
    "  steps INTEGER NOT NULL,"
    "  batch_tokens INTEGER NOT NULL,"
    "  spec_drafted INTEGER NOT NULL,"
    "  spec_accepted INTEGER NOT NULL);"
    "CREATE INDEX samples_job ON samples (job_id, t);"
    "ALTER TABLE items ADD COLUMN ttft_ms REAL;"
    "ALTER TABLE items ADD COLUMN tpot_ms REAL;";

/* Version 5: runs.engine_json, what can change a run's outputs (docs/ARCHITECTURE.md,
 * "Provenance"): quern's source revision, the device, the matmul mode, the KV type and the
 * tensor-parallel ranks; set when the run's engine for a job is ready (queue_run_set_engine),
 * NULL for submits and for runs before version 5. Manifests and `quern status` list it. */
static const char SCHEMA_V5[] = "ALTER TABLE runs ADD COLUMN engine_json TEXT;";

/* Version 6: samples by run, for what a run without --job did on a job (queue_job_timing: where
 * its work on the job began and ended). Without it each such run searched every sample of the
 * job: `status` on a queue a cron job had run on for two weeks took minutes.
 * runs.stopping: when the run began to stop (a signal, --max-runtime; queue_run_stopping), NULL
 * while it works. A run killed during its grace (Slurm's KillWait, 30 s, is shorter than many
 * a --grace) did not die of its requests: its leases go back without counting an attempt, as
 * a graceful stop's do. */
static const char SCHEMA_V6[] = "CREATE INDEX samples_run ON samples (run_id, t);"
                                "ALTER TABLE runs ADD COLUMN stopping INTEGER;";

/* Version 7. Version 6 was changed after it first shipped: the tables below came later under
 * the same number (39a5249 had only the index and runs.stopping above, edcb352 added
 * model_files, 0b56cea items.error_param), so a queue at 6 may lack either, and a quern that
 * expects them failed on it ("no such column: error_param", every run). Version 7 brings each
 * form of 6 to one schema, and its number keeps every earlier binary off the queues of this one:
 * a binary of version 6 reads them wrongly (its cancel erased the error records of lines
 * rejected at submit).
 * items.error_param: the request field a line rejected at submit named (its error's param).
 * model_files: the sha256 of a model file as it was when hashed, by its identity (device, inode,
 * size, modification and change times in ns): a later submit or run finds the same unchanged
 * file without reading it again (queue_model_sha). */
static const char SCHEMA_V7[] = "CREATE TABLE IF NOT EXISTS model_files ("
                                "  path TEXT PRIMARY KEY,"
                                "  dev INTEGER NOT NULL,"
                                "  ino INTEGER NOT NULL,"
                                "  size INTEGER NOT NULL,"
                                "  mtime_ns INTEGER NOT NULL,"
                                "  ctime_ns INTEGER NOT NULL,"
                                "  sha256 TEXT NOT NULL);";

/* Version 8: items.started, the run that may have begun computing the item under its lease:
 * set by the claim (parsing and tokenizing may crash too), cleared once the run has admitted
 * them and set again before the engine step that first computes them (queue_mark_started). A run
 * that dies holding an item its computation never reached did not die of it: whoever requeues it (a
 * dead run's leases, expired leases) takes its attempt back. Before, a kill -9 counted an attempt
 * for every item a run held (two per engine slot), so three crashes failed hundreds of requests
 * that never ran as attempts_exhausted. */
static const char SCHEMA_V8[] = "ALTER TABLE items ADD COLUMN started INTEGER;";

/* Does table have column? -1 when it cannot be read (an SQLite result code in *rc). */
static int has_column(sqlite3 *db, const char *table, const char *column, int *rc)
{
    sqlite3_stmt *s = NULL;
    *rc =
        sqlite3_prepare_v2(db, "SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2", -1, &s, NULL);
    if (*rc == SQLITE_OK) {
        sqlite3_bind_text(s, 1, table, -1, SQLITE_STATIC);
        sqlite3_bind_text(s, 2, column, -1, SQLITE_STATIC);
    }
    int found = *rc == SQLITE_OK ? sqlite3_step(s) : *rc;
    sqlite3_finalize(s);
    if (found == SQLITE_ROW || found == SQLITE_DONE) {
        *rc = SQLITE_OK;
        return found == SQLITE_ROW;
    }
    *rc = found;
    return -1;
}

/* Version 7's column, added where version 6 did not bring it. */
static int v7_error_param(sqlite3 *db)
{
    int rc, has = has_column(db, "items", "error_param", &rc);
    if (has == 0)
        rc = sqlite3_exec(db, "ALTER TABLE items ADD COLUMN error_param TEXT;", NULL, NULL, NULL);
    return rc;
}

const struct queue_migration queue_migrations[] = {
    {1, SCHEMA_V1, NULL},           {2, SCHEMA_V2, NULL}, {3, SCHEMA_V3, NULL},
    {4, SCHEMA_V4, NULL},           {5, SCHEMA_V5, NULL}, {6, SCHEMA_V6, NULL},
    {7, SCHEMA_V7, v7_error_param}, {8, SCHEMA_V8, NULL},
};

int queue_migration_apply(sqlite3 *db, const struct queue_migration *m)
{
    char pragma[64];
    int rc = sqlite3_exec(db, m->sql, NULL, NULL, NULL);
    if (rc == SQLITE_OK && m->then)
        rc = m->then(db);
    snprintf(pragma, sizeof(pragma), "PRAGMA user_version = %d", m->version);
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(db, pragma, NULL, NULL, NULL);
    return rc;
}
const size_t queue_n_migrations = sizeof(queue_migrations) / sizeof(queue_migrations[0]);

#define JOB_COLS                                                                                   \
    "id, name, created, finished, state, model_path, model_sha256, params_json, out_dir, seed, "   \
    "n_items, ready, coalesce(submit_run, 0)"
#define SHARD_COLS                                                                                 \
    "id, job_id, kind, seq, path, run_id, committed_bytes, records, superseded, state, sha256"
#define CLAIM_SET                                                                                  \
    "UPDATE items SET state = 'leased', lease_owner = ?1, lease_expiry = ?2, "                     \
    "attempts = attempts + 1, started = ?1 WHERE id IN "
#define CLAIM_RETURNING                                                                            \
    " RETURNING id, job_id, custom_id, payload, priority, attempts, max_attempts, error_code,"     \
    " error_msg, source, line_no, error_param"

const char *const queue_stmt_sql[QS_COUNT] = {
    [QS_BEGIN] = "BEGIN IMMEDIATE",
    [QS_COMMIT] = "COMMIT",
    [QS_ROLLBACK] = "ROLLBACK",
    [QS_SAVEPOINT] = "SAVEPOINT queue_call",
    [QS_RELEASE_SP] = "RELEASE queue_call",
    [QS_ROLLBACK_TO_SP] = "ROLLBACK TO queue_call",

    /* ?8: the submit run writing the job (not ready until it ends), or NULL (ready now) */
    [QS_JOB_INSERT] = "INSERT INTO jobs (name, created, state, model_path, model_sha256, "
                      "params_json, out_dir, seed, ready, submit_run)"
                      " VALUES (?1, ?2, 'queued', ?3, ?4, ?5, ?6, ?7, ?8 IS NULL, ?8)",
    [QS_JOB_GET] = "SELECT " JOB_COLS " FROM jobs WHERE id = ?1",
    [QS_JOB_BY_NAME] = "SELECT " JOB_COLS " FROM jobs WHERE name = ?1",
    [QS_JOB_LIST] = "SELECT " JOB_COLS " FROM jobs ORDER BY id",
    [QS_JOB_STATE] = "SELECT state FROM jobs WHERE id = ?1",
    /* ?2: the new item is queued, which reopens a done job */
    [QS_JOB_ADD_ITEM] = "UPDATE jobs SET n_items = n_items + 1,"
                        " state = CASE WHEN ?2 AND state = 'done' THEN 'running' ELSE state END,"
                        " finished = CASE WHEN ?2 AND state = 'done' THEN NULL ELSE finished END"
                        " WHERE id = ?1",
    [QS_JOB_START] = "UPDATE jobs SET state = 'running' WHERE id = ?1 AND state = 'queued'",
    /* a job with cancelled items ends cancelled: a cancel stopped between its transactions
     * (queue_job_cancel) whose other items runs then finished */
    [QS_JOB_FINISH] = "UPDATE jobs SET state = CASE WHEN EXISTS (SELECT 1 FROM items"
                      " WHERE job_id = ?1 AND state = 'cancelled') THEN 'cancelled' ELSE 'done'"
                      " END, finished = ?2"
                      " WHERE id = ?1 AND ready AND state IN ('queued', 'running') AND NOT EXISTS"
                      " (SELECT 1 FROM items WHERE job_id = ?1 AND state IN ('queued', 'leased'))",
    [QS_JOB_FINISH_ALL] = "UPDATE jobs SET state = CASE WHEN EXISTS (SELECT 1 FROM items"
                          " WHERE items.job_id = jobs.id AND items.state = 'cancelled')"
                          " THEN 'cancelled' ELSE 'done' END, finished = ?1"
                          " WHERE ready AND state IN ('queued', 'running') AND NOT EXISTS"
                          " (SELECT 1 FROM items WHERE items.job_id = jobs.id"
                          "  AND items.state IN ('queued', 'leased'))",
    /* at most ?3 items (queue_job_cancel's bounded transactions) */
    [QS_JOB_CANCEL_ITEMS] = "UPDATE items SET state = 'cancelled', lease_expiry = NULL,"
                            " finished = ?2 WHERE id IN (SELECT id FROM items WHERE job_id = ?1"
                            " AND state IN ('queued', 'leased')"
                            " AND (payload IS NOT NULL OR error_code IS NULL) LIMIT ?3)",
    /* lines rejected at submit are not work to cancel: their error is their answer, failed
     * without a shard (as schema v1 stored them; export writes their records) */
    [QS_JOB_CANCEL_REJECTED] = "UPDATE items SET state = 'failed', lease_expiry = NULL,"
                               " finished = ?2 WHERE id IN (SELECT id FROM items WHERE job_id = ?1"
                               " AND state IN ('queued', 'leased') AND payload IS NULL"
                               " AND error_code IS NOT NULL LIMIT ?3)",
    [QS_JOB_CANCEL] = "UPDATE jobs SET state = 'cancelled', finished = ?2"
                      " WHERE id = ?1 AND state IN ('queued', 'running')",
    /* queue_job_retry_failed, one range of item ids [?2, ?3) per transaction (a range of the
     * primary key, NOT INDEXED: SQLite would rather walk every failed item of the job through
     * items_claim_job each time; the range's cost is bounded whatever the job's size): the
     * failed items' ids, then
     * per errors shard how many of its records the range supersedes, then the items */
    [QS_JOB_RETRY_SPAN] = "SELECT min(id), max(id) FROM items WHERE job_id = ?1"
                          " AND state = 'failed'",
    [QS_JOB_RETRY_PICK] = "SELECT shard_id, count(*) FROM items NOT INDEXED"
                          " WHERE id >= ?2 AND id < ?3"
                          " AND job_id = ?1 AND state = 'failed' AND payload IS NOT NULL"
                          " AND shard_id IS NOT NULL GROUP BY shard_id",
    [QS_JOB_RETRY_SHARD] = "UPDATE shards SET superseded = superseded + ?2"
                           " WHERE id = ?1 AND kind = 'errors'",
    [QS_JOB_RETRY_ITEM] = "UPDATE items NOT INDEXED SET state = 'queued', attempts = 0,"
                          " lease_owner = NULL,"
                          " lease_expiry = NULL, shard_id = NULL, shard_record = NULL,"
                          " error_code = NULL, error_msg = NULL, prompt_tokens = NULL,"
                          " completion_tokens = NULL, finished = NULL"
                          " WHERE id >= ?2 AND id < ?3 AND job_id = ?1 AND state = 'failed'"
                          " AND payload IS NOT NULL",
    /* a job's readiness and its submit run; run_ended is 1 when there is no such run */
    [QS_JOB_SUBMIT_INFO] = "SELECT j.ready, coalesce(j.submit_run, 0),"
                           " coalesce(r.ended IS NOT NULL, 1) FROM jobs j"
                           " LEFT JOIN runs r ON r.id = j.submit_run WHERE j.id = ?1",
    [QS_JOB_PUBLISH] = "UPDATE jobs SET ready = 1 WHERE id = ?1 AND NOT ready",
    /* a job published without items is done at once (a part that got no lines): no run has
     * anything to do in it but write its (empty) manifest */
    [QS_JOB_PUBLISH_EMPTY] = "UPDATE jobs SET state = 'done', finished = ?2 WHERE id = ?1"
                             " AND ready AND n_items = 0 AND state = 'queued'",
    /* a line rejected at submit gives up the custom_id a valid line wants (queue_item_add) */
    [QS_ITEM_YIELD_ID] = "UPDATE items SET custom_id = NULL WHERE job_id = ?1 AND custom_id = ?2"
                         " AND payload IS NULL AND error_code IS NOT NULL",
    [QS_JOB_DELETE] = "DELETE FROM jobs WHERE id = ?1 AND NOT ready",
    /* not-ready jobs whose submit run may be dead: ended, or no heartbeat since ?1 (the
     * caller checks the process of the latter); never one a run or shard names. ?2: cursor */
    [QS_GC_CANDIDATES] = "SELECT j.id, coalesce(r.id, 0), coalesce(r.ended IS NOT NULL, 1),"
                         " r.host, r.boot_id, r.pid_ns, r.pid, r.pstart FROM jobs j"
                         " LEFT JOIN runs r ON r.id = j.submit_run"
                         " WHERE NOT j.ready AND j.id > ?2"
                         " AND (r.id IS NULL OR r.ended IS NOT NULL OR r.heartbeat <= ?1)"
                         " AND NOT EXISTS (SELECT 1 FROM runs WHERE runs.job_id = j.id)"
                         " AND NOT EXISTS (SELECT 1 FROM shards WHERE shards.job_id = j.id)"
                         " ORDER BY j.id LIMIT 64",
    [QS_JOB_REOPEN] = "UPDATE jobs SET state = 'running', finished = NULL"
                      " WHERE id = ?1 AND state = 'done'",
    [QS_JOB_SET_OUT] = "UPDATE jobs SET out_dir = ?2 WHERE id = ?1",
    [QS_META_GET] = "SELECT value FROM meta WHERE key = ?1",
    [QS_META_SET] = "INSERT INTO meta (key, value) VALUES (?1, ?2)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    [QS_COUNTS_JOB] = "SELECT state, count(*), total(prompt_tokens), total(completion_tokens),"
                      " total(attempts) FROM items WHERE job_id = ?1 GROUP BY state",
    [QS_COUNTS_ALL] = "SELECT state, count(*), total(prompt_tokens), total(completion_tokens),"
                      " total(attempts) FROM items"
                      " WHERE job_id IN (SELECT id FROM jobs WHERE ready) GROUP BY state",
    /* through items_claim_job (job_id, state, ...): only the rows counted are read */
    [QS_JOB_UNFINISHED] = "SELECT state, count(*) FROM items WHERE job_id = ?1"
                          " AND state IN ('queued', 'leased') GROUP BY state",
    [QS_JOB_ANY_UNFINISHED] = "SELECT EXISTS (SELECT 1 FROM items WHERE job_id = ?1"
                              " AND state IN ('queued', 'leased'))",
    [QS_ERRORS_JOB] = "SELECT coalesce(error_code, ''), count(*) FROM items"
                      " WHERE job_id = ?1 AND state = 'failed' GROUP BY 1 ORDER BY 2 DESC, 1"
                      " LIMIT ?2",
    [QS_ERRORS_ALL] = "SELECT coalesce(error_code, ''), count(*) FROM items"
                      " WHERE state = 'failed' AND job_id IN (SELECT id FROM jobs WHERE ready)"
                      " GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT ?2",

    /* inserts nothing when the job is missing or cancelled */
    [QS_ITEM_INSERT] = "INSERT INTO items (job_id, custom_id, source, line_no, payload, state,"
                       " priority, max_attempts, error_code, error_msg, finished, error_param)"
                       " SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12"
                       " FROM jobs WHERE id = ?1 AND state <> 'cancelled'",
    [QS_ITEM_DELETE_BATCH] = "DELETE FROM items WHERE id IN (SELECT id FROM items"
                             " WHERE job_id = ?1 LIMIT ?2)",
    [QS_ITEM_OWNER] = "SELECT job_id, state, lease_owner, shard_id FROM items WHERE id = ?1",
    /* the exactly-once rule: only while leased by the committing run */
    [QS_ITEM_FINISH] = "UPDATE items SET state = ?3, lease_expiry = NULL, shard_id = ?4,"
                       " error_code = ?5, error_msg = ?6, prompt_tokens = ?7,"
                       " completion_tokens = ?8, finished = ?9, shard_record = ?11,"
                       " ttft_ms = ?12, tpot_ms = ?13"
                       " WHERE id = ?1 AND job_id = ?10 AND state = 'leased'"
                       " AND lease_owner = ?2",

    /* inserts nothing when ?1 names a job that is missing or not ready */
    [QS_RUN_INSERT] = "INSERT INTO runs (job_id, worker_id, host, pid, started, heartbeat,"
                      " boot_id, pid_ns, pstart, kind) SELECT ?1, ?2, ?3, ?4, ?5, ?5, ?6, ?7,"
                      " ?8, ?9 WHERE ?1 IS NULL OR EXISTS (SELECT 1 FROM jobs"
                      "  WHERE id = ?1 AND ready)",
    /* ?1 the host, or NULL (unbound) for every host */
    [QS_RUN_ACTIVE] = "SELECT id, host, boot_id, pid_ns, pid, pstart FROM runs"
                      " WHERE ended IS NULL AND (?1 IS NULL OR host = ?1)",
    [QS_RUN_ENDED] = "SELECT ended IS NOT NULL FROM runs WHERE id = ?1",
    [QS_RUN_END] = "UPDATE runs SET ended = ?2, exit_reason = ?3, summary_json = ?4"
                   " WHERE id = ?1 AND ended IS NULL",
    /* a run found dead stopped when it last showed life, not when another process noticed */
    [QS_RUN_END_DEAD] = "UPDATE runs SET ended = max(started, heartbeat), exit_reason = 'dead'"
                        " WHERE id = ?1 AND ended IS NULL",
    [QS_RUN_HEARTBEAT] = "UPDATE runs SET heartbeat = ?2 WHERE id = ?1 AND ended IS NULL",
    [QS_RUN_STOPPING] = "UPDATE runs SET heartbeat = ?2, stopping = coalesce(stopping, ?2)"
                        " WHERE id = ?1 AND ended IS NULL",
    [QS_RUN_PROGRESS] = "UPDATE runs SET heartbeat = ?2, progress_json = ?3"
                        " WHERE id = ?1 AND ended IS NULL",
    /* a finished item's lease_owner is the run that committed its record (QS_ITEM_FINISH) */
    [QS_JOB_WRITERS] = "SELECT i.shard_id, coalesce(i.lease_owner, 0), count(*), r.host,"
                       " r.engine_json FROM items i LEFT JOIN runs r ON r.id = i.lease_owner"
                       " WHERE i.job_id = ?1 AND i.state IN ('done', 'failed')"
                       " AND i.shard_id IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2",
    [QS_SAMPLE_ADD] =
        "INSERT INTO samples (run_id, job_id, t, done, failed, gen_tokens,"
        " prompt_tokens, cached_tokens, running, waiting, kv_used, kv_total, steps,"
        " batch_tokens, spec_drafted, spec_accepted)"
        " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
    [QS_SAMPLE_LIST] = "SELECT run_id, job_id, t, done, failed, gen_tokens, prompt_tokens,"
                       " cached_tokens, running, waiting, kv_used, kv_total, steps, batch_tokens,"
                       " spec_drafted, spec_accepted FROM samples WHERE job_id = ?1 ORDER BY t, id",
    [QS_RUN_ENGINE] = "UPDATE runs SET engine_json = ?2 WHERE id = ?1",
    [QS_RUN_LIST_LIVE] =
        "SELECT id, coalesce(job_id, 0), worker_id, host, pid, started,"
        " heartbeat, progress_json, 0, NULL, engine_json, 0, boot_id, pid_ns, pstart"
        " FROM runs WHERE ended IS NULL AND kind = 'run' ORDER BY id",
    /* the runs with samples of the job: one list (samples_job), not a search per run */
    [QS_RUN_LIST_JOB] = "SELECT id, coalesce(job_id, 0), worker_id, host, pid, started,"
                        " heartbeat, progress_json, coalesce(ended, 0), exit_reason, engine_json,"
                        " id IN (SELECT run_id FROM samples WHERE job_id = ?1"
                        " AND (gen_tokens > 0 OR prompt_tokens > 0 OR cached_tokens > 0))"
                        " OR id IN (SELECT run_id FROM shards WHERE job_id = ?1 AND records > 0),"
                        " boot_id, pid_ns, pstart"
                        " FROM runs"
                        " WHERE kind = 'run' AND (job_id = ?1 OR ((job_id IS NULL OR job_id = 0)"
                        " AND id IN (SELECT run_id FROM samples WHERE job_id = ?1))) ORDER BY id",
    /* (its summary in the progress column) */
    [QS_RUN_LAST_ENDED] = "SELECT id, coalesce(job_id, 0), worker_id, host, pid, started,"
                          " heartbeat, summary_json, ended, exit_reason, engine_json, 0, boot_id,"
                          " pid_ns, pstart FROM runs WHERE kind = 'run' AND ended IS NOT NULL "
                          "ORDER BY ended DESC, id DESC"
                          " LIMIT 1",

    /* INDEXED BY: without ANALYZE statistics SQLite may otherwise walk every leased item */
    /* ?2: the sweeping run, whose own leases are never swept (0: none) */
    /* (an attempt is given back when the owner had begun to stop: see SCHEMA_V6) */
    /* (and when the owner never started computing it: see SCHEMA_V8) */
    [QS_LEASE_EXPIRE] = "UPDATE items INDEXED BY items_lease_expiry SET state = 'queued',"
                        " lease_owner = NULL, lease_expiry = NULL, started = NULL,"
                        " attempts = max(attempts - (started IS NOT lease_owner OR EXISTS"
                        " (SELECT 1 FROM runs WHERE runs.id = items.lease_owner"
                        " AND stopping IS NOT NULL)), 0)"
                        " WHERE state = 'leased' AND lease_expiry <= ?1 AND lease_owner <> ?2",
    [QS_LEASE_REQUEUE_RUN] =
        "UPDATE items INDEXED BY items_lease_owner SET state = 'queued', lease_owner = NULL,"
        " lease_expiry = NULL, started = NULL, attempts = max(attempts - (started IS NOT ?1"
        " OR EXISTS (SELECT 1 FROM runs WHERE id = ?1 AND stopping IS NOT NULL)), 0)"
        " WHERE state = 'leased' AND lease_owner = ?1",
    /* queue_mark_started: ?3 1 (may have begun) or 0 (handed to the engine, not begun) */
    [QS_ITEM_STARTED] = "UPDATE items SET started = CASE WHEN ?3 THEN ?1 END"
                        " WHERE id = ?2 AND state = 'leased' AND lease_owner = ?1",
    [QS_LEASE_EXTEND] = "UPDATE items INDEXED BY items_lease_owner SET lease_expiry = ?2"
                        " WHERE state = 'leased' AND lease_owner = ?1",
    [QS_LEASE_LIST] = "SELECT id FROM items INDEXED BY items_lease_owner"
                      " WHERE state = 'leased' AND lease_owner = ?1 ORDER BY id",
    /* only from ready jobs: a job still being submitted is invisible to runs. CLAIM_ANY walks
     * items_claim_any in claim order, looking up each item's job, rather than sorting every
     * queued item of the ready jobs (the plan SQLite picks for "job_id IN (ready jobs)") */
    [QS_CLAIM_JOB] = CLAIM_SET "(SELECT id FROM items WHERE job_id = ?3 AND state = 'queued'"
                               " AND (SELECT ready FROM jobs WHERE id = ?3)"
                               " ORDER BY priority DESC, id LIMIT ?4)" CLAIM_RETURNING,
    [QS_CLAIM_ANY] = CLAIM_SET "(SELECT id FROM items INDEXED BY items_claim_any"
                               " WHERE state = 'queued'"
                               " AND (SELECT ready FROM jobs WHERE jobs.id = items.job_id)"
                               " ORDER BY priority DESC, id LIMIT ?4)" CLAIM_RETURNING,
    [QS_RELEASE_ONE] = "UPDATE items SET state = 'queued', lease_owner = NULL,"
                       " lease_expiry = NULL, attempts = max(attempts - 1, 0)"
                       " WHERE id = ?2 AND state = 'leased' AND lease_owner = ?1",
    [QS_RELEASE_ALL] =
        "UPDATE items INDEXED BY items_lease_owner SET state = 'queued', lease_owner = NULL,"
        " lease_expiry = NULL, attempts = max(attempts - 1, 0)"
        " WHERE state = 'leased' AND lease_owner = ?1",

    [QS_SHARD_GET] = "SELECT " SHARD_COLS " FROM shards WHERE id = ?1",
    [QS_SHARD_NEXT_SEQ] = "SELECT coalesce(max(seq) + 1, 0) FROM shards"
                          " WHERE job_id = ?1 AND kind = ?2",
    [QS_SHARD_INSERT] = "INSERT INTO shards (job_id, kind, seq, path, run_id, created)"
                        " VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    [QS_SHARD_ADOPT] = "UPDATE shards SET run_id = ?2 WHERE id = ?1 AND state = 'open'"
                       " AND run_id <> ?2 AND run_id IN (SELECT id FROM runs"
                       "  WHERE ended IS NOT NULL OR heartbeat <= ?3)",
    [QS_SHARD_CLOSE] = "UPDATE shards SET state = 'closed', sha256 = ?3, closed = ?4"
                       " WHERE id = ?1 AND run_id = ?2 AND state = 'open'",
    [QS_SHARD_COMMIT] = "UPDATE shards SET committed_bytes = ?2, records = ?3 WHERE id = ?1",
    [QS_SHARD_LIST_JOB] = "SELECT " SHARD_COLS " FROM shards WHERE job_id = ?1"
                          " ORDER BY job_id, kind DESC, seq",
    [QS_SHARD_LIST_ALL] = "SELECT " SHARD_COLS " FROM shards ORDER BY job_id, kind DESC, seq",
};
