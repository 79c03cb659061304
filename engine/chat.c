/* Chat templates: recognises the template text (ChatML with its default system turn, Gemma,
 * Llama 2, Llama 3, Llama 3.1, Mistral v0.1/v0.2, v0.3 and Small 3.2, Phi-3, Phi-4, Phi-4-mini,
 * Qwen3, DeepSeek R1),
 * and renders or tokenizes a
 * conversation as a list of parts (the template's special tokens and text). */
#include "engine/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "engine/chat_published.h"

#define CHAT_IM_START "<|im_start|>"
#define CHAT_IM_END   "<|im_end|>"
#define CHAT_IM_SEP   "<|im_sep|>"
/* DeepSeek's turn tokens (fullwidth vertical lines, U+2581 for spaces) */
#define DS_BAR       "\xef\xbd\x9c" /* U+FF5C */
#define DS_SP        "\xe2\x96\x81" /* U+2581 */
#define DS_BOS       "<" DS_BAR "begin" DS_SP "of" DS_SP "sentence" DS_BAR ">"
#define DS_EOS       "<" DS_BAR "end" DS_SP "of" DS_SP "sentence" DS_BAR ">"
#define DS_USER      "<" DS_BAR "User" DS_BAR ">"
#define DS_ASSISTANT "<" DS_BAR "Assistant" DS_BAR ">"

/* What a rendered part is. */
enum chat_part_kind {
    CHAT_PART_TEXT = 0, /* plain text */
    CHAT_PART_SPECIAL,  /* one of the template's special tokens (s: its text) */
    CHAT_PART_CONTROL,  /* a special token where the vocabulary has it, else text (Mistral
                         * v0.3's [INST]: a control token there, text in v0.1's) */
    CHAT_PART_PREFIX,   /* " " before text after a control token: the space SentencePiece's
                         * prefix writes, so left out where the tokenizer adds that prefix */
};

/* The conversation formats. */
enum chat_fmt {
    CHAT_FMT_CHATML = 0,
    CHAT_FMT_GEMMA,
    CHAT_FMT_LLAMA3,
    CHAT_FMT_LLAMA2,
    CHAT_FMT_MISTRAL,
    CHAT_FMT_PHI3,
    CHAT_FMT_LLAMA31,
    CHAT_FMT_MISTRAL3,
    CHAT_FMT_QWEN3,
    CHAT_FMT_DEEPSEEK_R1,
    CHAT_FMT_MISTRAL7,
    CHAT_FMT_PHI4,
    CHAT_FMT_PHI4_MINI,
};

static const struct {
    const char *name;   /* --chat-template NAME */
    const char *marker; /* a special token in the vocabulary of this format's models and no
                           other's, or NULL ([INST] is plain text in Llama 2's and Mistral's) */
} g_fmts[] = {
    {"chatml", CHAT_IM_START},
    {"gemma", "<start_of_turn>"},
    {"llama3", "<|start_header_id|>"},
    {"llama2", NULL},
    {"mistral", NULL},
    {"phi3", "<|user|>"},
    {"llama31", NULL}, /* a model without a template gets llama3 (its marker) */
    {"mistral-v3", NULL},
    {"qwen3", NULL}, /* ChatML's marker */
    {"deepseek-r1", DS_USER},
    {"mistral-v7", NULL}, /* [SYSTEM_PROMPT] is text in Nemo's tekken vocabulary too */
    {"phi4", CHAT_IM_SEP},
    {"phi4-mini", NULL}, /* (its vocabulary has Phi-3's <|user|>) */
};

#define CHAT_N_FMTS (sizeof(g_fmts) / sizeof(g_fmts[0]))

/* One piece of the rendered conversation; text points into caller or chat-owned memory. */
struct chat_part {
    enum chat_part_kind kind; /* text or which special token */
    const char *s;            /* the text (for specials: their literal text) */
    size_t n;                 /* its length in bytes */
};

#define CHAT_MAX_DEFAULT_PARTS 16

struct engine_chat {
    int fmt;                                                /* enum chat_fmt */
    int no_system;                                          /* gemma: no system role (Gemma 2's
                                                             * template raises on one) */
    int m3_tight;    /* mistral-v3: "[INST]" + content (Nemo's), not "[INST] " + content */
    int m3_sys_last; /* mistral-v3: the system text goes into the last message if it is a user
                      * turn (loop.last), not into each user turn equal to the last one */
    int m3_raw;      /* mistral-v3: an assistant turn is content + eos, not " " + trim(it) */
    char today[16];  /* mistral-v7's date, YYYY-MM-DD (engine_chat_set_date) */
    char *default_system;                                   /* unescaped default turn, or NULL */
    struct chat_part default_parts[CHAT_MAX_DEFAULT_PARTS]; /* it split at special tokens */
    size_t n_default_parts;                                 /* entries in default_parts */
};

/* ---- recognising the template ---- */

/* The first ~60 characters of a template, made printable, for error messages. */
static void template_snippet(const char *s, size_t n, char *buf, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && i < 60 && o + 3 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') {
            buf[o++] = '\\';
            buf[o++] = 'n';
        } else if (c < 0x20 || c == 0x7f) {
            buf[o++] = '?';
        } else if (c >= 0x80 && i + 4 > 60) {
            break; /* do not cut a multi-byte character near the limit */
        } else {
            buf[o++] = (char)c;
        }
    }
    buf[o] = 0;
}

/* Parse the Jinja string literal that starts at s[*i] (a quote). Unescapes the Python-style
 * escapes Jinja accepts (\n \t \r \\ \' \" ; others are kept verbatim) into a malloc'd string
 * (*out, *out_len); advances *i past the closing quote. Returns 0 if unterminated. */
static int parse_literal(const char *s, size_t n, size_t *i, char **out, size_t *out_len)
{
    char q = s[*i];
    char *d = malloc(n - *i + 1);
    if (!d)
        return -1;
    size_t o = 0;
    for (size_t j = *i + 1; j < n; j++) {
        if (s[j] == q) {
            d[o] = 0;
            *out = d;
            *out_len = o;
            *i = j + 1;
            return 1;
        }
        if (s[j] == '\\' && j + 1 < n) {
            char e = s[++j];
            switch (e) {
            case 'n':
                d[o++] = '\n';
                break;
            case 't':
                d[o++] = '\t';
                break;
            case 'r':
                d[o++] = '\r';
                break;
            case '\\':
            case '\'':
            case '"':
                d[o++] = e;
                break;
            default:
                d[o++] = '\\';
                d[o++] = e;
            }
            continue;
        }
        d[o++] = s[j];
    }
    free(d);
    return 0;
}

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* 1 when the tag body tpl[b..e) is just the literal at [lb..le), give or take whitespace and
 * whitespace-control markers: {{- 'literal' -}}. */
static int literal_is_whole_expr(const char *tpl, size_t b, size_t e, size_t lb, size_t le)
{
    while (b < lb && (is_space(tpl[b]) || tpl[b] == '-' || tpl[b] == '+'))
        b++;
    while (e > le && (is_space(tpl[e - 1]) || tpl[e - 1] == '-' || tpl[e - 1] == '+'))
        e--;
    return b == lb && e == le;
}

/* Find the default system turn: a string literal in the template that is a complete ChatML
 * system turn and is output on its own ({{ '<|im_start|>system\n...<|im_end|>\n' }}).
 * *out is NULL when there is none. */
static enum status find_default_system(const char *tpl, size_t n, char **out,
                                       struct err_detail *err)
{
    *out = NULL;
    for (size_t i = 0; i + 1 < n;) {
        if (tpl[i] != '{' || (tpl[i + 1] != '{' && tpl[i + 1] != '%' && tpl[i + 1] != '#')) {
            i++;
            continue;
        }
        char open = tpl[i + 1];
        char close = open == '{' ? '}' : open;
        size_t body = i + 2, j = body;
        int closed = 0;
        while (j + 1 < n) {
            if (open != '#' && (tpl[j] == '\'' || tpl[j] == '"')) {
                size_t lb = j;
                char *lit;
                size_t lit_len;
                int r = parse_literal(tpl, n, &j, &lit, &lit_len);
                if (r < 0)
                    return err_set(err, ST_ERR_NOMEM, "parsing the chat template");
                if (r == 0)
                    return err_set(err, ST_ERR_FORMAT,
                                   "chat template has an unterminated string at byte %zu", lb);
                int turn =
                    strncmp(lit, CHAT_IM_START "system", strlen(CHAT_IM_START "system")) == 0 &&
                    strstr(lit, CHAT_IM_END) != NULL;
                if (!turn) {
                    free(lit);
                    continue;
                }
                size_t le = j, e = le;
                while (e + 1 < n && !(tpl[e] == close && tpl[e + 1] == '}'))
                    e++;
                if (open != '{' || !literal_is_whole_expr(tpl, body, e, lb, le)) {
                    free(lit);
                    return err_set(err, ST_ERR_UNSUPPORTED,
                                   "chat template builds its default system turn in a way this "
                                   "renderer does not support (byte %zu)",
                                   lb);
                }
                if (!*out) {
                    *out = lit;
                } else {
                    int same = strcmp(*out, lit) == 0;
                    free(lit);
                    if (!same)
                        return err_set(err, ST_ERR_UNSUPPORTED,
                                       "chat template has two different default system turns");
                }
                continue;
            }
            if (tpl[j] == close && tpl[j + 1] == '}') {
                closed = 1;
                break;
            }
            j++;
        }
        if (!closed)
            return err_set(err, ST_ERR_FORMAT, "chat template has an unclosed tag at byte %zu", i);
        i = j + 2;
    }
    return ST_OK;
}

/* Split the default system text at the ChatML special tokens into c->default_parts. */
static enum status split_default(struct engine_chat *c, struct err_detail *err)
{
    const char *s = c->default_system;
    size_t n = strlen(s), i = 0, text = 0;
    c->n_default_parts = 0;
    while (i <= n) {
        enum chat_part_kind k = CHAT_PART_TEXT;
        size_t tl = 0;
        if (i < n && strncmp(s + i, CHAT_IM_START, strlen(CHAT_IM_START)) == 0)
            k = CHAT_PART_SPECIAL, tl = strlen(CHAT_IM_START);
        else if (i < n && strncmp(s + i, CHAT_IM_END, strlen(CHAT_IM_END)) == 0)
            k = CHAT_PART_SPECIAL, tl = strlen(CHAT_IM_END);
        if (k == CHAT_PART_TEXT && i < n) {
            i++;
            continue;
        }
        if (c->n_default_parts + 2 > CHAT_MAX_DEFAULT_PARTS)
            return err_set(err, ST_ERR_UNSUPPORTED,
                           "chat template's default system turn has "
                           "too many special tokens");
        if (i > text)
            c->default_parts[c->n_default_parts++] =
                (struct chat_part){CHAT_PART_TEXT, s + text, i - text};
        if (i == n)
            break;
        c->default_parts[c->n_default_parts++] = (struct chat_part){k, s + i, tl};
        i += tl;
        text = i;
    }
    return ST_OK;
}

/* The format whose marker token the vocabulary has (a model without a template), or -1. */
static int fmt_from_vocab(const struct io_gguf *g)
{
    const struct io_gguf_str *toks;
    uint64_t n;
    if (io_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n, NULL) != ST_OK)
        return -1;
    for (int f = (int)CHAT_N_FMTS - 1; f >= 0; f--)
        for (uint64_t i = 0; g_fmts[f].marker && i < n; i++)
            if (io_gguf_str_eq(toks[i], g_fmts[f].marker))
                return f;
    return -1;
}

/* ---- templates made only of a published template's statements ---- */

/* The tag that starts at or after s[*i] ({{ }}, {% %} or {# #}): [*b, *e) with its delimiters,
 * *kind its second character ('{', '%' or '#'); quoted strings inside a tag are skipped (a
 * string may hold "}}"). 1 when found, 0 at the end, -1 when a tag is not closed. */
static int next_tag(const char *s, size_t n, size_t from, size_t *b, size_t *e, char *kind)
{
    size_t i = from;
    while (i + 1 < n && !(s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#')))
        i++;
    if (i + 1 >= n)
        return 0;
    *b = i;
    *kind = s[i + 1];
    const char close = *kind == '{' ? '}' : *kind;
    char quote = 0;
    for (i += 2; i + 1 < n; i++) {
        if (quote) {
            if (s[i] == '\\')
                i++;
            else if (s[i] == quote)
                quote = 0;
        } else if (*kind != '#' && (s[i] == '\'' || s[i] == '"')) {
            quote = s[i];
        } else if (s[i] == close && s[i + 1] == '}') {
            *e = i + 2;
            return 1;
        }
    }
    return -1;
}

/* The tag s[0..n) with each run of white space outside its strings made one space, into out
 * (n + 1 bytes), NUL-terminated; returns its length. */
static size_t tag_norm(const char *s, size_t n, char *out)
{
    size_t o = 0;
    char quote = 0;
    for (size_t i = 0; i < n; i++) {
        const char c = s[i];
        if (quote) {
            out[o++] = c;
            if (c == '\\' && i + 1 < n)
                out[o++] = s[++i];
            else if (c == quote)
                quote = 0;
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            if (o && out[o - 1] != ' ')
                out[o++] = ' ';
        } else {
            if (c == '\'' || c == '"')
                quote = c;
            out[o++] = c;
        }
    }
    out[o] = 0;
    return o;
}

/* 1 when the text between two tags writes nothing (Jinja with trim_blocks and lstrip_blocks,
 * as transformers renders): white space that a '-' beside it trims, the newline after a block
 * or comment (trim_blocks) and spaces or tabs before the next one (lstrip_blocks). prev and
 * next are the tags around it (NULL at the template's start or end). */
static int gap_silent(const char *g, size_t n, const char *prev, size_t pn, const char *next)
{
    for (size_t i = 0; i < n; i++)
        if (!strchr(" \t\n\r", g[i]))
            return 0;
    if (!n || (prev && prev[pn - 3] == '-') || (next && next[2] == '-') ||
        (!next && n == 1 && g[0] == '\n')) /* (Jinja drops the template's last newline) */
        return 1;
    const int prev_block = prev && prev[1] != '{', next_block = next && next[1] != '{';
    size_t i = 0;
    if (prev_block && g[0] == '\n')
        i = 1; /* trim_blocks */
    if (i == n)
        return 1;
    if (!next_block || i == 0) /* lstrip_blocks: only spaces and tabs at a line's start */
        return 0;
    for (; i < n; i++)
        if (g[i] != ' ' && g[i] != '\t')
            return 0;
    return 1;
}

/* The statements ({{ }} and {% %} tags; comments left out) of the template s[0..n), each
 * normalised (tag_norm) and between \x01 marks, as one malloc'd string; NULL when a tag is not
 * closed, when silent and the text between two tags writes something (gap_silent), or when
 * out of memory. */
static char *tag_seq(const char *s, size_t n, int silent)
{
    /* each tag (4 bytes or more) writes at most itself and a mark: side by side, more than n */
    char *q = malloc(2 * n + 2);
    if (!q)
        return NULL;
    size_t len = 0, at = 0, b, e, pb = 0, pe = 0;
    char kind;
    int r;
    q[len++] = '\x01';
    while ((r = next_tag(s, n, at, &b, &e, &kind)) == 1) {
        if (silent && !gap_silent(s + at, b - at, at ? s + pb : NULL, pe - pb, s + b))
            break;
        if (kind != '#') {
            len += tag_norm(s + b, e - b, q + len);
            q[len++] = '\x01';
        }
        pb = b;
        pe = e;
        at = e;
    }
    if (r != 0 || (silent && !gap_silent(s + at, n - at, at ? s + pb : NULL, pe - pb, NULL))) {
        free(q);
        return NULL;
    }
    q[len] = 0;
    return q;
}

/* The published template's lines joined into one malloc'd string (NULL when out of memory). */
static char *join_lines(const char *const *lines)
{
    size_t n = 1;
    for (size_t l = 0; lines[l]; l++)
        n += strlen(lines[l]);
    char *out = malloc(n);
    if (!out)
        return NULL;
    n = 0;
    for (size_t l = 0; lines[l]; l++) {
        const size_t k = strlen(lines[l]);
        memcpy(out + n, lines[l], k);
        n += k;
    }
    out[n] = 0;
    return out;
}

/* Which of the published texts pub (each a NULL-terminated array of lines) the template s is,
 * but for white space that writes nothing and comments: the same statements in the same order,
 * each as written there up to white space outside its strings; -1 when none. An edited copy
 * (a statement added, removed or moved, a default system prompt, text between statements) is
 * not rendered as the published one. */
static int published_as(const char *s, const char *const *const *pub)
{
    char *seq = tag_seq(s, strlen(s), 1);
    int same = -1;
    for (size_t t = 0; seq && pub[t] && same < 0; t++) {
        char *text = join_lines(pub[t]);
        if (!text)
            break;
        char *ps = tag_seq(text, strlen(text), 0);
        if (ps && !strcmp(ps, seq))
            same = (int)t;
        free(ps);
        free(text);
    }
    free(seq);
    return same;
}

/* The format of the NUL-terminated template text s, or -1 when it is none this renderer
 * writes exactly. Each format is recognised by the special tokens or phrases its published
 * templates write; a variant that renders differently (Llama 3.1's dated system turn and tools,
 * Llama 2 templates with a default system prompt, Mistral v0.3's system-in-last-turn and tools,
 * the first Phi-3 template that writes <|assistant|> after every user turn) is refused. */
static int fmt_from_template(const char *s, int *variant)
{
    if (strstr(s, g_fmts[CHAT_FMT_GEMMA].marker))
        return CHAT_FMT_GEMMA;
    if (strstr(s, DS_USER))
        return published_as(s, g_pub_deepseek_r1) >= 0 ? CHAT_FMT_DEEPSEEK_R1 : -1;
    if (strstr(s, g_fmts[CHAT_FMT_LLAMA3].marker)) {
        if (strstr(s, "Cutting Knowledge"))
            return published_as(s, g_pub_llama31) >= 0 ? CHAT_FMT_LLAMA31 : -1;
        return strstr(s, "tools") ? -1 : CHAT_FMT_LLAMA3;
    }
    if (strstr(s, "[SYSTEM_PROMPT]"))
        return published_as(s, g_pub_mistral_v7) >= 0 ? CHAT_FMT_MISTRAL7 : -1;
    if (strstr(s, "[INST]")) {
        if ((*variant = published_as(s, g_pub_mistral_v3)) >= 0)
            return CHAT_FMT_MISTRAL3;
        if (strstr(s, "<<SYS>>"))
            return strstr(s, "bos_token + '[INST] ' + content.strip() + ' [/INST]'") &&
                           strstr(s, "set system_message = messages[0]['content']") &&
                           strstr(s, "set system_message = false") &&
                           !strstr(s, "elif message['role'] == 'system'")
                       ? CHAT_FMT_LLAMA2
                       : -1;
        return strstr(s, "'[INST] ' + message['content'] + ' [/INST]'") &&
                       strstr(s, "Only user and assistant roles are supported!")
                   ? CHAT_FMT_MISTRAL
                   : -1;
    }
    if (strstr(s, "<|tool|>") && strstr(s, "<|end|>"))
        return published_as(s, g_pub_phi4_mini) >= 0 ? CHAT_FMT_PHI4_MINI : -1;
    if (strstr(s, g_fmts[CHAT_FMT_PHI3].marker) && strstr(s, "<|end|>"))
        return strstr(s, "message['role'] == 'system' and message['content']") &&
                       strstr(s, "add_generation_prompt") && !strstr(s, "tools")
                   ? CHAT_FMT_PHI3
                   : -1;
    if (strstr(s, CHAT_IM_SEP))
        return published_as(s, g_pub_phi4) >= 0 ? CHAT_FMT_PHI4 : -1;
    if (strstr(s, CHAT_IM_START) && strstr(s, CHAT_IM_END)) {
        /* a template that writes or strips reasoning (<think>) is not plain ChatML: Qwen3's is
         * rendered as it is, the others (QwQ, SmolLM3, DeepSeek's distills) are refused */
        if (published_as(s, g_pub_qwen3) >= 0)
            return CHAT_FMT_QWEN3;
        return strstr(s, "think>") || strstr(s, "enable_thinking") || strstr(s, "reasoning_content")
                   ? -1
                   : CHAT_FMT_CHATML;
    }
    return -1;
}

void engine_chat_set_date(struct engine_chat *c, int64_t unix_s)
{
    const time_t t = (time_t)unix_s;
    struct tm tm;
    if (!gmtime_r(&t, &tm) || !strftime(c->today, sizeof(c->today), "%Y-%m-%d", &tm))
        snprintf(c->today, sizeof(c->today), "1970-01-01");
}

enum status engine_chat_init(struct engine_chat **out, const struct io_gguf *g,
                             struct err_detail *err)
{
    return engine_chat_init_named(out, g, NULL, err);
}

int engine_chat_name_known(const char *name)
{
    for (size_t i = 0; i < CHAT_N_FMTS; i++)
        if (!strcmp(name, g_fmts[i].name))
            return 1;
    return 0;
}

enum status engine_chat_init_named(struct engine_chat **out, const struct io_gguf *g,
                                   const char *name, struct err_detail *err)
{
    *out = NULL;
    struct engine_chat *c = calloc(1, sizeof(*c));
    if (!c)
        return err_set(err, ST_ERR_NOMEM, "allocating the chat template");
    engine_chat_set_date(c, (int64_t)time(NULL));
    if (name) { /* chosen by name: the format as it is, no default system turn */
        for (c->fmt = 0; c->fmt < (int)CHAT_N_FMTS; c->fmt++)
            if (!strcmp(name, g_fmts[c->fmt].name)) {
                *out = c;
                return ST_OK;
            }
        free(c);
        return err_set(err, ST_ERR_INVALID_ARG,
                       "unknown chat template '%.40s' (" ENGINE_CHAT_NAMES ")", name);
    }
    struct io_gguf_str tpl;
    enum status st = io_gguf_get_str(g, "tokenizer.chat_template", &tpl, err);
    if (st != ST_OK && st != ST_ERR_NOT_FOUND) {
        free(c);
        return st;
    }
    if (st == ST_ERR_NOT_FOUND) {
        const int f = fmt_from_vocab(g);
        c->fmt = f < 0 ? CHAT_FMT_CHATML : f;
        LOG_WARN("model has no tokenizer.chat_template; using %s%s", g_fmts[c->fmt].name,
                 f < 0 ? "" : " (its vocabulary has the format's tokens)");
        *out = c;
        return ST_OK;
    }

    char *s = malloc((size_t)tpl.len + 1);
    if (!s) {
        free(c);
        return err_set(err, ST_ERR_NOMEM, "copying the chat template");
    }
    memcpy(s, tpl.ptr, (size_t)tpl.len);
    s[tpl.len] = 0;
    size_t n = (size_t)tpl.len;
    int ok = !memchr(s, 0, n);
    int variant = 0;
    c->fmt = ok ? fmt_from_template(s, &variant) : -1;
    ok = c->fmt >= 0;
    c->no_system = ok && c->fmt == CHAT_FMT_GEMMA && strstr(s, "System role not supported");
    if (ok && c->fmt == CHAT_FMT_MISTRAL3) /* g_pub_mistral_v3[1]: Nemo's variant */
        c->m3_tight = c->m3_sys_last = c->m3_raw = variant == 1;
    if (!ok) {
        char snip[200];
        template_snippet(s, n, snip, sizeof(snip));
        free(s);
        free(c);
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "chat template not supported (ChatML, Gemma, Llama 2, Llama 3, Llama "
                       "3.1/3.2/3.3, Mistral v0.1/v0.2/v0.3, Mistral Small 3.2, Phi-3, Phi-4, "
                       "Phi-4-mini, Qwen3 and DeepSeek R1's distills are; "
                       "--chat-template NAME picks one): \"%s\"",
                       snip);
    }
    st = c->fmt == CHAT_FMT_CHATML ? find_default_system(s, n, &c->default_system, err) : ST_OK;
    if (st == ST_OK && c->default_system)
        st = split_default(c, err);
    free(s);
    if (st != ST_OK) {
        err_prefix(err, "chat template");
        engine_chat_free(c);
        return st;
    }
    *out = c;
    return ST_OK;
}

void engine_chat_free(struct engine_chat *c)
{
    if (!c)
        return;
    free(c->default_system);
    free(c);
}

/* ---- rendering ---- */

/* Python's str.isspace for the character at s (UTF-8), as Jinja's trim strips: its byte
 * length, or 0 when it is not whitespace. */
static size_t space_len(const unsigned char *s, size_t n)
{
    static const char *const multi[] = {"\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80",
                                        "\xE2\x80\xA8", "\xE2\x80\xA9", "\xE2\x80\xAF",
                                        "\xE2\x81\x9F", "\xE3\x80\x80"};
    if ((s[0] >= 0x09 && s[0] <= 0x0D) || (s[0] >= 0x1C && s[0] <= 0x20))
        return 1;
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x80 && s[2] >= 0x80 && s[2] <= 0x8A) /* U+2000..200A */
        return 3;
    for (size_t i = 0; i < sizeof(multi) / sizeof(multi[0]); i++) {
        size_t l = strlen(multi[i]);
        if (n >= l && !memcmp(s, multi[i], l))
            return l;
    }
    return 0;
}

/* content with leading and trailing whitespace cut (Jinja's trim), as a part. */
static struct chat_part trimmed(const char *content)
{
    const unsigned char *s = (const unsigned char *)content;
    size_t b = 0, e = strlen(content), l;
    while (b < e && (l = space_len(s + b, e - b)))
        b += l;
    while (e > b) { /* the last character, while it is whitespace */
        size_t k = e - 1;
        while (k > b && (s[k] & 0xC0) == 0x80)
            k--;
        if (space_len(s + k, e - k) != e - k)
            break;
        e = k;
    }
    return (struct chat_part){CHAT_PART_TEXT, content + b, e - b};
}

static struct chat_part text(const char *s)
{
    return (struct chat_part){CHAT_PART_TEXT, s, strlen(s)};
}

static struct chat_part special(const char *s)
{
    return (struct chat_part){CHAT_PART_SPECIAL, s, strlen(s)};
}

/* ChatML: the default system turn unless the chat starts with one, then
 * <|im_start|>role\ncontent<|im_end|>\n per message; <|im_start|>assistant\n. */
static size_t parts_chatml(const struct engine_chat *c, const struct engine_chat_msg *m, size_t n,
                           int gen, struct chat_part *p)
{
    size_t k = 0;
    if (c->default_system && strcmp(m[0].role, "system") != 0)
        for (size_t i = 0; i < c->n_default_parts; i++)
            p[k++] = c->default_parts[i];
    for (size_t i = 0; i < n; i++) {
        p[k++] = special(CHAT_IM_START);
        p[k++] = text(m[i].role);
        p[k++] = text("\n");
        p[k++] = text(m[i].content);
        p[k++] = special(CHAT_IM_END);
        p[k++] = text("\n");
    }
    if (gen) {
        p[k++] = special(CHAT_IM_START);
        p[k++] = text("assistant\n");
    }
    return k;
}

/* Phi-4: <|im_start|>role<|im_sep|>content<|im_end|> for system and user turns, a user turn
 * followed at once by <|im_start|>assistant<|im_sep|> (the template writes it after every user
 * message: it has no generation prompt of its own), an assistant turn content<|im_end|>. */
static size_t parts_phi4(const struct engine_chat_msg *m, size_t n, struct chat_part *p)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(m[i].role, "assistant")) {
            p[k++] = special(CHAT_IM_START);
            p[k++] = text(m[i].role);
            p[k++] = special(CHAT_IM_SEP);
        }
        p[k++] = text(m[i].content);
        p[k++] = special(CHAT_IM_END);
        if (!strcmp(m[i].role, "user")) {
            p[k++] = special(CHAT_IM_START);
            p[k++] = text("assistant");
            p[k++] = special(CHAT_IM_SEP);
        }
    }
    return k;
}

/* The message roles' alternation check of the Gemma, Llama 2 and Mistral templates: message i
 * of the loop (counted from first) must be a user turn exactly at even positions; the other
 * positions take any role that is not user. */
static enum status check_alternation(const char *fmt, const struct engine_chat_msg *m, size_t i,
                                     size_t first, struct err_detail *err)
{
    const int user = strcmp(m[i].role, "user") == 0;
    if (user != ((i - first) % 2 == 0))
        return err_set(err, ST_ERR_INVALID_ARG,
                       "the %s chat template needs user and assistant turns alternating "
                       "from user (message %zu is %s)",
                       fmt, i, m[i].role);
    return ST_OK;
}

/* Gemma: <bos>; a leading system message becomes a prefix of the first turn (its content and a
 * blank line); the others alternate user/assistant from user (else an error, as the template
 * raises), each <start_of_turn>role\ntrim(content)<end_of_turn>\n with assistant written
 * "model"; <start_of_turn>model\n. */
static enum status parts_gemma(const struct engine_chat *c, const struct engine_chat_msg *m,
                               size_t n, int gen, struct chat_part *p, size_t *np,
                               struct err_detail *err)
{
    size_t k = 0;
    const size_t first = strcmp(m[0].role, "system") == 0;
    if (first && c->no_system)
        return err_set(err, ST_ERR_INVALID_ARG,
                       "this model's gemma chat template has no system role (Gemma 2: it "
                       "raises on one; put the instructions in the first user message)");
    p[k++] = special("<bos>");
    for (size_t i = first; i < n; i++) {
        enum status st = check_alternation("gemma", m, i, first, err);
        if (st != ST_OK)
            return st;
        p[k++] = special("<start_of_turn>");
        p[k++] = text(strcmp(m[i].role, "assistant") ? m[i].role : "model");
        p[k++] = text("\n");
        if (first && i == first) {
            p[k++] = text(m[0].content);
            p[k++] = text("\n\n");
        }
        p[k++] = trimmed(m[i].content);
        p[k++] = special("<end_of_turn>");
        p[k++] = text("\n");
    }
    if (gen) {
        p[k++] = special("<start_of_turn>");
        p[k++] = text("model\n");
    }
    *np = k;
    return ST_OK;
}

/* Llama 3: <|begin_of_text|> (when bos), then
 * <|start_header_id|>role<|end_header_id|>\n\ntrim(content)
 * <|eot_id|> per message; <|start_header_id|>assistant<|end_header_id|>\n\n. */
static size_t parts_llama3(const struct engine_chat_msg *m, size_t n, int gen, struct chat_part *p,
                           int bos)
{
    size_t k = 0;
    if (bos)
        p[k++] = special("<|begin_of_text|>");
    for (size_t i = 0; i <= n; i++) {
        if (i == n && !gen)
            break;
        p[k++] = special("<|start_header_id|>");
        p[k++] = text(i < n ? m[i].role : "assistant");
        p[k++] = special("<|end_header_id|>");
        p[k++] = text("\n\n");
        if (i == n)
            break;
        p[k++] = trimmed(m[i].content);
        p[k++] = special("<|eot_id|>");
    }
    return k;
}

/* Llama 3.1/3.2/3.3: <|begin_of_text|>, a system turn written always: the knowledge cutoff,
 * the date (the template's own "26 Jul 2024": Llama 3.2's asks strftime_now for today's, which
 * Jinja2 itself does not define; a fixed date keeps a job's prompts the same on every day it
 * runs), then trim(the leading system message) if there is one; the other messages and the
 * generation prompt as Llama 3's. */
static size_t parts_llama31(const struct engine_chat_msg *m, size_t n, int gen, struct chat_part *p)
{
    size_t k = 0;
    const size_t first = strcmp(m[0].role, "system") == 0;
    p[k++] = special("<|begin_of_text|>");
    p[k++] = special("<|start_header_id|>");
    p[k++] = text("system");
    p[k++] = special("<|end_header_id|>");
    p[k++] = text("\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
    if (first)
        p[k++] = trimmed(m[0].content);
    p[k++] = special("<|eot_id|>");
    return k + parts_llama3(m + first, n - first, gen, p + k, 0);
}

/* Llama 2: a leading system message becomes "<<SYS>>\nsystem\n<</SYS>>\n\n" in front of the
 * first turn's content; the others alternate from user; a user turn is "<s>[INST] " +
 * strip(content) + " [/INST]", an assistant turn " " + strip(content) + " </s>", a system
 * message elsewhere nothing; no generation prompt (the template has none). The first turn's
 * joined content is written to scratch (strip applies to all of it). */
static enum status parts_llama2(const struct engine_chat_msg *m, size_t n, struct chat_part *p,
                                char *scratch, size_t *np, struct err_detail *err)
{
    size_t k = 0;
    const size_t first = strcmp(m[0].role, "system") == 0;
    for (size_t i = first; i < n; i++) {
        enum status st = check_alternation("llama2", m, i, first, err);
        if (st != ST_OK)
            return st;
        const char *content = m[i].content;
        if (first && i == first) {
            strcpy(scratch, "<<SYS>>\n");
            strcat(scratch, m[0].content);
            strcat(scratch, "\n<</SYS>>\n\n");
            strcat(scratch, m[i].content);
            content = scratch;
        }
        if (!strcmp(m[i].role, "user")) {
            p[k++] = special("<s>");
            p[k++] = text("[INST] ");
            p[k++] = trimmed(content);
            p[k++] = text(" [/INST]");
        } else if (!strcmp(m[i].role, "assistant")) {
            p[k++] = text(" ");
            p[k++] = trimmed(content);
            p[k++] = text(" ");
            p[k++] = special("</s>");
        }
    }
    *np = k;
    return ST_OK;
}

/* Mistral Instruct v0.1/v0.2: "<s>", then user and assistant turns alternating from user,
 * "[INST] " + content + " [/INST]" and content + "</s>" (no trimming); a system message is an
 * error, as the template raises; no generation prompt (the template has none). */
static enum status parts_mistral(const struct engine_chat_msg *m, size_t n, struct chat_part *p,
                                 size_t *np, struct err_detail *err)
{
    size_t k = 0;
    p[k++] = special("<s>");
    for (size_t i = 0; i < n; i++) {
        enum status st = check_alternation("mistral", m, i, 0, err);
        if (st != ST_OK)
            return st;
        if (!strcmp(m[i].role, "user")) {
            p[k++] = text("[INST] ");
            p[k++] = text(m[i].content);
            p[k++] = text(" [/INST]");
        } else if (!strcmp(m[i].role, "assistant")) {
            p[k++] = text(m[i].content);
            p[k++] = special("</s>");
        } else {
            return err_set(err, ST_ERR_INVALID_ARG,
                           "the mistral chat template takes only user and assistant roles "
                           "(message %zu is %s)",
                           i, m[i].role);
        }
    }
    *np = k;
    return ST_OK;
}

/* Mistral v0.3 (and Nemo's variant, the m3_* choices): "<s>", then user and assistant turns
 * alternating from user after an optional leading system message (checked over all of them
 * first, as the template does); a user turn "[INST] " + content + "[/INST]" ("[INST]" tight),
 * with the system text and a blank line before the content in each user turn equal to the last
 * one (the template compares the messages) or only in the last message (m3_sys_last); an
 * assistant turn " " + trim(content) + "</s>" (m3_raw: content + "</s>"); a system message
 * elsewhere is an error; no generation prompt (the template has none). [INST] and [/INST] are
 * control tokens in v0.3's vocabulary, and the space after [INST] (or before an assistant
 * turn) is the one SentencePiece's prefix writes there, as in Mistral's own tokenizer. */
static enum status parts_mistral3(const struct engine_chat *c, const struct engine_chat_msg *m,
                                  size_t n, struct chat_part *p, size_t *np, struct err_detail *err)
{
    size_t k = 0;
    const size_t first = strcmp(m[0].role, "system") == 0;
    size_t last_user = n;
    for (size_t i = first; i < n; i++) {
        enum status st = check_alternation("mistral-v3", m, i, first, err);
        if (st != ST_OK)
            return st;
        if (!strcmp(m[i].role, "user"))
            last_user = i;
    }
    p[k++] = special("<s>");
    for (size_t i = first; i < n; i++) {
        if (!strcmp(m[i].role, "user")) {
            const int sys = first && (c->m3_sys_last ? i == n - 1
                                                     : !strcmp(m[i].content, m[last_user].content));
            p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[INST]", 6};
            if (!c->m3_tight)
                p[k++] = (struct chat_part){CHAT_PART_PREFIX, " ", 1};
            if (sys) {
                p[k++] = text(m[0].content);
                p[k++] = text("\n\n");
            }
            p[k++] = text(m[i].content);
            p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[/INST]", 7};
        } else if (!strcmp(m[i].role, "assistant")) {
            if (c->m3_raw) {
                p[k++] = text(m[i].content);
            } else {
                p[k++] = (struct chat_part){CHAT_PART_PREFIX, " ", 1};
                p[k++] = trimmed(m[i].content);
            }
            p[k++] = special("</s>");
        } else {
            return err_set(err, ST_ERR_INVALID_ARG,
                           "the mistral-v3 chat template takes only user and assistant roles "
                           "after an optional first system message (message %zu is %s)",
                           i, m[i].role);
        }
    }
    *np = k;
    return ST_OK;
}

/* Mistral Small 3.2's default system prompt (its template's default_system_message), around
 * the date its template writes (strftime_now("%Y-%m-%d")). */
static const char V7_SYS_BEFORE_DATE[] =
    "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French "
    "startup headquartered in Paris.\n"
    "Your knowledge base was last updated on 2023-10-01. The current date is ";
static const char V7_SYS_AFTER_DATE[] =
    ".\n"
    "\n"
    "When you're not sure about some information or when the user's request requires up-to-"
    "date or specific data, you must use the available tools to fetch the information. Do n"
    "ot hesitate to use tools whenever they can provide a more accurate or complete respons"
    "e. If no relevant tools are available, then clearly state that you don't have the info"
    "rmation and avoid making up anything.\n"
    "\n"
    "If the user's question is not clear, ambiguous, or does not provide enough context for"
    " you to accurately answer the question, you do not try to answer it right away and you"
    " rather ask the user to clarify their request (e.g. \"What are some good restaurants a"
    "round me?\" => \"Where are you?\" or \"When is the next flight to Tokyo\" => \"Where d"
    "o you travel from?\").\n"
    "You are always very attentive to dates, and when asked about information at specific d"
    "ates, you discard information that is at another date.\n"
    "You follow these instructions in all languages, and always respond to the user in the "
    "language they use or request.\n"
    "Next sections describe the capabilities that you have.\n"
    "\n"
    "# WEB BROWSING INSTRUCTIONS\n"
    "\n"
    "You cannot perform any web search or access internet to open URLs, links etc. If it se"
    "ems like the user is expecting you to do so, you clarify the situation and ask the use"
    "r to copy paste the text directly in the chat.\n"
    "\n"
    "# MULTI-MODAL INSTRUCTIONS\n"
    "\n"
    "You have the ability to read images, but you cannot generate images. You also cannot t"
    "ranscribe audio files or videos.\n"
    "You cannot read nor transcribe audio files or videos.\n"
    "\n"
    "# TOOL CALLING INSTRUCTIONS\n"
    "\n"
    "You may have access to tools that you can use to fetch information or perform actions."
    " You must use these tools in the following situations:\n"
    "\n"
    "1. When the request requires up-to-date information.\n"
    "2. When the request requires specific data that you do not have in your knowledge base"
    ".\n"
    "3. When the request involves actions that you cannot perform without tools.\n"
    "\n"
    "Always prioritize using tools to provide the most accurate and helpful response. If to"
    "ols are not available, inform the user that you cannot perform the requested action at"
    " the moment.";

/* Mistral Small 3.2 (v7, tekken): <s>[SYSTEM_PROMPT] + the first message's content if it is a
 * system message, else the default system prompt with c's date + [/SYSTEM_PROMPT]; then per
 * message [SYSTEM_PROMPT]content[/SYSTEM_PROMPT] (system), [INST]content[/INST] (user) or
 * content</s> (assistant), turns alternating from user where a later system message counts as
 * an assistant turn (as the template counts them); no generation prompt. */
static enum status parts_mistral7(const struct engine_chat *c, const struct engine_chat_msg *m,
                                  size_t n, struct chat_part *p, size_t *np, struct err_detail *err)
{
    size_t k = 0;
    const size_t first = strcmp(m[0].role, "system") == 0;
    for (size_t i = first; i < n; i++) {
        enum status st = check_alternation("mistral-v7", m, i, first, err);
        if (st != ST_OK)
            return st;
    }
    p[k++] = special("<s>");
    p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[SYSTEM_PROMPT]", 15};
    if (first) {
        p[k++] = text(m[0].content);
    } else {
        p[k++] =
            (struct chat_part){CHAT_PART_TEXT, V7_SYS_BEFORE_DATE, sizeof(V7_SYS_BEFORE_DATE) - 1};
        p[k++] = text(c->today);
        p[k++] =
            (struct chat_part){CHAT_PART_TEXT, V7_SYS_AFTER_DATE, sizeof(V7_SYS_AFTER_DATE) - 1};
    }
    p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[/SYSTEM_PROMPT]", 16};
    for (size_t i = first; i < n; i++) {
        if (!strcmp(m[i].role, "user")) {
            p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[INST]", 6};
            p[k++] = text(m[i].content);
            p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[/INST]", 7};
        } else if (!strcmp(m[i].role, "assistant")) {
            p[k++] = text(m[i].content);
            p[k++] = special("</s>");
        } else {
            p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[SYSTEM_PROMPT]", 15};
            p[k++] = text(m[i].content);
            p[k++] = (struct chat_part){CHAT_PART_CONTROL, "[/SYSTEM_PROMPT]", 16};
        }
    }
    *np = k;
    return ST_OK;
}

/* s[0..n) without leading / trailing '\n' (Python's lstrip('\n') / rstrip('\n')). */
static struct chat_part nl_lstrip(const char *s, size_t n)
{
    while (n && *s == '\n') {
        s++;
        n--;
    }
    return (struct chat_part){CHAT_PART_TEXT, s, n};
}

static struct chat_part nl_rstrip(const char *s, size_t n)
{
    while (n && s[n - 1] == '\n')
        n--;
    return (struct chat_part){CHAT_PART_TEXT, s, n};
}

/* The last occurrence of needle in s[0..n), or NULL. */
static const char *last_of(const char *s, size_t n, const char *needle)
{
    const size_t k = strlen(needle);
    for (size_t i = n >= k ? n - k + 1 : 0; i-- > 0;)
        if (!memcmp(s + i, needle, k))
            return s + i;
    return NULL;
}

/* 1 when the NUL-terminated s starts with a and ends with b. */
static int wrapped(const char *s, const char *a, const char *b)
{
    const size_t n = strlen(s), la = strlen(a), lb = strlen(b);
    return n >= la && n >= lb && !strncmp(s, a, la) && !strcmp(s + n - lb, b);
}

/* Qwen3: ChatML without a default system turn, but an assistant turn after the last user
 * query (the last user message that is not a <tool_response>...</tool_response>) splits its
 * content at </think>: "<think>\n" + the reasoning (what follows the last <think> before the
 * first </think>, '\n' stripped) + "\n</think>\n\n" + the answer (after the last </think>),
 * when it is the last message or has reasoning; other assistant turns keep only the answer;
 * no_thinking (enable_thinking false) adds "<think>\n\n</think>\n\n" after the generation
 * prompt. <think> and </think> are the vocabulary's tokens where it has them. */
static size_t parts_qwen3(const struct engine_chat_msg *m, size_t n, int gen, int no_thinking,
                          struct chat_part *p)
{
    size_t k = 0, last_query = n - 1;
    for (size_t i = n; i-- > 0;)
        if (!strcmp(m[i].role, "user") &&
            !wrapped(m[i].content, "<tool_response>", "</tool_response>")) {
            last_query = i;
            break;
        }
    for (size_t i = 0; i < n; i++) {
        const char *c = m[i].content;
        const size_t len = strlen(c);
        p[k++] = special(CHAT_IM_START);
        p[k++] = text(m[i].role);
        p[k++] = text("\n");
        if (strcmp(m[i].role, "assistant")) {
            p[k++] = text(c);
        } else {
            struct chat_part answer = {CHAT_PART_TEXT, c, len}, reason = {CHAT_PART_TEXT, c, 0};
            const char *first = strstr(c, "</think>");
            if (first) {
                const char *last = last_of(c, len, "</think>") + strlen("</think>");
                answer = nl_lstrip(last, len - (size_t)(last - c));
                const struct chat_part before = nl_rstrip(c, (size_t)(first - c));
                const char *t = last_of(before.s, before.n, "<think>");
                t = t ? t + strlen("<think>") : before.s;
                reason = nl_lstrip(t, before.n - (size_t)(t - before.s));
            }
            if (i > last_query && (i == n - 1 || reason.n)) {
                p[k++] = (struct chat_part){CHAT_PART_CONTROL, "<think>", 7};
                p[k++] = text("\n");
                reason = nl_lstrip(reason.s, reason.n);
                p[k++] = nl_rstrip(reason.s, reason.n);
                p[k++] = text("\n");
                p[k++] = (struct chat_part){CHAT_PART_CONTROL, "</think>", 8};
                p[k++] = text("\n\n");
                answer = nl_lstrip(answer.s, answer.n);
            }
            p[k++] = answer;
        }
        p[k++] = special(CHAT_IM_END);
        p[k++] = text("\n");
    }
    if (gen) {
        p[k++] = special(CHAT_IM_START);
        p[k++] = text("assistant\n");
    }
    if (gen && no_thinking) { /* enable_thinking false: an empty reasoning block */
        p[k++] = (struct chat_part){CHAT_PART_CONTROL, "<think>", 7};
        p[k++] = text("\n\n");
        p[k++] = (struct chat_part){CHAT_PART_CONTROL, "</think>", 8};
        p[k++] = text("\n\n");
    }
    return k;
}

/* DeepSeek R1's distills: BOS, the last system message's content as it is, then
 * "<｜User｜>" + content per user turn and "<｜Assistant｜>" + the answer (what follows the last
 * </think>, where there is one) + "<｜end▁of▁sentence｜>" per assistant turn; generation prompt
 * "<｜Assistant｜><think>\n". */
static size_t parts_deepseek_r1(const struct engine_chat_msg *m, size_t n, int gen,
                                struct chat_part *p)
{
    size_t k = 0;
    p[k++] = special(DS_BOS);
    for (size_t i = n; i-- > 0;)
        if (!strcmp(m[i].role, "system")) {
            p[k++] = text(m[i].content);
            break;
        }
    for (size_t i = 0; i < n; i++) {
        const char *c = m[i].content;
        if (!strcmp(m[i].role, "user")) {
            p[k++] = special(DS_USER);
            p[k++] = text(c);
        } else if (!strcmp(m[i].role, "assistant")) {
            const char *t = last_of(c, strlen(c), "</think>");
            p[k++] = special(DS_ASSISTANT);
            p[k++] = text(t ? t + strlen("</think>") : c);
            p[k++] = special(DS_EOS);
        }
    }
    if (gen) {
        p[k++] = special(DS_ASSISTANT);
        p[k++] = (struct chat_part){CHAT_PART_CONTROL, "<think>", 7};
        p[k++] = text("\n");
    }
    return k;
}

/* Phi-3/3.5: "<|role|>\ncontent<|end|>\n" per message (a system message with empty content
 * is left out), then "<|assistant|>\n" as the generation prompt, else "<|endoftext|>". */
static size_t parts_phi3(const struct engine_chat_msg *m, size_t n, int gen, struct chat_part *p)
{
    static const char *const tag[][2] = {
        {"system", "<|system|>"}, {"user", "<|user|>"}, {"assistant", "<|assistant|>"}};
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t r = 0; r < 3; r++) {
            if (strcmp(m[i].role, tag[r][0]) || (r == 0 && !m[i].content[0]))
                continue;
            p[k++] = special(tag[r][1]);
            p[k++] = text("\n");
            p[k++] = text(m[i].content);
            p[k++] = special("<|end|>");
            p[k++] = text("\n");
        }
    if (gen) {
        p[k++] = special("<|assistant|>");
        p[k++] = text("\n");
    } else {
        p[k++] = special("<|endoftext|>");
    }
    return k;
}

/* Phi-4-mini: "<|role|>content<|end|>" per message, every role alike (tools in a system
 * message, which the template writes after its content, are not offered), then "<|assistant|>"
 * as the generation prompt, else "<|endoftext|>" (its eos_token). */
static size_t parts_phi4_mini(const struct engine_chat_msg *m, size_t n, int gen,
                              struct chat_part *p)
{
    static const char *const tag[][2] = {
        {"system", "<|system|>"}, {"user", "<|user|>"}, {"assistant", "<|assistant|>"}};
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t r = 0; r < 3; r++)
            if (!strcmp(m[i].role, tag[r][0])) {
                p[k++] = special(tag[r][1]);
                p[k++] = text(m[i].content);
                p[k++] = special("<|end|>");
            }
    p[k++] = special(gen ? "<|assistant|>" : "<|endoftext|>");
    return k;
}

/* 1 when the format writes BOS itself (the tokenizer must not add another). */
static int writes_bos(const struct engine_chat *c)
{
    return c->fmt != CHAT_FMT_CHATML && c->fmt != CHAT_FMT_PHI3 && c->fmt != CHAT_FMT_QWEN3 &&
           c->fmt != CHAT_FMT_PHI4 && c->fmt != CHAT_FMT_PHI4_MINI;
}

/* The conversation as parts; *parts is malloc'd (caller frees), pointing into msgs, c and
 * its own tail. */
static enum status chat_parts(const struct engine_chat *c, const struct engine_chat_msg *msgs,
                              size_t n, unsigned flags, struct chat_part **parts, size_t *n_parts,
                              struct err_detail *err)
{
    *parts = NULL;
    *n_parts = 0;
    if (n == 0)
        return err_set(err, ST_ERR_INVALID_ARG, "a chat needs at least one message");
    for (size_t i = 0; i < n; i++) {
        const char *r = msgs[i].role;
        if (!r || !msgs[i].content)
            return err_set(err, ST_ERR_INVALID_ARG, "message %zu has no %s", i,
                           r ? "content" : "role");
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))
            return err_set(err, ST_ERR_INVALID_ARG,
                           "message %zu has role \"%.40s\" (allowed: system, user, assistant)", i,
                           r);
    }
    if (n > SIZE_MAX / (16 * sizeof(struct chat_part)))
        return err_set(err, ST_ERR_INVALID_ARG, "too many messages (%zu)", n);
    /* the parts, then (Llama 2) room for the first turn's content joined with the system's */
    const size_t n_p = 12 * n + 8 + CHAT_MAX_DEFAULT_PARTS; /* qwen3: 12 a message */
    size_t scratch = 0;
    if (c->fmt == CHAT_FMT_LLAMA2 && n > 1)
        scratch = strlen(msgs[0].content) + strlen(msgs[1].content) + 32;
    struct chat_part *p = malloc(n_p * sizeof(*p) + scratch);
    if (!p)
        return err_set(err, ST_ERR_NOMEM, "rendering the chat");
    size_t k = 0;
    enum status st = ST_OK;
    const int gen = (flags & ENGINE_CHAT_GEN_PROMPT) != 0;
    if (c->fmt == CHAT_FMT_GEMMA)
        st = parts_gemma(c, msgs, n, gen, p, &k, err);
    else if (c->fmt == CHAT_FMT_LLAMA3)
        k = parts_llama3(msgs, n, gen, p, 1);
    else if (c->fmt == CHAT_FMT_LLAMA31)
        k = parts_llama31(msgs, n, gen, p);
    else if (c->fmt == CHAT_FMT_MISTRAL3)
        st = parts_mistral3(c, msgs, n, p, &k, err);
    else if (c->fmt == CHAT_FMT_DEEPSEEK_R1)
        k = parts_deepseek_r1(msgs, n, gen, p);
    else if (c->fmt == CHAT_FMT_MISTRAL7)
        st = parts_mistral7(c, msgs, n, p, &k, err);
    else if (c->fmt == CHAT_FMT_PHI4)
        k = parts_phi4(msgs, n, p);
    else if (c->fmt == CHAT_FMT_QWEN3)
        k = parts_qwen3(msgs, n, gen, flags & ENGINE_CHAT_NO_THINKING, p);
    else if (c->fmt == CHAT_FMT_LLAMA2)
        st = parts_llama2(msgs, n, p, (char *)(p + n_p), &k, err);
    else if (c->fmt == CHAT_FMT_MISTRAL)
        st = parts_mistral(msgs, n, p, &k, err);
    else if (c->fmt == CHAT_FMT_PHI3)
        k = parts_phi3(msgs, n, gen, p);
    else if (c->fmt == CHAT_FMT_PHI4_MINI)
        k = parts_phi4_mini(msgs, n, gen, p);
    else
        k = parts_chatml(c, msgs, n, gen, p);
    if (st != ST_OK) {
        free(p);
        return st;
    }
    *parts = p;
    *n_parts = k;
    return ST_OK;
}

enum status engine_chat_render(const struct engine_chat *c, const struct engine_chat_msg *msgs,
                               size_t n, unsigned flags, char **out, size_t *out_len,
                               struct err_detail *err)
{
    *out = NULL;
    *out_len = 0;
    struct chat_part *p;
    size_t np;
    enum status st = chat_parts(c, msgs, n, flags, &p, &np, err);
    if (st != ST_OK)
        return st;
    size_t total = 1;
    for (size_t i = 0; i < np; i++)
        total += p[i].n;
    char *s = malloc(total);
    if (!s) {
        free(p);
        return err_set(err, ST_ERR_NOMEM, "rendering the chat (%zu bytes)", total);
    }
    size_t o = 0;
    for (size_t i = 0; i < np; i++) {
        memcpy(s + o, p[i].s, p[i].n);
        o += p[i].n;
    }
    s[o] = 0;
    free(p);
    *out = s;
    *out_len = o;
    return ST_OK;
}

/* Growing id array for engine_chat_tokenize. */
struct chat_ids {
    int32_t *v;    /* ids */
    size_t n, cap; /* count and capacity */
};

static enum status ids_append(struct chat_ids *a, const int32_t *ids, size_t n,
                              struct err_detail *err)
{
    if (a->n + n > a->cap) {
        size_t cap = a->cap ? a->cap : 256;
        while (cap < a->n + n)
            cap *= 2;
        int32_t *v = realloc(a->v, cap * sizeof(*v));
        if (!v)
            return err_set(err, ST_ERR_NOMEM, "growing the prompt token buffer");
        a->v = v;
        a->cap = cap;
    }
    if (n)
        memcpy(a->v + a->n, ids, n * sizeof(*ids));
    a->n += n;
    return ST_OK;
}

/* Tokenize text (plain unless flags say otherwise) and append the ids. */
static enum status ids_encode(struct chat_ids *a, const struct engine_tok *t, const char *s,
                              size_t n, unsigned flags, struct err_detail *err)
{
    int32_t *ids;
    size_t n_ids;
    enum status st = engine_tok_encode(t, s, n, flags, &ids, &n_ids, err);
    if (st != ST_OK)
        return st;
    st = ids_append(a, ids, n_ids, err);
    free(ids);
    return st;
}

enum status engine_chat_tokenize(const struct engine_chat *c, const struct engine_tok *t,
                                 const struct engine_chat_msg *msgs, size_t n, unsigned flags,
                                 int allow_special_in_content, int32_t **ids, size_t *n_ids,
                                 struct err_detail *err)
{
    *ids = NULL;
    *n_ids = 0;
    struct chat_part *p;
    size_t np;
    enum status st = chat_parts(c, msgs, n, flags, &p, &np, err);
    if (st != ST_OK)
        return st;

    /* [INST]-like parts: special tokens where the vocabulary has them; the space after one
     * only where the tokenizer does not write it itself */
    for (size_t i = 0; i < np; i++)
        if (p[i].kind == CHAT_PART_CONTROL)
            p[i].kind = engine_tok_find_special(t, p[i].s, p[i].n) >= 0 ? CHAT_PART_SPECIAL
                                                                        : CHAT_PART_TEXT;
        else if (p[i].kind == CHAT_PART_PREFIX) {
            if (i > 0 && p[i - 1].kind == CHAT_PART_SPECIAL && engine_tok_space_prefix(t))
                p[i].n = 0;
            p[i].kind = CHAT_PART_TEXT;
        }
    struct chat_ids a = {0};
    unsigned tflags = allow_special_in_content ? ENGINE_TOK_PARSE_SPECIAL : 0;
    char *buf = NULL;
    size_t cap = 0;
    /* BOS, if the model wants one and the template does not write it: encoding nothing with
     * ADD_BOS yields just that. */
    if (!writes_bos(c))
        st = ids_encode(&a, t, "", 0, ENGINE_TOK_ADD_BOS, err);
    for (size_t i = 0; i < np && st == ST_OK;) {
        if (p[i].kind != CHAT_PART_TEXT) {
            int32_t id = engine_tok_find(t, p[i].s, p[i].n);
            st = id >= 0 ? ids_append(&a, &id, 1, err)
                         : err_set(err, ST_ERR_UNSUPPORTED,
                                   "the %s chat template needs the token %.*s; the vocabulary "
                                   "lacks it",
                                   g_fmts[c->fmt].name, (int)p[i].n, p[i].s);
            i++;
            continue;
        }
        /* Join the run of text parts up to the next special token into one piece. */
        size_t j = i, len = 0;
        for (; j < np && p[j].kind == CHAT_PART_TEXT; j++)
            len += p[j].n;
        if (len == 0) {
            i = j;
            continue;
        }
        if (len > cap) {
            free(buf);
            cap = len;
            if (!(buf = malloc(cap))) {
                st = err_set(err, ST_ERR_NOMEM, "joining prompt text");
                break;
            }
        }
        size_t o = 0;
        for (; i < j; i++) {
            memcpy(buf + o, p[i].s, p[i].n);
            o += p[i].n;
        }
        st = ids_encode(&a, t, buf, len, tflags, err);
    }
    free(buf);
    free(p);
    if (st != ST_OK) {
        free(a.v);
        return st;
    }
    if (!a.v && !(a.v = malloc(sizeof(*a.v))))
        return err_set(err, ST_ERR_NOMEM, "allocating prompt tokens");
    *ids = a.v;
    *n_ids = a.n;
    return ST_OK;
}

char *engine_chat_published(const char *name, size_t i)
{
    static const struct {
        const char *name;
        const char *const *const *pub;
    } f[] = {{"llama31", g_pub_llama31},       {"mistral-v3", g_pub_mistral_v3},
             {"qwen3", g_pub_qwen3},           {"deepseek-r1", g_pub_deepseek_r1},
             {"mistral-v7", g_pub_mistral_v7}, {"phi4", g_pub_phi4},
             {"phi4-mini", g_pub_phi4_mini}};
    for (size_t k = 0; k < sizeof(f) / sizeof(f[0]); k++) {
        if (strcmp(name, f[k].name))
            continue;
        for (size_t t = 0; t < i; t++)
            if (!f[k].pub[t])
                return NULL;
        return f[k].pub[i] ? join_lines(f[k].pub[i]) : NULL;
    }
    return NULL;
}
