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
  tests/fixtures/pretok_ref.jsonl         the llama-bpe (Llama 3) and qwen2 pre-tokenizer
                                          regexes run by Python's `regex` module over those
                                          strings: the pieces, as hex

Usage: python3 tools/ref_tokenizer_families.py [--gemma PATH]
(needs numpy, gguf, llama-cpp-python and regex: tools/requirements-ref.txt)"""
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", default=os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))
    a = ap.parse_args()
    pretok()
    gemma(a.gemma)


if __name__ == "__main__":
    main()
