/* Structured outputs: a request's response_format compiled to a byte grammar (engine/grammar.h)
 * that the engine's token masks keep the output inside.
 *
 * json_object: any JSON object. json_schema: the subset of JSON Schema whose every instance the
 * grammar can guarantee, so an output that ends by itself ("stop") always validates:
 *   type (one or a list), enum, const, anyOf, $ref to "#", "#/$defs/NAME" or
 *   "#/definitions/NAME" (recursion allowed), nullable (OpenAPI);
 *   objects: properties (written in schema order), required, additionalProperties (false, true,
 *     or a schema when there are no properties: a map) -- without additionalProperties: false,
 *     only the listed properties are written, which every such schema allows;
 *   arrays: items, minItems, maxItems (<= 1024);
 *   strings: minLength, maxLength (<= 4096 characters), format date, time, date-time, uuid;
 *   integers: minimum, maximum, exclusiveMinimum, exclusiveMaximum (within +-2^53);
 *   numbers: minimum 0 (no sign); other bounds on numbers are refused;
 *   annotations are ignored (title, description, default, examples, $schema, $id, $comment,
 *   deprecated, readOnly, writeOnly).
 * Anything else that constrains instances (pattern, oneOf, allOf, not, if/then/else,
 * multipleOf, uniqueItems, patternProperties, other formats, ...) is refused with the path of
 * the schema object and the keyword, so a request is rejected at submit rather than answered
 * with output that might not validate. */
#ifndef JOBS_SCHEMA_H
#define JOBS_SCHEMA_H

#include <cjson/cJSON.h>

#include "common/err.h"
#include "engine/grammar.h"

/* Output formats of a request (response_format.type). */
enum job_format {
    JOB_FORMAT_TEXT = 0,    /* free text */
    JOB_FORMAT_JSON_OBJECT, /* any JSON object */
    JOB_FORMAT_JSON_SCHEMA, /* an instance of the request's schema */
    JOB_FORMAT_GRAMMAR,     /* a sentence of the request's GBNF-style grammar (job_gbnf_grammar) */
};

/* Compile: format JSON_OBJECT ignores schema; JSON_SCHEMA needs it. On failure err->msg reads
 * "PATH: what" with PATH the schema location ("properties.age.pattern") and the return is
 * ST_ERR_UNSUPPORTED (a keyword or value quern cannot guarantee) or ST_ERR_INVALID_ARG (not a
 * valid schema: wrong types, a $ref that leads nowhere). *out holds one reference. */
enum status job_schema_grammar(enum job_format format, const cJSON *schema,
                               struct engine_grammar **out, struct err_detail *err);

/* The same from the schema's JSON text (as the queue stores it), or for JOB_FORMAT_GRAMMAR
 * from the grammar's text. */
enum status job_schema_grammar_text(enum job_format format, const char *schema_json,
                                    struct engine_grammar **out, struct err_detail *err);

/* quern's `grammar` field (jobs/gbnf.c), GBNF-style:
 *   name ::= alternatives      one rule per line (a line starting with | continues it);
 *                              "root" is where the output starts; # starts a comment
 *   "literal"  with \n \t \r \\ \" \xHH (a byte) \uXXXX escapes
 *   [a-z0-9_]  ASCII ranges and characters, non-ASCII characters listed singly;
 *   [^...]     any character but the listed ASCII ones;  .  any character (not NUL)
 *   name  ( ... )  x*  x+  x?  x{m}  x{m,}  x{m,n} (n <= 256)
 * Errors read "line N: what" (ST_ERR_INVALID_ARG; ST_ERR_UNSUPPORTED for limits); left
 * recursion is refused ("rule 'name' is left-recursive ..."). */
enum status job_gbnf_grammar(const char *text, struct engine_grammar **out,
                             struct err_detail *err);

#endif
