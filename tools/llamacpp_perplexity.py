#!/usr/bin/env python3
"""llama.cpp's perplexity on a text (NOT run by CI), for comparison with `quern perplexity`:
llama-perplexity's method (non-overlapping windows of --ctx tokens of llama.cpp's own
tokenization, the first token of each replaced by BOS when the model adds one, each window's
second half scored), evaluated through llama-cpp-python's bundled llama.cpp (tools/
requirements-ref.txt), all logits of a window at once, -log softmax in float64. Prints one JSON
object like `quern perplexity --json`'s.

  python3 tools/llamacpp_perplexity.py --file build/eval/licenses.txt [--ctx 512] [--threads N]
"""
import argparse
import json
import os
import time

import numpy as np
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--file", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    llm = Llama(model_path=args.model, n_ctx=args.ctx, n_batch=args.ctx, n_threads=args.threads,
                logits_all=True, verbose=False)
    text = open(args.file, "rb").read()
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    ids = llm.tokenize(text, add_bos=add_bos, special=False)
    bos = llm.token_bos()
    ctx = args.ctx
    first = ctx // 2
    nll = []
    t0 = time.time()
    for w in range(len(ids) // ctx):
        toks = ids[w * ctx:(w + 1) * ctx]
        if add_bos:
            toks[0] = bos
        llm.reset()
        llm.eval(toks)
        L = np.asarray(llm.scores[:ctx], dtype=np.float64)
        for p in range(first, ctx - 1):
            row = L[p]
            mx = row.max()
            nll.append(float(np.log(np.exp(row - mx).sum()) + mx - row[toks[p + 1]]))
    secs = time.time() - t0
    nll = np.asarray(nll)
    mean = float(nll.mean())
    se = float(np.sqrt(nll.var() / (len(nll) - 1)))
    print(json.dumps({"file": args.file, "model": args.model, "backend": "llama.cpp (llama-cpp-python)",
                      "method": "llama.cpp", "ctx": ctx, "text_tokens": len(ids),
                      "windows": len(ids) // ctx, "tokens_scored": len(nll), "mean_nll": mean,
                      "nll_stderr": se, "perplexity": float(np.exp(mean)),
                      "perplexity_stderr": float(np.exp(mean) * se), "seconds": round(secs, 3)}))


if __name__ == "__main__":
    main()
