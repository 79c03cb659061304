/* Job defaults <-> JSON (cJSON). Floats are stored as numbers, the seed as a decimal string
 * (a double cannot hold every uint64). */
#include "jobs/params.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

/* A float as the shortest decimal that reads back as the same float (0.7f is 0.7, not
 * 0.699999988079071: manifests and status show what the user typed). */
static double short_float(float f)
{
    char buf[32];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof(buf), "%.*g", p, (double)f);
        if (strtof(buf, NULL) == f)
            return strtod(buf, NULL);
    }
    return (double)f;
}

char *job_params_to_json(const struct job_defaults *d)
{
    cJSON *o = cJSON_CreateObject();
    char seed[32];
    if (!o)
        return NULL;
    snprintf(seed, sizeof(seed), "%" PRIu64, d->sampling.seed);
    cJSON_AddNumberToObject(o, "max_tokens", d->max_tokens);
    cJSON_AddNumberToObject(o, "max_tokens_cap", d->max_tokens_cap);
    cJSON_AddNumberToObject(o, "temperature", short_float(d->sampling.temperature));
    cJSON_AddNumberToObject(o, "top_p", short_float(d->sampling.top_p));
    cJSON_AddNumberToObject(o, "top_k", d->sampling.top_k);
    cJSON_AddNumberToObject(o, "min_p", short_float(d->sampling.min_p));
    cJSON_AddNumberToObject(o, "repetition_penalty", short_float(d->sampling.repeat_penalty));
    cJSON_AddNumberToObject(o, "repeat_last_n", d->sampling.repeat_last_n);
    cJSON_AddNumberToObject(o, "frequency_penalty", short_float(d->sampling.frequency_penalty));
    cJSON_AddNumberToObject(o, "presence_penalty", short_float(d->sampling.presence_penalty));
    cJSON_AddStringToObject(o, "seed", seed);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static enum status get_num(const cJSON *o, const char *k, double *v, int *present,
                           struct err_detail *err)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    *present = it != NULL;
    if (!it)
        return ST_OK;
    if (!cJSON_IsNumber(it))
        return err_set(err, ST_ERR_FORMAT, "job params: '%s' is not a number", k);
    *v = it->valuedouble;
    return ST_OK;
}

enum status job_params_from_json(const char *json, struct job_defaults *d, struct err_detail *err)
{
    cJSON *o = cJSON_Parse(json);
    if (!o || !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return err_set(err, ST_ERR_FORMAT, "job params are not a JSON object");
    }
    static const char *const keys[] = {"max_tokens", "max_tokens_cap", "temperature", "top_p",
                                       "top_k", "min_p", "repetition_penalty", "repeat_last_n",
                                       "frequency_penalty", "presence_penalty"};
    enum status st = ST_OK;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]) && !st; i++) {
        double v = 0;
        int present;
        if ((st = get_num(o, keys[i], &v, &present, err)) || !present)
            continue;
        switch (i) {
        case 0: d->max_tokens = (int32_t)v; break;
        case 1: d->max_tokens_cap = (int32_t)v; break;
        case 2: d->sampling.temperature = (float)v; break;
        case 3: d->sampling.top_p = (float)v; break;
        case 4: d->sampling.top_k = (int32_t)v; break;
        case 5: d->sampling.min_p = (float)v; break;
        case 6: d->sampling.repeat_penalty = (float)v; break;
        case 7: d->sampling.repeat_last_n = (int32_t)v; break;
        case 8: d->sampling.frequency_penalty = (float)v; break;
        case 9: d->sampling.presence_penalty = (float)v; break;
        }
    }
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(o, "seed");
    if (!st && seed) {
        char *end = NULL;
        if (!cJSON_IsString(seed) ||
            (d->sampling.seed = strtoull(seed->valuestring, &end, 10), !end || *end))
            st = err_set(err, ST_ERR_FORMAT, "job params: 'seed' is not a decimal string");
    }
    cJSON_Delete(o);
    return st;
}
