/* Byte-level BPE tokenizer, queries and decoding: vocabulary facts, end-of-generation ids, token
 * lookup by text, token pieces, and the streaming decoder that emits only whole UTF-8
 * characters. */
#include "engine/tokenizer_internal.h"

#include <string.h>

#include "common/utf8.h"

int32_t engine_tok_n_vocab(const struct engine_tok *t)
{
    return t->n_vocab;
}

int32_t engine_tok_bos(const struct engine_tok *t)
{
    return t->bos;
}

int32_t engine_tok_eos(const struct engine_tok *t)
{
    return t->eos;
}

int engine_tok_is_eog(const struct engine_tok *t, int32_t id)
{
    for (size_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return 1;
    return 0;
}

int32_t engine_tok_find(const struct engine_tok *t, const char *text, size_t len)
{
    int32_t id = engine_tok_text_map_find(t, text, len, 1);
    if (id < 0)
        id = engine_tok_text_map_find(t, text, len, 0);
    if (id < 0 && len == 1) /* a byte-fallback token (SentencePiece) */
        id = t->byte_id[(unsigned char)text[0]];
    return id;
}

int32_t engine_tok_find_special(const struct engine_tok *t, const char *text, size_t len)
{
    return engine_tok_text_map_find(t, text, len, 0);
}

int engine_tok_space_prefix(const struct engine_tok *t)
{
    return t->spm && t->spm_space_prefix;
}

/* Bytes of token id as decoding emits them; *len 0 for hidden or out-of-range tokens. */
static const char *piece_of(const struct engine_tok *t, int32_t id, int include_special,
                            size_t *len)
{
    *len = 0;
    if (id < 0 || id >= t->n_vocab)
        return "";
    enum tok_kind k = t->kind[id];
    if (k == TOK_KIND_UNUSED || (k == TOK_KIND_CONTROL && !include_special))
        return "";
    *len = engine_tok_text_len(t, id);
    return engine_tok_text(t, id);
}

size_t engine_tok_piece(const struct engine_tok *t, int32_t id, int include_special, char *buf,
                        size_t cap)
{
    size_t n;
    const char *p = piece_of(t, id, include_special, &n);
    if (n && cap)
        memcpy(buf, p, n < cap ? n : cap);
    return n;
}

size_t engine_tok_max_piece(const struct engine_tok *t)
{
    return t->max_piece;
}

/* Run the UTF-8 holdback over a[0..na) ++ b[0..nb). Writes output to out when non-NULL and
 * the held tail to pend/n_pend; returns the output length. */
static size_t stream_run(const unsigned char *a, size_t na, const unsigned char *b, size_t nb,
                         char *out, unsigned char *pend, int *n_pend)
{
    size_t total = na + nb, o = 0;
    *n_pend = 0;
    for (size_t i = 0; i < total;) {
        unsigned char q[4];
        size_t avail = total - i < 4 ? total - i : 4;
        for (size_t j = 0; j < avail; j++)
            q[j] = i + j < na ? a[i + j] : b[i + j - na];
        size_t l = utf8_decode(q, avail, NULL, NULL);
        if (l) {
            if (out)
                memcpy(out + o, q, l);
            o += l;
            i += l;
            continue;
        }
        /* Invalid here, but perhaps only because the sequence is cut off: hold it back. */
        if (utf8_is_prefix(q, avail)) {
            memcpy(pend, q, avail);
            *n_pend = (int)avail;
            break;
        }
        if (out) /* one U+FFFD for the maximal subpart */
            memcpy(out + o, "\xEF\xBF\xBD", 3);
        o += 3;
        i += utf8_bad_len(q, avail);
    }
    return o;
}

size_t engine_tok_stream_push(const struct engine_tok *t, struct engine_tok_stream *s, int32_t id,
                              char *out, size_t cap)
{
    size_t n;
    const char *p = piece_of(t, id, 0, &n);
    unsigned char pend[8];
    int n_pend;
    size_t need =
        stream_run(s->pend, (size_t)s->n_pend, (const unsigned char *)p, n, NULL, pend, &n_pend);
    if (need > cap)
        return need;
    stream_run(s->pend, (size_t)s->n_pend, (const unsigned char *)p, n, out, pend, &n_pend);
    memcpy(s->pend, pend, sizeof(pend));
    s->n_pend = n_pend;
    return need;
}

size_t engine_tok_stream_flush(struct engine_tok_stream *s, char *out, size_t cap)
{
    size_t need = s->n_pend ? 3 : 0; /* the held bytes are one maximal subpart: one U+FFFD */
    if (need > cap)
        return need;
    if (need)
        memcpy(out, "\xEF\xBF\xBD", 3);
    s->n_pend = 0;
    return need;
}
