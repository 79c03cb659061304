#!/usr/bin/env python3
"""Reference fixtures for the tokenizers beyond SmolLM2's (NOT run by CI; outputs committed):

  tests/fixtures/tokenizer_gemma3.jsonl   Gemma 3's SentencePiece vocabulary: token ids from
                                          llama.cpp (llama-cpp-python, vocab only) for the
                                          same >1,000 generated strings as tokenizer_ref.jsonl
                                          (whitespace runs, CJK, emoji, code, random unicode)
                                          plus whitespace/special-token cases; the lines
                                          holding "</s>" (Gemma's user-defined HTML tag 212,
                                          which llama.cpp turns into an end-of-generation
                                          control token) carry Hugging Face `tokenizers`' ids
                                          instead (built from the GGUF's vocabulary, 2026-12-06):
                                          quern follows HF and vLLM there
  tests/fixtures/tekken_vocab.gguf.zst    Mistral's tekken vocabulary (Nemo's, from mistral_common)
                                          as a byte-level BPE GGUF (see tekken()), and
  tests/fixtures/tokenizer_tekken.jsonl   mistral_common's Tekkenizer ids for those strings
  tests/fixtures/pretok_ref.jsonl         the llama-bpe (Llama 3), qwen2 and gpt-4o (o200k)
                                          pre-tokenizer regexes run by Python's `regex` module
                                          over those strings: the pieces, as hex

Usage: python3 tools/ref_tokenizer_families.py [--gemma PATH] [--only pretok|gemma|tekken]
(needs numpy, gguf, llama-cpp-python, regex and mistral_common: tools/requirements-ref.txt;
the zstd command)"""
import argparse
import json
import os
import sys
import unicodedata

import regex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")

# llama.cpp's regexes for these pre-tokenizer names (llama-vocab.cpp), \s and \S as written
PRETOK = {
    "llama-bpe": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # o200k's (Phi-4-mini and other GPT-4o-vocabulary GGUFs name it "gpt-4o"), as tiktoken's
    # tiktoken_ext/openai_public.py o200k_base() joins it
    "gpt-4o": "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]),
}

EXTRA = [
    "I'M HERE", "they'LL", "HelloWorld's", "CamelCaseID's", "x'S", "3'rd 12345678", "a/\n/b",
    "", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", " \n ", "a  b", "a   b",
    "  leading", "trailing  ", "x\t\ty", "<b>bold</b> and <i>it</i>", "<table><tr><td>1</td></tr>",
    "▁already▁escaped", "a▁b c", "1234567890", "3.14159", "I'm", "DON'T", "we'RE",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
]


def strings():
    out = ref_tokenizer.gen_strings() + EXTRA
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


def gemma(path):
    from llama_cpp import Llama
    ll = Llama(model_path=path, vocab_only=True, verbose=False)
    lines = []
    for s in strings():
        ids = ll.tokenize(s.encode("utf-8"), add_bos=False, special=False)
        lines.append({"hex": s.encode("utf-8").hex(), "ids": ids})
    special = ["<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
               "<bos><start_of_turn>user\nHi<end_of_turn>", "text<end_of_turn>", "<eos>",
               " <start_of_turn> x", "<start_of_turn", "no specials here"]
    for s in special:
        ids = ll.tokenize(s.encode("utf-8"), add_bos=False, special=True)
        lines.append({"hex": s.encode("utf-8").hex(), "special": True, "ids": ids})
    p = os.path.join(FIX, "tokenizer_gemma3.jsonl")
    with open(p, "w") as f:
        for l in lines:
            f.write(json.dumps(l, separators=(",", ":")) + "\n")
    print("wrote %s: %d lines" % (p, len(lines)))


def assigned(s):
    """No code point unassigned in Python's Unicode tables (14.0 in Python 3.11, as PCRE2 10.42):
    `regex` and PCRE2 may classify later additions differently."""
    return all(unicodedata.category(c) != "Cn" for c in s)


def pretok():
    p = os.path.join(FIX, "pretok_ref.jsonl")
    n = 0
    with open(p, "w") as f:
        for s in filter(assigned, strings()):
            rec = {"hex": s.encode("utf-8").hex()}
            for name, rx in PRETOK.items():
                rec[name] = [m.encode("utf-8").hex() for m in regex.findall(rx, s)]
                assert "".join(regex.findall(rx, s)) == s
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    print("wrote %s: %d strings x %d pre-tokenizers" % (p, n, len(PRETOK)))


def gpt2_byte_chars():
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies store)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tekken(out_vocab, out_ids):
    """Mistral's tekken tokenizer (Nemo's, mistral_common's tekken_240718.json) as a byte-level
    BPE GGUF the way llama.cpp's converter writes one (gguf-py MistralVocab): the 1,000 special
    tokens first (control), then the tiktoken ranks' byte strings through GPT-2's byte table,
    merges derived from the ranks (every split of a token into two tokens, ordered by the
    token's rank, as Hugging Face's TikTokenConverter); pre-tokenizer "tekken". The ids are
    mistral_common's Tekkenizer.encode over the same strings."""
    import gguf
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240718.json")
    tk = Tekkenizer.from_file(path)
    nsp = tk.num_special_tokens
    bt = gpt2_byte_chars()
    ranks = tk._tekken_token2id_nospecial  # bytes -> rank, the tiktoken table
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    assert [r for _, r in by_rank] == list(range(len(by_rank)))
    enc = lambda b: "".join(bt[x] for x in b)
    toks = [tk.id_to_piece(i) for i in range(nsp)] + [enc(b) for b, _ in by_rank]
    types = [3] * nsp + [1] * len(by_rank)
    merges = []
    for b, r in by_rank:
        local = []
        for i in range(1, len(b)):
            l, rr = b[:i], b[i:]
            if l in ranks and rr in ranks:
                local.append((ranks[l], ranks[rr], l, rr))
        local.sort()
        merges += [enc(l) + " " + enc(rr) for _, _, l, rr in local]
    w = gguf.GGUFWriter(out_vocab, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("tekken")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tk.bos_id)
    w.add_eos_token_id(tk.eos_id)
    w.add_unk_token_id(tk.unk_id)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = 0
    with open(out_ids, "w") as f:
        for s in filter(assigned, strings()):
            ids = tk.encode(s, bos=False, eos=False)
            f.write(json.dumps({"hex": s.encode("utf-8").hex(), "ids": ids},
                               separators=(",", ":")) + "\n")
            n += 1
    print("wrote %s (%d tokens, %d merges) and %s: %d lines" % (out_vocab, len(toks), len(merges),
                                                               out_ids, n))


# llama.cpp's vocabulary-only GGUFs of Llama 3 and Qwen2 (models/ggml-vocab-*.gguf in its source,
# as llama-cpp-python's sdist vendors it) and Hugging Face's regexes for them
HF_PRE = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def hf_bpe(path, pre):
    """Hugging Face `tokenizers` tokenizers built from a byte-level BPE GGUF as the models'
    tokenizer.json define theirs (Split by the regex, ByteLevel, BPE; Llama 3's ignore_merges),
    checked here against the ids Hugging Face's own tokenizer gave for llama.cpp's test strings
    (the GGUF's .inp/.out files): (plain, with the control tokens as special added tokens —
    what a rendered chat prompt is tokenized with; quern reads them in plain text only when
    asked), and the test strings."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    r = gguf.GGUFReader(path)
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in r.fields["tokenizer.ggml.merges"].contents()]
    out = []
    for special in (0, 1):
        tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges,
                                  ignore_merges=(pre == "llama-bpe")))
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(HF_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if special:
            tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                   for t, ty in zip(toks, types) if ty == 3])
        out.append(tk)
    inp = open(path + ".inp").read().split("\n__ggml_vocab_test__\n")
    ref = open(path + ".out").read().split("\n")
    for s, o in zip(inp, ref):
        for tk in out:
            got = tk.encode(s, add_special_tokens=False).ids
            assert got == [int(x) for x in o.split()], (path, s, got, o)
    return out[0], out[1], inp


def bpe_vocabs(src):
    """tests/fixtures/vocab_{llama_bpe,qwen2}.gguf.zst (llama.cpp's files, compressed) and
    tests/fixtures/tokenizer_bpe_ref.jsonl: Hugging Face's ids over both vocabularies for the
    strings of tokenizer_ref.jsonl and llama.cpp's test strings ("text" lines), and for the
    Llama 3.1/3.2 and Qwen3/ChatML renderings of chat_templates_ref.jsonl with their special
    tokens ("chat" lines: the conversation, and ids where that vocabulary has the template's
    tokens)."""
    import subprocess
    lines = []
    tks, tks_special = {}, {}
    extra = []
    for pre, fix in (("llama-bpe", "vocab_llama_bpe"), ("qwen2", "vocab_qwen2")):
        path = os.path.join(src, "ggml-vocab-%s.gguf" % pre)
        tks[pre], tks_special[pre], inp = hf_bpe(path, pre)
        extra += inp
        subprocess.run(["zstd", "-19", "-q", "-f", path, "-o",
                        os.path.join(FIX, fix + ".gguf.zst")], check=True)
    seen = set()
    for s in strings() + extra:
        if s in seen or not assigned(s):
            continue
        seen.add(s)
        rec = {"hex": s.encode("utf-8").hex()}
        for pre, tk in tks.items():
            rec[pre] = tk.encode(s, add_special_tokens=False).ids
        lines.append(rec)
    n_text = len(lines)
    with open(os.path.join(FIX, "chat_templates_ref.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            name = {"llama31": "llama-bpe", "llama32": "llama-bpe", "llama3": "llama-bpe",
                    "qwen3": "qwen2", "chatml": "qwen2"}.get(r["template"])
            if not name or "text" not in r:
                continue
            rec = {k: r[k] for k in ("template", "source_file", "source", "messages",
                                     "add_generation_prompt", "enable_thinking", "text")
                   if k in r}
            rec["vocab"] = name
            rec["ids"] = tks_special[name].encode(r["text"], add_special_tokens=False).ids
            lines.append(rec)
    p = os.path.join(FIX, "tokenizer_bpe_ref.jsonl")
    with open(p, "w") as f:
        for l in lines:
            f.write(json.dumps(l, ensure_ascii=False, separators=(",", ":")) + "\n")
    print("wrote %s: %d strings, %d chat renderings" % (p, n_text, len(lines) - n_text))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", default=os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--only", choices=["pretok", "gemma", "tekken", "bpe"])
    ap.add_argument("--llama-models", help="llama.cpp's models/ directory (the ggml-vocab-*.gguf "
                    "files and their .inp/.out; llama-cpp-python's sdist has it under vendor/)")
    a = ap.parse_args()
    if a.only in (None, "pretok"):
        pretok()
    if a.only in (None, "gemma"):
        gemma(a.gemma)
    if a.only in (None, "bpe"):
        bpe_vocabs(a.llama_models)
    if a.only in (None, "tekken"):
        import subprocess
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            g = os.path.join(d, "tekken_vocab.gguf")
            tekken(g, os.path.join(FIX, "tokenizer_tekken.jsonl"))
            # 7.9 MB as written, 1.7 MB compressed (the test decompresses it with libzstd)
            subprocess.run(["zstd", "-19", "-q", "-f", g, "-o",
                            os.path.join(FIX, "tekken_vocab.gguf.zst")], check=True)


if __name__ == "__main__":
    main()
