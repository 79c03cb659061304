#!/usr/bin/env python3
"""Reference logits of the real Gemma 3 270M (NOT run by CI; output committed):
tests/fixtures/forward_gemma3.json, from tools/ref_forward.py's float64 Model (KV rounded to
f16 as quern stores it): for each prompt (ids from llama.cpp's tokenizer, with BOS) the top 16
logits and 64 probe ids at every position, and 16 greedy tokens with their top-2 margins. One
prompt is 600 tokens long, so the sliding-window layers (512 positions) drop keys.
With --check-llama the reference is first compared with llama.cpp on an F32 copy of the model
(exact weights, F32 KV) at every position of that long prompt.

Usage: python3 tools/ref_gemma.py [--model models/gemma-3-270m-q4_k_m.gguf] [--check-llama]"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def forward_chunked(m, toks, cache, rec, chunk=64):
    """Logits of every position, in chunks (262k-token vocabulary); rec(position logits)."""
    last = None
    for i in range(0, len(toks), chunk):
        L = m.forward(toks[i:i + chunk], cache)
        for row in L:
            rec(row)
        last = L[-1]
    return last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "forward_gemma3.json"))
    ap.add_argument("--check-llama", action="store_true")
    a = ap.parse_args()
    from llama_cpp import Llama
    voc = Llama(model_path=a.model, vocab_only=True, verbose=False)
    tok = lambda s: voc.tokenize(s.encode(), add_bos=True, special=True)
    text = open(os.path.join(ROOT, "tests", "fixtures", "perplexity_text.txt")).read()
    long_ids = tok(text + "\n\n" + text)[:600]
    assert len(long_ids) == 600
    prompts = [
        ("short", tok("The capital of France is")),
        ("chat", tok("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                     "<start_of_turn>model\n")),
        ("code", tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")),
        ("unicode", tok("Le café est très bon. 東京は日本の首都です。 The Japanese word for cat is")),
        ("long", long_ids),
    ]
    m = ref_forward.Model(a.model)
    if a.check_llama:
        m.kv_f16 = False
        ref32 = ref_forward.make_llama_checks(a.model, n_ctx=1024)[0][1]
        ref32.reset()
        ref32.eval(long_ids)
        ll = np.array(ref32.scores[:len(long_ids)], dtype=np.float64)
        rows = []
        forward_chunked(m, long_ids, m.new_cache(), rows.append)
        d = np.abs(np.array(rows) - ll)
        print("vs llama.cpp (F32 weights, F32 KV), 600 positions: max |dlogit| %.5f (positions "
              "< 512: %.5f, >= 512: %.5f), argmax agree %.4f"
              % (d.max(), d[:512].max(), d[512:].max(),
                 np.mean(np.argmax(rows, 1) == np.argmax(ll, 1))))
        del rows, ll, d
    m.kv_f16 = True
    rng = np.random.default_rng(7)
    probe = sorted(int(i) for i in rng.choice(m.n_vocab, 64, replace=False))
    out = {"model_sha256": ref_forward.sha256(a.model), "kv_dtype": "f16", "config": m.meta,
           "probe_ids": probe, "prompts": []}
    for name, toks in prompts:
        t0 = time.time()
        cache = m.new_cache()
        pos = []
        last = forward_chunked(m, toks, cache, lambda l: pos.append(ref_forward.position_record(l, probe)))
        g, gm = ref_forward.greedy(m, toks, 16, cache=cache, first_logits=last)
        out["prompts"].append({"name": name, "tokens": [int(t) for t in toks], "positions": pos,
                               "greedy": g, "greedy_margins": gm})
        print("%-8s n=%3d %.1fs greedy %r" % (name, len(toks), time.time() - t0,
                                             voc.detokenize(g).decode(errors="replace")))
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print("wrote %s (%d bytes)" % (a.out, os.path.getsize(a.out)))


if __name__ == "__main__":
    main()
