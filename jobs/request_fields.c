/* Pass 2 of request parsing, the request's shape: OpenAI Batch or short form, custom_id, chat
 * messages and their content parts, completion prompts; parameters are read by
 * jobs/request_params.c. */
#include "jobs/request_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One message's content: a string or an array of {"type":"text","text":...} parts. */
static int read_content(struct job_parse_ctx *c, const cJSON *v, const char *path, char **out)
{
    if (cJSON_IsString(v)) {
        if (!(*out = strdup(v->valuestring)))
            return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
        return 1;
    }
    if (!cJSON_IsArray(v))
        return job_request_fail_type(c, path, "a string or an array of text parts", v);
    if (!v->child)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be an empty array",
                                path);
    size_t total = 0, i = 0;
    for (const cJSON *it = v->child; it; it = it->next, i++) {
        char ppath[JOB_PATH_CAP], fpath[JOB_PATH_CAP];
        const cJSON *t, *tx;
        job_request_pathf(ppath, "%s[%zu]", path, i);
        if (!cJSON_IsObject(it))
            return job_request_fail_type(c, ppath, "an object ({\"type\":\"text\",\"text\":...})",
                                         it);
        char pfx[JOB_PATH_CAP];
        job_request_pathf(pfx, "%s.", ppath);
        static const char *const part_known[] = {"type", "text", NULL};
        if (!job_request_get(c, it, pfx, "type", &t))
            return 0;
        /* (the type first: an image part's image_url is "unsupported", not unknown) */
        if (cJSON_IsString(t) && !strcmp(t->valuestring, "text") &&
            !job_request_known_fields(c, it, pfx, part_known, NULL))
            return 0;
        job_request_pathf(fpath, "%s.type", ppath);
        if (!t)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        if (!cJSON_IsString(t))
            return job_request_fail_type(c, fpath, "a string", t);
        const char *ty = t->valuestring;
        if (strcmp(ty, "text") != 0) {
            static const char *const media[] = {"image_url",   "input_image", "image",
                                                "input_audio", "audio",       "file",
                                                "input_file",  "video_url",   "refusal"};
            for (size_t k = 0; k < sizeof(media) / sizeof(media[0]); k++)
                if (strcmp(ty, media[k]) == 0)
                    return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, fpath,
                                            "%s is \"%s\": only text parts are supported", fpath,
                                            ty);
            char got[80];
            job_request_describe(t, got, sizeof(got));
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, fpath,
                                    "%s must be \"text\", got %s", fpath, got);
        }
        if (!job_request_get(c, it, pfx, "text", &tx))
            return 0;
        job_request_pathf(fpath, "%s.text", ppath);
        if (!tx)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        if (!cJSON_IsString(tx))
            return job_request_fail_type(c, fpath, "a string", tx);
        total += strlen(tx->valuestring);
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    size_t n = 0;
    for (const cJSON *it = v->child; it; it = it->next) {
        const char *tx = cJSON_GetObjectItemCaseSensitive(it, "text")->valuestring;
        size_t l = strlen(tx);
        memcpy(buf + n, tx, l);
        n += l;
    }
    buf[n] = 0;
    *out = buf;
    return 1;
}

static int read_messages(struct job_parse_ctx *c, const cJSON *v, struct job_request *r)
{
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%smessages", c->pfx);
    if (!cJSON_IsArray(v))
        return job_request_fail_type(c, path, "an array of messages", v);
    size_t n = 0;
    for (const cJSON *it = v->child; it; it = it->next)
        n++;
    if (n == 0)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be empty", path);
    if (!(r->messages = calloc(n, sizeof(*r->messages))))
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    size_t i = 0;
    for (const cJSON *m = v->child; m; m = m->next, i++) {
        char mpath[JOB_PATH_CAP], pfx[JOB_PATH_CAP], fpath[JOB_PATH_CAP], got[80];
        const cJSON *role, *content, *tc;
        job_request_pathf(mpath, "%s[%zu]", path, i);
        job_request_pathf(pfx, "%s.", mpath);
        if (!cJSON_IsObject(m))
            return job_request_fail_type(c, mpath, "an object with role and content", m);
        /* OpenAI's other message fields: name (no place in a chat template), refusal,
         * function_call, tool_call_id, audio: null or refused */
        static const char *const msg_known[] = {"role", "content", "tool_calls", NULL};
        static const char *const msg_unhonoured[] = {"name",         "refusal", "function_call",
                                                     "tool_call_id", "audio",   NULL};
        if (!job_request_get(c, m, pfx, "role", &role) ||
            !job_request_get(c, m, pfx, "content", &content) ||
            !job_request_get(c, m, pfx, "tool_calls", &tc) ||
            !job_request_known_fields(c, m, pfx, msg_known, msg_unhonoured))
            return 0;
        job_request_pathf(fpath, "%srole", pfx);
        if (!role)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        if (!cJSON_IsString(role))
            return job_request_fail_type(c, fpath, "a string", role);
        const char *rs = role->valuestring, *canon = NULL;
        if (strcmp(rs, "system") == 0 || strcmp(rs, "developer") == 0)
            canon = "system";
        else if (strcmp(rs, "user") == 0)
            canon = "user";
        else if (strcmp(rs, "assistant") == 0)
            canon = "assistant";
        else if (strcmp(rs, "tool") == 0 || strcmp(rs, "function") == 0)
            return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, fpath,
                                    "%s \"%s\" is not supported (no tool calling)", fpath, rs);
        if (!canon) {
            job_request_describe(role, got, sizeof(got));
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, fpath,
                                    "%s must be one of system, user, assistant, developer, got %s",
                                    fpath, got);
        }
        r->messages[i].role = canon;
        if (tc && !cJSON_IsNull(tc) && !(cJSON_IsArray(tc) && !tc->child)) {
            job_request_pathf(fpath, "%stool_calls", pfx);
            return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, fpath, "%s is not supported", fpath);
        }
        job_request_pathf(fpath, "%scontent", pfx);
        if (!content)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, fpath, "%s is missing", fpath);
        char *text = NULL;
        if (!read_content(c, content, fpath, &text))
            return 0;
        r->messages[i].content = text;
        r->n_messages = i + 1;
    }
    return 1;
}

static int read_prompt(struct job_parse_ctx *c, const cJSON *v, struct job_request *r)
{
    char path[JOB_PATH_CAP];
    job_request_pathf(path, "%sprompt", c->pfx);
    if (cJSON_IsArray(v)) {
        size_t n = 0;
        for (const cJSON *it = v->child; it; it = it->next)
            n++;
        if (n == 0)
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path,
                                    "%s must not be an empty array", path);
        if (!cJSON_IsString(v->child)) {
            if (cJSON_IsNumber(v->child) || cJSON_IsArray(v->child))
                return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path,
                                        "%s as token ids is not supported; send text", path);
            return job_request_fail_type(c, path, "a string", v->child);
        }
        if (n > 1)
            return job_request_fail(c->e, JOB_ERR_UNSUPPORTED, path,
                                    "%s with %zu prompts is not supported; put one prompt per line",
                                    path, n);
        v = v->child; /* a one-element array is the same as its string */
    }
    if (!cJSON_IsString(v))
        return job_request_fail_type(c, path, "a string", v);
    if (!v->valuestring[0])
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, path, "%s must not be empty", path);
    if (!(r->prompt = strdup(v->valuestring)))
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    return 1;
}

/* custom_id (always top level). Sets r->custom_id, or fails. */
static int read_custom_id(struct job_parse_ctx *c, const cJSON *root, struct job_request *r)
{
    const cJSON *v;
    if (!job_request_get_opt(c, root, "", "custom_id", &v))
        return 0;
    if (!v) {
        if (c->batch || !c->d->default_id)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, "custom_id",
                                    "custom_id is missing");
        v = NULL;
    } else {
        if (!cJSON_IsString(v))
            return job_request_fail_type(c, "custom_id", "a string", v);
        size_t n = strlen(v->valuestring);
        if (n == 0)
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, "custom_id",
                                    "custom_id must not be empty");
        if (n > JOB_CUSTOM_ID_MAX)
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, "custom_id",
                                    "custom_id is %zu bytes long; at most %d are allowed", n,
                                    JOB_CUSTOM_ID_MAX);
        snprintf(c->e->custom_id, sizeof(c->e->custom_id), "%s", v->valuestring);
    }
    const char *id = v ? v->valuestring : c->d->default_id;
    size_t n = strlen(id);
    if (n == 0 || n > JOB_CUSTOM_ID_MAX)
        return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, "custom_id",
                                "the default custom_id must be 1..%d bytes", JOB_CUSTOM_ID_MAX);
    if (!(r->custom_id = strdup(id)))
        return job_request_fail(c->e, JOB_ERR_INTERNAL, NULL, "out of memory");
    return 1;
}

/* Shape detection and the whole field walk over a parsed root. */
int job_request_read(struct job_parse_ctx *c, const cJSON *root, struct job_request *r)
{
    const cJSON *body, *method, *url, *msgs, *prompt;

    if (!cJSON_IsObject(root)) {
        char got[80];
        job_request_describe(root, got, sizeof(got));
        return job_request_fail(c->e, JOB_ERR_INVALID_TYPE, NULL,
                                "the line must be a JSON object, got %s", got);
    }
    if (!job_request_get(c, root, "", "body", &body) ||
        !job_request_get(c, root, "", "method", &method) ||
        !job_request_get(c, root, "", "url", &url))
        return 0;
    c->batch = body || method || url;
    c->pfx = c->batch ? "body." : "";
    if (!read_custom_id(c, root, r))
        return 0;

    const cJSON *params = root;
    if (c->batch) {
        if (!method)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, "method",
                                    "method is missing (must be \"POST\")");
        if (!cJSON_IsString(method))
            return job_request_fail_type(c, "method", "a string", method);
        if (strcmp(method->valuestring, "POST") != 0) {
            char got[80];
            job_request_describe(method, got, sizeof(got));
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, "method",
                                    "method must be \"POST\", got %s", got);
        }
        if (!url)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, "url", "url is missing");
        if (!cJSON_IsString(url))
            return job_request_fail_type(c, "url", "a string", url);
        if (strcmp(url->valuestring, "/v1/chat/completions") == 0) {
            r->kind = JOB_KIND_CHAT;
        } else if (strcmp(url->valuestring, "/v1/completions") == 0) {
            r->kind = JOB_KIND_COMPLETION;
        } else {
            char got[80];
            job_request_describe(url, got, sizeof(got));
            return job_request_fail(
                c->e, JOB_ERR_UNSUPPORTED, "url",
                "url %s is not supported (use /v1/chat/completions or /v1/completions)", got);
        }
        if (!body)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, "body", "body is missing");
        if (!cJSON_IsObject(body))
            return job_request_fail_type(c, "body", "an object", body);
        params = body;
        if (!job_request_get(c, body, "body.", "messages", &msgs) ||
            !job_request_get(c, body, "body.", "prompt", &prompt))
            return 0;
        if (r->kind == JOB_KIND_CHAT && !msgs)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, "body.messages",
                                    "body.messages is missing (required by /v1/chat/completions)");
        if (r->kind == JOB_KIND_COMPLETION && !prompt)
            return job_request_fail(c->e, JOB_ERR_MISSING_FIELD, "body.prompt",
                                    "body.prompt is missing (required by /v1/completions)");
        static const char *const line_fields[] = {"custom_id", "method", "url", "body", NULL};
        static const char *const chat_fields[] = {"messages", NULL};
        static const char *const completion_fields[] = {"prompt", NULL};
        if (!job_request_check_fields(c, root, "", line_fields, 0) ||
            !job_request_check_fields(
                c, body, "body.", r->kind == JOB_KIND_CHAT ? chat_fields : completion_fields, 1))
            return 0;
    } else {
        if (!job_request_get(c, root, "", "messages", &msgs) ||
            !job_request_get(c, root, "", "prompt", &prompt))
            return 0;
        if (msgs && prompt)
            return job_request_fail(c->e, JOB_ERR_INVALID_VALUE, "prompt",
                                    "the line has both messages and prompt; give one");
        if (!msgs && !prompt)
            return job_request_fail(
                c->e, JOB_ERR_MISSING_FIELD, "messages",
                "messages (chat) or prompt (completion) is missing, and there is no "
                "OpenAI Batch body");
        r->kind = msgs ? JOB_KIND_CHAT : JOB_KIND_COMPLETION;
        static const char *const short_fields[] = {"custom_id", "messages", "prompt", NULL};
        if (!job_request_check_fields(c, root, "", short_fields, 1))
            return 0;
    }
    if (r->kind == JOB_KIND_CHAT ? !read_messages(c, msgs, r) : !read_prompt(c, prompt, r))
        return 0;
    return job_request_read_params(c, params, r);
}
