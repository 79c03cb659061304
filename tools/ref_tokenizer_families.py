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
  tests/fixtures/pretok_ref.jsonl         the llama-bpe (Llama 3) and qwen2 pre-tokenizer
                                          regexes run by Python's `regex` module over those
                                          strings: the pieces, as hex

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
}

EXTRA = [
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", default=os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--only", choices=["pretok", "gemma", "tekken"])
    a = ap.parse_args()
    if a.only in (None, "pretok"):
        pretok()
    if a.only in (None, "gemma"):
        gemma(a.gemma)
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
