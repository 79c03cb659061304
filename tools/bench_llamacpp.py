#!/usr/bin/env python3
"""Baseline for `quern bench`: llama.cpp's batched offline throughput on the same workload.

N synthetic requests of exactly L prompt tokens (random ids among non-control tokens, drawn
with the same xoshiro256** stream and seed as `quern bench`, so the prompts are identical),
all arriving at once, each generating exactly M tokens greedily with EOS ignored.

Continuous batching through llama-cpp-python's low-level bindings, in the style of
llama.cpp's `llama-parallel` / `llama-batched-bench` examples:

  * one llama_context with n_seq_max = S parallel sequences (--parallel), n_ctx = S x (L+M)
    (rounded up), n_batch = n_ubatch = B (--batch), a per-sequence KV stream unless
    --kv-unified;
  * a request takes a free sequence slot (its KV cleared with llama_memory_seq_rm) as soon
    as one is free; every llama_decode call carries at most B tokens;
  * --schedule split (default): while any slot still has prompt tokens, a call carries only
    prompt tokens (several prompts per call, chunked at the budget, logits only for a
    prompt's last token); otherwise a call carries one token for every live sequence.
    --schedule mixed: every call carries one token per decoding sequence, and the rest of
    the budget goes to prompt chunks (like llama-server);
  * greedy argmax (numpy) over the logits rows of the call's outputs.

Prints one JSON object on stdout (fields named like `quern bench`'s). --check K reruns the
first K requests one at a time in a single-sequence context and reports how many generated
tokens agree (llama.cpp is not batch-invariant, so small differences are possible).
"""
import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

import llama_cpp
import llama_cpp.llama_cpp as ll

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models",
                             "SmolLM2-135M-Instruct.Q4_1.gguf")

M64 = (1 << 64) - 1

# ---- the `quern bench` prompt generator (engine/sampler.c, runner/cmd_bench.c) ----------


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return x, z ^ (z >> 31)


def _rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M64


class Rng:
    """engine_rng: splitmix64-seeded xoshiro256**, the seed mixed with FNV-1a of an id."""

    def __init__(self, seed, request_id=b"bench"):
        h = 0xCBF29CE484222325
        for c in request_id:
            h = ((h ^ c) * 0x100000001B3) & M64
        x, z = _splitmix64(seed & M64)
        x = z ^ h
        self.s = []
        for _ in range(4):
            x, z = _splitmix64(x)
            self.s.append(z)

    def next(self):
        s = self.s
        out = (_rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = _rotl(s[3], 45)
        return out


def synthetic_prompts(vocab, n, length, seed):
    nv = ll.llama_vocab_n_tokens(vocab)
    # as engine/tokenizer.c: GGUF types unknown (2) and control (3) are control, 5 unused
    bad = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN | ll.LLAMA_TOKEN_ATTR_UNUSED
    ok = np.zeros(nv, dtype=bool)
    for t in range(nv):
        text = ll.llama_vocab_get_text(vocab, t)
        ok[t] = not (ll.llama_vocab_get_attr(vocab, t) & bad) and bool(text)
    rng = Rng(seed)
    prompts = []
    for _ in range(n):
        ids = []
        while len(ids) < length:
            t = rng.next() % nv
            if ok[t]:
                ids.append(int(t))
        prompts.append(ids)
    return prompts


# ---- llama.cpp plumbing -----------------------------------------------------------------

_log_lines = []
_verbose = False


@ll.llama_log_callback
def _log_cb(level, text, user_data):
    s = text.decode("utf-8", "replace") if text else ""
    _log_lines.append(s)
    if _verbose:
        sys.stderr.write(s)


FA = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
      "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def make_context(model, args, n_seq, n_ctx):
    p = ll.llama_context_default_params()
    p.n_ctx = n_ctx
    p.n_batch = args.batch
    p.n_ubatch = args.batch
    p.n_seq_max = n_seq
    p.n_outputs_max = max(args.batch, n_seq)
    p.n_threads = args.threads
    p.n_threads_batch = args.threads
    p.flash_attn_type = FA[args.flash_attn]
    p.kv_unified = bool(args.kv_unified)
    p.no_perf = True
    ctx = ll.llama_init_from_model(model, p)
    if not ctx:
        sys.exit("bench_llamacpp: llama_init_from_model failed (n_ctx %d, n_seq_max %d)"
                 % (n_ctx, n_seq))
    return ctx


class Batch:
    """A llama_batch of capacity cap, filled from Python lists (one seq id per token)."""

    def __init__(self, cap):
        self.cap = cap
        self.b = ll.llama_batch_init(cap, 0, 1)
        self.token = np.ctypeslib.as_array(self.b.token, shape=(cap,))
        self.pos = np.ctypeslib.as_array(self.b.pos, shape=(cap,))
        self.n_seq_id = np.ctypeslib.as_array(self.b.n_seq_id, shape=(cap,))
        self.logits = np.ctypeslib.as_array(self.b.logits, shape=(cap,))
        self.n_seq_id[:] = 1

    def fill(self, tok, pos, seq, out):
        n = len(tok)
        self.token[:n] = tok
        self.pos[:n] = pos
        self.logits[:n] = out
        sid = self.b.seq_id
        for i in range(n):
            sid[i][0] = seq[i]
        self.b.n_tokens = n

    def free(self):
        ll.llama_batch_free(self.b)


def decode(ctx, batch, n_out, n_vocab):
    """llama_decode, then greedy argmax over the n_out output rows (in batch order)."""
    rc = ll.llama_decode(ctx, batch.b)
    if rc != 0:
        sys.exit("bench_llamacpp: llama_decode returned %d" % rc)
    if not n_out:
        return np.empty(0, dtype=np.int64)
    ptr = ll.llama_get_logits(ctx)
    rows = np.ctypeslib.as_array(ptr, shape=(n_out, n_vocab))
    return rows.argmax(axis=1)


def run_batched(ctx, prompts, M, S, B, n_vocab, schedule, stats):
    """Continuous batching of all prompts over S sequence slots; returns (tokens, t_first,
    t_finish) per request, times relative to the start."""
    mem = ll.llama_get_memory(ctx)
    batch = Batch(B)
    N = len(prompts)
    gen = [[] for _ in range(N)]
    t_first = [0.0] * N
    t_finish = [0.0] * N
    slot_req = [-1] * S     # request in each slot, -1 = free
    slot_fed = [0] * S      # prompt tokens already in the slot's KV
    next_req = 0
    done = 0
    rr = 0                  # round-robin start for decode tokens when S > B
    t0 = time.perf_counter()
    while done < N:
        for s in range(S):
            if slot_req[s] < 0 and next_req < N:
                ll.llama_memory_seq_rm(mem, s, -1, -1)
                slot_req[s] = next_req
                slot_fed[s] = 0
                next_req += 1
        tok, pos, seq, out, owners = [], [], [], [], []
        prefilling = [s for s in range(S) if slot_req[s] >= 0 and
                      slot_fed[s] < len(prompts[slot_req[s]])]
        decoding = [s for s in range(S) if slot_req[s] >= 0 and
                    slot_fed[s] >= len(prompts[slot_req[s]])]
        if schedule == "mixed" or not prefilling:
            if len(decoding) > B:
                decoding = decoding[rr % len(decoding):] + decoding[:rr % len(decoding)]
                decoding = sorted(decoding[:B])
                rr += B
            for s in decoding:
                r = slot_req[s]
                g = gen[r]
                tok.append(g[-1])
                pos.append(len(prompts[r]) + len(g) - 1)
                seq.append(s)
                out.append(1)
                owners.append(s)
        if prefilling:  # prompt chunks (under split, this call then has no decode tokens)
            for s in prefilling:
                room = B - len(tok)
                if room <= 0:
                    break
                p = prompts[slot_req[s]]
                a = slot_fed[s]
                e = min(len(p), a + room)
                tok.extend(p[a:e])
                pos.extend(range(a, e))
                seq.extend([s] * (e - a))
                out.extend([0] * (e - a))
                slot_fed[s] = e
                if e == len(p):
                    out[-1] = 1
                    owners.append(s)
        n_in = len(tok)
        batch.fill(tok, pos, seq, out)
        stats["steps"] += 1
        stats["batch_tokens"] += n_in
        stats["batch_seqs"] += len(set(seq))
        picks = decode(ctx, batch, len(owners), n_vocab)
        now = time.perf_counter() - t0
        # output rows come back in batch order, the order owners was built in
        for k, s in enumerate(owners):
            r = slot_req[s]
            gen[r].append(int(picks[k]))
            if len(gen[r]) == 1:
                t_first[r] = now
            if len(gen[r]) == M:
                t_finish[r] = now
                slot_req[s] = -1
                done += 1
    elapsed = time.perf_counter() - t0
    batch.free()
    return gen, t_first, t_finish, elapsed


def run_single(ctx, prompt, M, B, n_vocab):
    """One request alone in a single-sequence context: prompt in chunks of B, then one
    token per call."""
    mem = ll.llama_get_memory(ctx)
    ll.llama_memory_clear(mem, True)
    batch = Batch(B)
    L = len(prompt)
    for a in range(0, L, B):
        e = min(L, a + B)
        batch.fill(prompt[a:e], list(range(a, e)), [0] * (e - a),
                   [0] * (e - a - 1) + [1 if e == L else 0])
        picks = decode(ctx, batch, 1 if e == L else 0, n_vocab)
    g = [int(picks[0])]
    while len(g) < M:
        batch.fill([g[-1]], [L + len(g) - 1], [0], [1])
        g.append(int(decode(ctx, batch, 1, n_vocab)[0]))
    batch.free()
    return g


def pct(v, p):
    v = sorted(v)
    if not v:
        return 0.0
    k = -(-p * len(v) // 100)
    return v[max(int(k), 1) - 1]


def main():
    global _verbose
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=256, help="requests N (256)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens L (128)")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens M (128)")
    ap.add_argument("--parallel", type=int, default=64, help="sequence slots S (64)")
    ap.add_argument("--batch", type=int, default=512, help="tokens per llama_decode (512)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (2)")
    ap.add_argument("--seed", type=int, default=1, help="prompt seed, as quern bench (1)")
    ap.add_argument("--flash-attn", choices=sorted(FA), default="auto")
    ap.add_argument("--kv-unified", action="store_true",
                    help="one KV stream shared by all sequences (default: one per sequence)")
    ap.add_argument("--schedule", choices=["split", "mixed"], default="split")
    ap.add_argument("--check", type=int, default=2,
                    help="rerun the first K requests alone and compare tokens (2; 0 = off)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    a = ap.parse_args()
    for k in ("prompts", "input_len", "output_len", "parallel", "batch", "threads"):
        if getattr(a, k) < 1:
            ap.error("--%s must be >= 1" % k.replace("_", "-"))
    _verbose = a.verbose
    ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
    ll.llama_backend_init()

    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        sys.exit("bench_llamacpp: cannot load %s" % a.model)
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    N, L, M = a.prompts, a.input_len, a.output_len
    S = min(a.parallel, N)
    prompts = synthetic_prompts(vocab, N, L, a.seed)

    per_seq = -(-(L + M) // 256) * 256
    n_ctx = S * per_seq
    n_log0 = len(_log_lines)
    ctx = make_context(model, a, S, n_ctx)
    ctx_log = "".join(_log_lines[n_log0:])
    fa_resolved = None
    for line in ctx_log.splitlines():
        if "flash_attn" in line or "Flash Attention" in line:
            fa_resolved = line.strip()
    kv_types = None
    for line in ctx_log.splitlines():
        if "K (" in line and "V (" in line:
            kv_types = line.strip()

    if not a.no_warmup:  # like engine_warmup: one prompt and one decode step, then clear
        st = {"steps": 0, "batch_tokens": 0, "batch_seqs": 0}
        run_batched(ctx, prompts[:min(S, 2)], 2, S, a.batch, n_vocab, a.schedule, st)
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)

    stats = {"steps": 0, "batch_tokens": 0, "batch_seqs": 0}
    gen, t_first, t_finish, elapsed = run_batched(ctx, prompts, M, S, a.batch, n_vocab,
                                                  a.schedule, stats)
    ll.llama_free(ctx)

    in_tok = N * L
    out_tok = sum(len(g) for g in gen)
    res = {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": ll.llama_version().decode() if hasattr(ll, "llama_version") else None,
        "system_info": ll.llama_print_system_info().decode().strip(),
        "model": a.model,
        "threads": a.threads,
        "requests": N,
        "input_len": L,
        "output_len": M,
        "parallel": S,
        "batch": a.batch,
        "ubatch": a.batch,
        "n_ctx": n_ctx,
        "kv_unified": bool(a.kv_unified),
        "schedule": a.schedule,
        "flash_attn": a.flash_attn,
        "flash_attn_log": fa_resolved,
        "kv_cache_log": kv_types,
        "elapsed_s": elapsed,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "output_tok_s": out_tok / elapsed,
        "total_tok_s": (in_tok + out_tok) / elapsed,
        "requests_s": N / elapsed,
        "ttft_ms": {"p%d" % p: 1e3 * pct(t_first, p) for p in (50, 90, 99)},
        "tpot_ms": {"p%d" % p: 1e3 * pct([(f - s) / (M - 1) if M > 1 else 0.0
                                          for s, f in zip(t_first, t_finish)], p)
                    for p in (50, 90, 99)},
        "steps": stats["steps"],
        "mean_batch_seqs": stats["batch_seqs"] / max(stats["steps"], 1),
        "mean_batch_tokens": stats["batch_tokens"] / max(stats["steps"], 1),
    }

    K = min(a.check, N)
    if K > 0:
        ctx1 = make_context(model, a, 1, per_seq)
        same_req = same_tok = 0
        first_diff = []
        for r in range(K):
            g1 = run_single(ctx1, prompts[r], M, a.batch, n_vocab)
            agree = sum(1 for x, y in zip(gen[r], g1) if x == y)
            same_tok += agree
            same_req += int(g1 == gen[r])
            d = next((i for i, (x, y) in enumerate(zip(gen[r], g1)) if x != y), None)
            first_diff.append(d)
        ll.llama_free(ctx1)
        res["check"] = {"requests": K, "identical_requests": same_req,
                        "matching_tokens": same_tok, "tokens": K * M,
                        "first_divergence": first_diff}
        if same_req != K:
            sys.stderr.write("bench_llamacpp: warning: %d of %d requests differ between the "
                             "batched and the single-sequence run (%d of %d tokens agree; "
                             "first divergence %s)\n"
                             % (K - same_req, K, same_tok, K * M, first_diff))

    ll.llama_model_free(model)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
