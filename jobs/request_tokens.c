/* A request's prompt as token ids (job_request_tokens): apart from jobs/request.c so that the
 * line parser (and its fuzz harness) needs no tokenizer. */
#include "jobs/request.h"

#include <string.h>

#include "engine/tokenizer.h"

enum status job_request_tokens(const struct job_request *r, const struct engine_tok *tok,
                               const struct engine_chat *chat, int32_t n_ctx, int32_t **ids,
                               size_t *n, struct err_detail *err)
{
    *ids = NULL;
    *n = 0;
    size_t bytes = r->kind == JOB_KIND_CHAT ? 0 : strlen(r->prompt);
    for (size_t i = 0; r->kind == JOB_KIND_CHAT && i < r->n_messages; i++)
        bytes += strlen(r->messages[i].content);
    const size_t most = (size_t)n_ctx * engine_tok_max_piece(tok);
    if (n_ctx > 0 && bytes > most)
        return err_set(err, ST_ERR_RANGE,
                       "the prompt's %zu bytes are more than the model's context of %d tokens "
                       "can hold (%zu bytes at most)",
                       bytes, (int)n_ctx, most);
    if (r->kind == JOB_KIND_CHAT)
        return chat ? engine_chat_tokenize(chat, tok, r->messages, r->n_messages,
                                           ENGINE_CHAT_GEN_PROMPT |
                                               (r->no_thinking ? ENGINE_CHAT_NO_THINKING : 0),
                                           0, ids, n, err)
                    : err_set(err, ST_ERR_UNSUPPORTED, "the model has no usable chat template");
    return engine_tok_encode(tok, r->prompt, strlen(r->prompt), ENGINE_TOK_ADD_BOS, ids, n, err);
}
