#!/usr/bin/env python3
"""Reference log-probabilities (NOT run by CI): greedy continuations of a few completion prompts
by the independent float64 forward pass of tools/ref_forward.py (KV rounded to f16 as quern
stores it), the prompts tokenized by the HF tokenizers reference (tools/ref_tokenizer.py), BOS
first when the model adds one. For every generated token: its text, its log-softmax under the
model's logits at that position, the top 5 (id, text, log-softmax) in descending order, and the margin
between the best two logits (how safely greedy decides). Writes tests/fixtures/logprobs_ref.json,
which tests/e2e/logprobs.sh compares `quern run --matmul exact` records against.

  python3 tools/ref_logprobs.py [--model M] [--n 12] [--out F]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402
import ref_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
]


def log_softmax(row):
    mx = row.max()
    return row - (np.log(np.exp(row - mx).sum()) + mx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=ref_forward.DEFAULT_MODEL)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "logprobs_ref.json"))
    args = ap.parse_args()
    m = ref_forward.Model(args.model)
    m.kv_f16 = True
    meta = ref_tokenizer.gguf_tokenizer_meta(args.model)
    hf = ref_tokenizer.HFRef(meta)
    import gguf
    f = gguf.GGUFReader(args.model).fields
    add_bos = "tokenizer.ggml.add_bos_token" in f and bool(f["tokenizer.ggml.add_bos_token"].contents())
    bos = int(f["tokenizer.ggml.bos_token_id"].contents())
    eos = int(f["tokenizer.ggml.eos_token_id"].contents())
    out = []
    for text in PROMPTS:
        ids = ([bos] if add_bos else []) + hf.encode(text)
        cache = m.new_cache()
        row = m.forward(ids, cache)[-1]
        toks = []
        for _ in range(args.n):
            lp = log_softmax(row)
            order = np.argsort(-row, kind="stable")
            t = int(order[0])
            if t == eos:
                break
            toks.append({"id": t, "text": hf.tok.decode([t]), "logprob": float(lp[t]),
                         "top": [[int(i), hf.tok.decode([int(i)]), float(lp[i])]
                                 for i in order[:5]],
                         "margin": float(row[order[0]] - row[order[1]])})
            row = m.forward([t], cache)[-1]
        out.append({"prompt": text, "prompt_ids": ids, "tokens": toks})
        print("%r: %d tokens, min margin %.4f" % (text, len(toks), min(x["margin"] for x in toks)))
    res = {"model_sha256": ref_forward.sha256(args.model),
           "precision": "float64 compute, KV rounded to f16, weights dequantized by gguf-py",
           "logprobs": "log-softmax of the raw logits (no temperature, penalties or truncation)",
           "prompts": out}
    with open(args.out, "w") as fo:
        json.dump(res, fo, indent=1)
        fo.write("\n")


if __name__ == "__main__":
    main()
