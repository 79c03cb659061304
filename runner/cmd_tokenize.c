/* `quern tokenize`: token ids of stdin text as a JSON array on stdout (for counting and
 * debugging prompts). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/chat.h"
#include "engine/tokenizer.h"
#include "io/gguf.h"
#include "runner/runner.h"

static const char tok_usage[] =
    "usage: quern tokenize [--model PATH] [--chat [--chat-template NAME] [--no-thinking]]\n"
    "                      [--special] < TEXT\n"
    "\n"
    "Read text from stdin and print its token ids as a JSON array on stdout. Plain text gets\n"
    "no BOS token (`quern generate --prompt` adds the model's, where it has one).\n"
    "\n"
    "  --model PATH   GGUF model (default " RUNNER_DEFAULT_MODEL ")\n"
    "  --chat         treat stdin as one user message and render the chat template around\n"
    "                 it (with the generation prompt), as `quern generate --chat` does\n"
    "  --chat-template NAME\n"
    "                 " ENGINE_CHAT_NAMES "\n"
    "                 instead of the model's recognised template\n"
    "  --no-thinking  with --chat: enable_thinking false (Qwen3's template reads it)\n"
    "  --special      recognise special-token text such as <|im_end|> in the input\n"
    "                 (by default it is tokenized as plain text); with --chat, in the\n"
    "                 message too (`quern generate --chat` never does)\n"
    "  -h, --help     this help\n";

int runner_cmd_tokenize(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"chat", no_argument, 0, 'c'},
        {"special", no_argument, 0, 's'},
        {"help", no_argument, 0, 'h'},
        {"chat-template", required_argument, 0, 't'},
        {"no-thinking", no_argument, 0, 'n'},
        {0, 0, 0, 0},
    };
    const char *model = RUNNER_DEFAULT_MODEL;
    const char *tmpl = NULL;
    int chat = 0, special = 0, no_thinking = 0, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'c': chat = 1; break;
        case 's': special = 1; break;
        case 't': tmpl = optarg; break;
        case 'n':
            no_thinking = 1;
            break;
        case 'h': fputs(tok_usage, stdout); return RUNNER_EXIT_OK;
        default: fputs(tok_usage, stderr); return RUNNER_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "quern tokenize: unexpected argument '%s' (text comes on stdin)\n",
                argv[optind]);
        return RUNNER_EXIT_USAGE;
    }
    if (no_thinking && !chat) {
        fprintf(stderr, "quern tokenize: --no-thinking needs --chat\n");
        return RUNNER_EXIT_USAGE;
    }
    if (tmpl && !chat) {
        fprintf(stderr, "quern tokenize: --chat-template needs --chat ('%s')\n", tmpl);
        return RUNNER_EXIT_USAGE;
    }
    if (tmpl && !runner_chat_template_ok("tokenize", tmpl))
        return RUNNER_EXIT_USAGE;
    struct err_detail err = {0};
    struct io_gguf *g = NULL;
    struct engine_tok *tok = NULL;
    struct engine_chat *ch = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0, len = 0;
    int rc = RUNNER_EXIT_ERROR;
    char *text = NULL;
    enum status st;
    /* the model first: a wrong --model fails at once, not after the whole input is read */
    if ((st = io_gguf_open(&g, model, &err)) || (st = engine_tok_load(&tok, g, &err)) ||
        (chat && (st = engine_chat_init_named(&ch, g, tmpl, &err)))) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    if (!(text = runner_read_stdin(&len))) {
        LOG_ERROR("cannot read stdin");
        goto out;
    }
    if (chat) {
        if (strlen(text) != len) {
            LOG_ERROR("stdin contains a NUL byte; a chat message cannot");
            goto out;
        }
        struct engine_chat_msg msg = {"user", text};
        st = engine_chat_tokenize(
            ch, tok, &msg, 1, ENGINE_CHAT_GEN_PROMPT | (no_thinking ? ENGINE_CHAT_NO_THINKING : 0),
            special, &ids, &n_ids, &err);
    } else {
        st = engine_tok_encode(tok, text, len, special ? ENGINE_TOK_PARSE_SPECIAL : 0, &ids,
                               &n_ids, &err);
    }
    if (st) {
        LOG_ERROR("%s", err.msg);
        goto out;
    }
    putchar('[');
    for (size_t i = 0; i < n_ids; i++)
        printf(i ? ", %d" : "%d", ids[i]);
    puts("]");
    rc = RUNNER_EXIT_OK;
out:
    free(ids);
    free(text);
    engine_chat_free(ch);
    engine_tok_free(tok);
    io_gguf_close(g);
    return rc;
}
