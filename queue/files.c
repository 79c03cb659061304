/* Hashes of model files recorded by identity (queue_model_sha, schema version 7). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileid.h"
#include "common/sha256.h"
#include "queue/queue_internal.h"

#define QUEUE_FILE_SETTLED_NS 2000000000LL /* changed longer ago than this: recordable */

/* The statement sql (NULL on failure) with path and the identity bound as ?1..?6. */
static sqlite3_stmt *prepare_id(struct queue *q, const char *sql, const char *path,
                                const struct file_version *id)
{
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(q->db, sql, -1, &s, NULL) != SQLITE_OK) {
        sqlite3_finalize(s);
        return NULL;
    }
    const int64_t v[5] = {id->dev, id->ino, id->size, id->mtime_ns, id->ctime_ns};
    sqlite3_bind_text(s, 1, path, -1, SQLITE_STATIC);
    for (int i = 0; i < 5; i++)
        sqlite3_bind_int64(s, 2 + i, v[i]);
    return s;
}

/* The recorded hash of path at identity id into sha: 1, or 0 when there is none (or the query
 * failed: then the file is read). */
static int recorded(struct queue *q, const char *path, const struct file_version *id, char *sha)
{
    sqlite3_stmt *s = prepare_id(q,
                                 "SELECT sha256 FROM model_files WHERE path = ?1 AND dev = ?2"
                                 " AND ino = ?3 AND size = ?4 AND mtime_ns = ?5 AND ctime_ns = ?6",
                                 path, id);
    int hit = 0;
    if (s && sqlite3_step(s) == SQLITE_ROW) {
        const unsigned char *v = sqlite3_column_text(s, 0);
        if (v && strlen((const char *)v) == SHA256_HEX_LEN - 1) {
            memcpy(sha, v, SHA256_HEX_LEN);
            hit = 1;
        }
    }
    sqlite3_finalize(s);
    return hit;
}

static void record(struct queue *q, const char *path, const struct file_version *id,
                   const char *sha)
{
    sqlite3_stmt *s = prepare_id(q,
                                 "INSERT OR REPLACE INTO model_files (path, dev, ino, size,"
                                 " mtime_ns, ctime_ns, sha256) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                                 path, id);
    if (!s)
        return;
    sqlite3_bind_text(s, 7, sha, -1, SQLITE_STATIC);
    sqlite3_step(s);
    sqlite3_finalize(s);
}

int queue_model_sha_peek(const char *db_path, const char *path, char *sha)
{
    struct file_version id;
    struct queue q; /* just the connection */
    memset(&q, 0, sizeof(q));
    /* read-only and immutable: no lock, no -wal/-shm made beside a WAL database (a plain
     * read-only open leaves them); what the WAL holds that is not checkpointed yet is not seen,
     * which costs only a hash */
    size_t n = strlen(db_path);
    char *uri = malloc(3 * n + 32);
    if (!uri || file_version_get(path, &id)) {
        free(uri);
        return 0;
    }
    char *u = uri + sprintf(uri, "file:");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)db_path[i];
        if (c == '%' || c == '?' || c == '#' || c < 0x20 || c >= 0x7f)
            u += sprintf(u, "%%%02X", c);
        else
            *u++ = (char)c;
    }
    strcpy(u, "?immutable=1");
    int rc = sqlite3_open_v2(uri, &q.db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, NULL);
    free(uri);
    if (rc != SQLITE_OK) {
        sqlite3_close(q.db);
        return 0;
    }
    int hit = recorded(&q, path, &id, sha);
    sqlite3_close(q.db);
    return hit;
}

void queue_model_sha_note(struct queue *q, const char *path, const struct file_version *before,
                          const char *sha)
{
    struct file_version now;
    if (!file_version_get(path, &now) && file_version_same(before, &now) &&
        file_version_settled(before, QUEUE_FILE_SETTLED_NS))
        record(q, path, before, sha);
}

enum status queue_model_sha(struct queue *q, const char *path, char *sha, int *cached,
                            struct err_detail *err)
{
    QUEUE_ERR_LOCAL(err);
    struct file_version before, after;
    if (cached)
        *cached = 0;
    if (file_version_get(path, &before))
        return err_set(err, ST_ERR_IO, "%s: %s", path, strerror(errno));
    if (recorded(q, path, &before, sha)) {
        if (cached)
            *cached = 1;
        return ST_OK;
    }
    enum status st = sha256_file(path, SHA256_WHOLE_FILE, sha, err);
    if (st)
        return st;
    if (!file_version_get(path, &after) && file_version_same(&before, &after) &&
        file_version_settled(&before, QUEUE_FILE_SETTLED_NS))
        record(q, path, &before, sha);
    return ST_OK;
}
