/* Compact JSON text building for output records (jobs/record.c) and canonical request lines
 * (jobs/request.c): a growable buffer with raw, string, number and float puts. Strings are
 * always written as valid UTF-8 (bytes that are not become U+FFFD). */
#ifndef JOBS_JSON_H
#define JOBS_JSON_H

#include <stddef.h>

/* Growable text buffer for compact JSON. Zero-initialise; after an allocation failure every
 * later put is a no-op and job_json_take returns NULL. */
struct job_json {
    char *data; /* malloc'd text, owned by the buffer until job_json_take */
    size_t len; /* bytes used, excluding the NUL kept after them */
    size_t cap; /* bytes allocated */
    int failed; /* 1 after an allocation failure */
};

/* Append n raw bytes (already JSON). */
void job_json_put_raw(struct job_json *b, const char *s, size_t n);

/* Append a NUL-terminated raw string (already JSON), e.g. "{\"id\":". */
void job_json_put_lit(struct job_json *b, const char *s);

/* Append printf-style text (numbers). */
void job_json_put_fmt(struct job_json *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Append s[0..n) as a quoted JSON string: '"' and '\\' escaped, control characters as \n,
 * \t, \r, \b, \f or \u00XX (NUL too), U+2028/U+2029 as \u2028/\u2029, each maximal subpart of
 * ill-formed UTF-8 as one U+FFFD; everything else verbatim. s may be NULL when n is 0. */
void job_json_put_str(struct job_json *b, const char *s, size_t n);

/* Append a JSON string for a NUL-terminated s, or null when s is NULL. */
void job_json_put_cstr(struct job_json *b, const char *s);

struct cJSON;
/* Add s (NUL-terminated: a path, a host name, an error message) to cJSON object o under key,
 * each maximal subpart of ill-formed UTF-8 as one U+FFFD, as job_json_put_str writes it (cJSON
 * copies bytes as they are: a file name with a byte like 0xFF made the document invalid UTF-8).
 * Returns the new item, NULL when out of memory. */
struct cJSON *job_json_add_text(struct cJSON *o, const char *key, const char *s);

/* Append the shortest decimal text that reads back (strtof) as exactly the float f; f must
 * be finite. */
void job_json_put_float(struct job_json *b, float f);

/* Append the shortest decimal text that reads back (strtod) as exactly d: integral values
 * below 2^53 as integers, others "%.15g" to "%.17g"; an infinity as 1e999 or -1e999 (which read
 * back as it), NaN as null. */
void job_json_put_double(struct job_json *b, double d);

/* Append v (a cJSON value) as compact JSON, its numbers by job_json_put_double, members in
 * their order (duplicate keys kept). cJSON's own printer is lossy: its round-trip check is
 * approximate, and 9007199254740991 printed as 9.00719925474099e+15. */
struct cJSON;
void job_json_put_value(struct job_json *b, const struct cJSON *v);

/* Hand over the text: returns the malloc'd NUL-terminated string (caller frees) and resets
 * b, or NULL (freeing everything) if any put failed. */
char *job_json_take(struct job_json *b);

/* Free the buffer's text and reset it; for error paths. */
void job_json_free(struct job_json *b);

#endif
