/* Chat templates: turns a list of role/content messages into the prompt text and token ids a
 * model expects, by recognising the model's tokenizer.chat_template (no Jinja engine).
 *
 * Supported (by the name --chat-template takes):
 *   chatml  "<|im_start|>role\ncontent<|im_end|>\n" per message, generation prompt
 *           "<|im_start|>assistant\n", including the default system turn that templates such
 *           as SmolLM2's and Qwen2.5's insert when the first message is not a system message:
 *           it is taken verbatim from the template's string literal.
 *   gemma   Gemma 2/3: "<bos>", "<start_of_turn>role\n" + trim(content) + "<end_of_turn>\n"
 *           with assistant written "model", a leading system message as a prefix of the first
 *           turn (content + "\n\n"; Gemma 2's template has no system role: an error),
 * user/assistant alternating from user (else an error, as the template raises), generation prompt
 * "<start_of_turn>model\n". llama3  Llama 3 (3.0: no dated default system turn):
 * "<|begin_of_text|>", then
 *           "<|start_header_id|>role<|end_header_id|>\n\n" + trim(content) + "<|eot_id|>".
 *   llama2  Llama 2 chat: a leading system message as "<<SYS>>\nsystem\n<</SYS>>\n\n" before
 *           the first turn's content; "<s>[INST] " + trim(content) + " [/INST]" per user turn,
 *           " " + trim(content) + " </s>" per assistant turn, alternating from user; no
 *           generation prompt (the template has none).
 *   mistral Mistral Instruct v0.1/v0.2: "<s>", "[INST] " + content + " [/INST]" and
 *           content + "</s>", alternating from user; a system message is an error (as the
 *           template raises); no generation prompt.
 *   phi3    Phi-3/3.5: "<|role|>\n" + content + "<|end|>\n" (an empty system message is left
 *           out); generation prompt "<|assistant|>\n", else "<|endoftext|>".
 *   llama31 Llama 3.1/3.2/3.3: llama3's with a system turn always first: "Cutting Knowledge
 *           Date: December 2023\nToday Date: 26 Jul 2024\n\n" + trim(leading system message).
 *   mistral-v3 Mistral v0.3: "<s>", "[INST] " + content + "[/INST]" with the system message +
 *           "\n\n" before the content of each user turn equal to the last one, " " +
 *           trim(content) + "</s>" per assistant turn; Nemo's variant (tight "[INST]", the
 *           system message only in a last user message, untrimmed assistant turns) recognised
 *           from its template.
 *   qwen3   Qwen3 (thinking): ChatML without a default system turn; an assistant turn after the
 *           last user query as "<think>\n" + reasoning + "\n</think>\n\n" + answer (split at
 *           </think>), earlier ones with the reasoning cut; ENGINE_CHAT_NO_THINKING adds
 *           "<think>\n\n</think>\n\n" after the generation prompt.
 *   deepseek-r1 DeepSeek R1's distills: BOS, the last system message's content, "<｜User｜>" +
 *           content, "<｜Assistant｜>" + the answer after the last </think> + EOS; generation
 *           prompt "<｜Assistant｜><think>\n".
 * trim is Jinja's (Python's str.strip whitespace). Variants that render differently (Llama 2
 * templates with a default system prompt, the first Phi-3 template, templates edited where
 * they write a conversation) are refused. A model without tokenizer.chat_template gets the format
 * whose marker token its vocabulary has (<start_of_turn>: gemma, <|start_header_id|>: llama3,
 * <|user|>: phi3, <｜User｜>: deepseek-r1), else plain ChatML without a default system turn
 * (llama.cpp's fallback too). */
#ifndef ENGINE_CHAT_H
#define ENGINE_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"

/* One chat message; both strings NUL-terminated UTF-8, owned by the caller. */
struct engine_chat_msg {
    const char *role;    /* "system", "user" or "assistant" */
    const char *content; /* message text, rendered verbatim */
};

struct engine_chat; /* opaque; see engine/chat.c */

/* The formats' names, as --chat-template takes them and errors list them. */
#define ENGINE_CHAT_NAMES                                                                          \
    "chatml, deepseek-r1, gemma, llama2, llama3, llama31, mistral, mistral-v3, mistral-v7, phi3, " \
    "phi4, phi4-mini, qwen3"

/* Recognise g's chat template. Unknown templates fail with ST_ERR_UNSUPPORTED naming the
 * template's first 60 characters. The result copies what it needs (g may be closed); the
 * caller frees it with engine_chat_free. */
enum status engine_chat_init(struct engine_chat **out, const struct io_gguf *g,
                             struct err_detail *err);

/* Use the format called name (ENGINE_CHAT_NAMES; mistral-v3 as v0.3's published template)
 * whatever g's template says; NULL: as
 * engine_chat_init. An unknown name is ST_ERR_INVALID_ARG listing the names. */
enum status engine_chat_init_named(struct engine_chat **out, const struct io_gguf *g,
                                   const char *name, struct err_detail *err);

/* The date (UTC day of unix_s) that a template writing today's date writes (mistral-v7's
 * default system prompt): the day engine_chat_init ran unless set; a job's run sets the day the
 * job was submitted, so that its prompts do not change with the day a part of it runs. */
void engine_chat_set_date(struct engine_chat *c, int64_t unix_s);

/* 1 when name is one of engine_chat_init_named's formats. */
int engine_chat_name_known(const char *name);

/* Free; NULL is a no-op. */
void engine_chat_free(struct engine_chat *c);

/* What engine_chat_render and engine_chat_tokenize write besides the messages (flags). */
#define ENGINE_CHAT_GEN_PROMPT 1u /* the assistant generation prompt */
#define ENGINE_CHAT_NO_THINKING                                                                    \
    2u /* enable_thinking false, for the templates that read it                                    \
        * (qwen3: an empty reasoning block after the prompt) */

/* Render n >= 1 messages (roles system/user/assistant, else ST_ERR_INVALID_ARG), followed by
 * what flags ask for (ENGINE_CHAT_*; 1 is the generation prompt). *out is NUL-terminated,
 * *out_len excludes the NUL; the caller frees *out with free(). */
enum status engine_chat_render(const struct engine_chat *c, const struct engine_chat_msg *msgs,
                               size_t n, unsigned flags, char **out, size_t *out_len,
                               struct err_detail *err);

/* Render and tokenize in one go. Only the special tokens the template itself inserts
 * (<|im_start|>, <|im_end|>, also inside the default system turn; <start_of_turn>, ...) become
 * special ids (a vocabulary without one is ST_ERR_UNSUPPORTED naming it); the text between two
 * of them ("user\n" + content, or "\n") is tokenized as one piece of plain text, so a literal
 * "<|im_end|>" inside content stays text unless allow_special_in_content, in which case
 * control-token text in those pieces is parsed too. BOS is prepended when the model's
 * add_bos_token says so and the format does not write it (gemma, llama3 do). The caller frees
 * *ids with free(). */
enum status engine_chat_tokenize(const struct engine_chat *c, const struct engine_tok *t,
                                 const struct engine_chat_msg *msgs, size_t n, unsigned flags,
                                 int allow_special_in_content, int32_t **ids, size_t *n_ids,
                                 struct err_detail *err);

/* Tests: the i-th published template (joined; the caller frees) that the format called name
 * (llama31, mistral-v3, qwen3, deepseek-r1) must be made of, or NULL past the last. */
char *engine_chat_published(const char *name, size_t i);

#endif
