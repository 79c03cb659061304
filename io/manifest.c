/* manifest.json writer: builds the document with cJSON, writes it to a temporary file in the
 * same directory, fsyncs it, renames it over manifest.json and fsyncs the directory. */
#include "io/manifest.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/fault.h"
#include "io/shard.h"

const char *io_shard_kind_name(enum io_shard_kind k)
{
    return k == IO_SHARD_ERRORS ? "errors" : "results";
}

/* cJSON numbers are doubles: exact up to 2^53, which is more than any shard will hold. */
static int add_u64(cJSON *obj, const char *key, uint64_t v)
{
    return cJSON_AddNumberToObject(obj, key, (double)v) != NULL;
}

static int is_hex64(const char *s)
{
    if (strlen(s) != 64)
        return 0;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

static enum status build(const char *dir, const struct io_manifest *m, cJSON *root,
                         struct err_detail *err)
{
    const enum status nomem = ST_ERR_NOMEM;
    if (!cJSON_AddNumberToObject(root, "manifest_version", IO_MANIFEST_VERSION))
        return err_set(err, nomem, "out of memory");
    if (m->job_id && !cJSON_AddStringToObject(root, "job_id", m->job_id))
        return err_set(err, nomem, "out of memory");
    int64_t created = m->created_unix ? m->created_unix : (int64_t)time(NULL);
    if (!cJSON_AddNumberToObject(root, "created_unix", (double)created) ||
        !cJSON_AddBoolToObject(root, "complete", m->complete != 0) ||
        (m->cancelled && !cJSON_AddTrueToObject(root, "cancelled")))
        return err_set(err, nomem, "out of memory");

    cJSON *params;
    if (m->params) {
        if (!cJSON_IsObject(m->params))
            return err_set(err, ST_ERR_INVALID_ARG, "manifest: job params must be an object");
        params = cJSON_Duplicate(m->params, 1);
    } else if (m->params_json) {
        params = cJSON_Parse(m->params_json);
        if (!params || !cJSON_IsObject(params)) {
            cJSON_Delete(params);
            return err_set(err, ST_ERR_INVALID_ARG,
                           "manifest: job params are not a JSON object: %.80s", m->params_json);
        }
    } else {
        params = cJSON_CreateObject();
    }
    if (!params)
        return err_set(err, nomem, "out of memory");
    cJSON_AddItemToObject(root, "params", params);

    cJSON *model = cJSON_AddObjectToObject(root, "model");
    if (!model)
        return err_set(err, nomem, "out of memory");
    if (m->model_path) {
        char hex[SHA256_HEX_LEN];
        const char *sum = m->model_sha256;
        if (!sum || !*sum) {
            enum status st = sha256_file(m->model_path, SHA256_WHOLE_FILE, hex, err);
            if (st != ST_OK)
                return st;
            sum = hex;
        } else if (!is_hex64(sum)) {
            return err_set(err, ST_ERR_INVALID_ARG,
                           "manifest: model sha256 is not 64 hex digits: %.80s", sum);
        }
        if (!cJSON_AddStringToObject(model, "path", m->model_path) ||
            !cJSON_AddStringToObject(model, "sha256", sum))
            return err_set(err, nomem, "out of memory");
    }

    cJSON *shards = cJSON_AddArrayToObject(root, "shards");
    if (!shards)
        return err_set(err, nomem, "out of memory");
    uint64_t rec[2] = {0, 0}, bytes[2] = {0, 0}, count[2] = {0, 0};
    for (size_t i = 0; i < m->n_shards; i++) {
        const struct io_manifest_shard *sh = &m->shards[i];
        if (!sh->name || !*sh->name || strchr(sh->name, '/') || strcmp(sh->name, ".") == 0 ||
            strcmp(sh->name, "..") == 0)
            return err_set(err, ST_ERR_INVALID_ARG, "manifest: bad shard name \"%s\"",
                           sh->name ? sh->name : "(null)");
        if (sh->kind != IO_SHARD_RESULTS && sh->kind != IO_SHARD_ERRORS)
            return err_set(err, ST_ERR_INVALID_ARG, "manifest: shard %s has bad kind %d", sh->name,
                           (int)sh->kind);
        char hex[SHA256_HEX_LEN];
        const char *sum = sh->sha256;
        if (!*sum) {
            size_t n = strlen(dir) + strlen(sh->name) + 2;
            char *p = malloc(n);
            if (!p)
                return err_set(err, nomem, "out of memory");
            snprintf(p, n, "%s/%s", dir, sh->name);
            enum status st = sha256_file(p, sh->bytes, hex, err);
            free(p);
            if (st != ST_OK)
                return st;
            sum = hex;
        } else if (!is_hex64(sum)) {
            return err_set(err, ST_ERR_INVALID_ARG,
                           "manifest: shard %s sha256 is not 64 hex digits", sh->name);
        }
        cJSON *o = cJSON_CreateObject();
        if (!o)
            return err_set(err, nomem, "out of memory");
        cJSON_AddItemToArray(shards, o);
        cJSON *wr;
        if (!cJSON_AddStringToObject(o, "file", sh->name) ||
            !cJSON_AddStringToObject(o, "kind", io_shard_kind_name(sh->kind)) ||
            !add_u64(o, "records", sh->records) || !add_u64(o, "superseded", sh->superseded) ||
            !add_u64(o, "bytes", sh->bytes) || !cJSON_AddStringToObject(o, "sha256", sum) ||
            !(wr = cJSON_AddArrayToObject(o, "runs")))
            return err_set(err, nomem, "out of memory");
        for (size_t k = 0; k < sh->n_writers; k++) {
            cJSON *w = cJSON_CreateObject();
            if (!w)
                return err_set(err, nomem, "out of memory");
            cJSON_AddItemToArray(wr, w);
            if (!cJSON_AddNumberToObject(w, "run", (double)sh->writers[k].run_id) ||
                !add_u64(w, "records", sh->writers[k].records))
                return err_set(err, nomem, "out of memory");
        }
        rec[sh->kind] += sh->records;
        bytes[sh->kind] += sh->bytes;
        count[sh->kind]++;
    }
    cJSON *runs = cJSON_AddArrayToObject(root, "runs");
    if (!runs)
        return err_set(err, nomem, "out of memory");
    for (size_t i = 0; i < m->n_runs; i++) {
        const struct io_manifest_run *r = &m->runs[i];
        cJSON *o = cJSON_CreateObject();
        if (!o)
            return err_set(err, nomem, "out of memory");
        cJSON_AddItemToArray(runs, o);
        if (!cJSON_AddNumberToObject(o, "run", (double)r->id) ||
            !(r->host ? cJSON_AddStringToObject(o, "host", r->host)
                      : cJSON_AddNullToObject(o, "host")))
            return err_set(err, nomem, "out of memory");
        /* an engine that does not parse (never written so by quern) is listed as unknown */
        cJSON *eng = r->engine_json ? cJSON_Parse(r->engine_json) : NULL;
        if (eng && !cJSON_IsObject(eng)) {
            cJSON_Delete(eng);
            eng = NULL;
        }
        if (!eng && !(eng = cJSON_CreateNull()))
            return err_set(err, nomem, "out of memory");
        cJSON_AddItemToObject(o, "engine", eng);
        char fp[IO_FINGERPRINT_LEN];
        io_manifest_fingerprint(r->engine_json ? r->engine_json : "", fp);
        if (!(r->engine_json ? cJSON_AddStringToObject(o, "fingerprint", fp)
                             : cJSON_AddNullToObject(o, "fingerprint")))
            return err_set(err, nomem, "out of memory");
    }
    cJSON *tot = cJSON_AddObjectToObject(root, "totals");
    if (!tot)
        return err_set(err, nomem, "out of memory");
    for (int k = 0; k < 2; k++) {
        cJSON *o = cJSON_AddObjectToObject(tot, io_shard_kind_name((enum io_shard_kind)k));
        if (!o || !add_u64(o, "shards", count[k]) || !add_u64(o, "records", rec[k]) ||
            !add_u64(o, "bytes", bytes[k]))
            return err_set(err, nomem, "out of memory");
    }
    return ST_OK;
}

enum status io_manifest_write(const char *dir, const struct io_manifest *m, struct err_detail *err)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return err_set(err, ST_ERR_NOMEM, "out of memory");
    enum status st = build(dir, m, root, err);
    char *text = st == ST_OK ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (st != ST_OK)
        return st;
    if (!text)
        return err_set(err, ST_ERR_NOMEM, "out of memory");

    size_t len = strlen(text);
    text[len] = '\n'; /* replace the NUL: the file ends with a newline */
    st = io_file_replace(dir, "manifest.json", text, len + 1, "manifest", err);
    free(text);
    return st;
}

void io_manifest_fingerprint(const char *engine_json, char out[IO_FINGERPRINT_LEN])
{
    char hex[SHA256_HEX_LEN];
    sha256_buf_hex(engine_json, strlen(engine_json), hex);
    snprintf(out, IO_FINGERPRINT_LEN, "fp_%.16s", hex);
}
