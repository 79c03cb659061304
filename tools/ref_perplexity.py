#!/usr/bin/env python3
"""Reference perplexity (NOT run by CI): quern perplexity's windows scored by the independent
float64 forward pass of tools/ref_forward.py (KV rounded to f16 as quern stores it), the text
tokenized by the HF tokenizers reference (tools/ref_tokenizer.py). Writes
tests/fixtures/perplexity_ref.json, which tests/e2e/perplexity.sh compares quern against
(relative 1e-4 in exact mode).

Windows (as runner/cmd_perplexity.c): stride 0 = llama.cpp's method: tokens cut into
non-overlapping windows of ctx, the first token of each replaced by BOS when the model adds
one, targets ctx/2+1 .. ctx-1 scored by the logits before them; stride S: the first window
[0, ctx) scores 1..ctx-1, window w >= 1 scores [a, b) = [ctx + (w-1)S, min(a + S, N)) within
[b - ctx, b).

  python3 tools/ref_perplexity.py [--model M] [--text F] [--ctx 128] [--stride 0 96 ...]
      [--ids IDS.json --out F]

--ids: the text's token ids (a JSON array, without BOS: `quern tokenize --model M < F`) for a
model whose tokenizer the HF reference here does not build (SentencePiece: Gemma; quern's
ids for it are checked against llama.cpp's by tests/test_tokenizer_families.c).
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402
import ref_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def windows(ids, ctx, stride, bos):
    n = len(ids)
    out = []
    if stride == 0:
        for w in range(n // ctx):
            t = list(ids[w * ctx:(w + 1) * ctx])
            if bos is not None:
                t[0] = bos
            out.append((t, ctx // 2 + 1))
    else:
        out.append((list(ids[:ctx]), 1))
        a = ctx
        while a < n:
            b = min(a + stride, n)
            t = list(ids[b - ctx:b])
            if bos is not None:
                t[0] = bos
            out.append((t, ctx - (b - a)))
            a = b
    return out


def nll_of(m, toks, frm):
    L = m.forward(toks, m.new_cache())  # (T, V) float64
    res = []
    for p in range(frm - 1, len(toks) - 1):
        row = L[p]
        mx = row.max()
        res.append(float(np.log(np.exp(row - mx).sum()) + mx - row[toks[p + 1]]))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=ref_forward.DEFAULT_MODEL)
    ap.add_argument("--text", default=os.path.join(ROOT, "tests", "fixtures", "perplexity_text.txt"))
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--stride", type=int, nargs="+", default=[0, 96])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "perplexity_ref.json"))
    ap.add_argument("--ids", help="the text's token ids (JSON array, no BOS) instead of the HF tokenizer")
    args = ap.parse_args()
    m = ref_forward.Model(args.model)
    m.kv_f16 = True
    import gguf
    f = gguf.GGUFReader(args.model).fields
    add_bos = "tokenizer.ggml.add_bos_token" in f and bool(f["tokenizer.ggml.add_bos_token"].contents())
    bos = int(f["tokenizer.ggml.bos_token_id"].contents()) if add_bos else None
    text = open(args.text, "rb").read()
    if args.ids:
        ids = [int(t) for t in json.load(open(args.ids))]
    else:
        ids = ref_tokenizer.HFRef(ref_tokenizer.gguf_tokenizer_meta(args.model)).encode(
            text.decode("utf-8"))
    if add_bos:
        ids = [bos] + ids
    runs = []
    for stride in args.stride:
        t0 = time.time()
        nll = []
        wins = windows(ids, args.ctx, stride, bos)
        for toks, frm in wins:
            nll += nll_of(m, toks, frm)
        mean = float(np.mean(nll))
        runs.append({"ctx": args.ctx, "stride": stride, "windows": len(wins),
                     "tokens_scored": len(nll), "mean_nll": mean, "perplexity": float(np.exp(mean)),
                     "nll": nll})
        print("ctx %d stride %d: %d windows, %d tokens scored, ppl %.6f (%.1fs)"
              % (args.ctx, stride, len(wins), len(nll), np.exp(mean), time.time() - t0))
    out = {"model_sha256": ref_forward.sha256(args.model),
           "text": os.path.relpath(args.text, ROOT),
           "text_sha256": hashlib.sha256(text).hexdigest(),
           "text_tokens": len(ids), "add_bos": add_bos,
           "precision": "float64 compute, KV rounded to f16, weights dequantized by gguf-py",
           "runs": runs}
    with open(args.out, "w") as fo:
        json.dump(out, fo, indent=1)
        fo.write("\n")


if __name__ == "__main__":
    main()
