#!/usr/bin/env python3
"""Independent numpy reference of the llama.cpp forward pass of the llama, qwen2, qwen3, qwen3moe,
gemma2, gemma3 and phi3 architectures (NOT run by CI; class Model says how the others differ from llama).

Every tensor is dequantized with gguf.quants.dequantize (exact float32 values of the
quantized weights), then ALL compute is done in float64. Writes tests/fixtures/forward_ref.json.

Semantics (llama.cpp, GGUF 'llama' arch):
  x = tok_embd[tok]
  per layer: h = rmsnorm(x)*attn_norm; q,k,v = Wq h, Wk h, Wv h
             rope NORM mode (adjacent pairs (2i,2i+1), angle pos*theta^(-2i/rot_dim)) on q,k
             k, v rounded to IEEE half as quern's KV cache stores them (--kv-dtype f32: not)
             causal softmax(q.k/sqrt(head_dim)) GQA: head h uses kv head h // (n_head/n_kv)
             x += Wo attn; h = rmsnorm(x)*ffn_norm; x += Wdown(silu(Wgate h) * Wup h)
  logits = W_out @ (rmsnorm(x)*output_norm), W_out = output.weight or tied token_embd.
GGUF shapes are [ne0, ne1] with ne0 the inner (input) dim; numpy arrays from gguf are
(ne1, ne0), so y = W @ x.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DT = np.float64


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


class Model:
    """llama, qwen2, qwen3 and gemma3 as llama.cpp builds them (src/models/*.cpp there):
      qwen2:  q, k, v get their biases; RoPE NEOX (pairs (i, i + D/2))
      qwen3:  q, k each RMS-normed per head (attn_q_norm / attn_k_norm) before RoPE; NEOX
      gemma3: x = tok_embd[tok] * sqrt(n_embd); QK-norm; NEOX; scores scaled by 1/sqrt(head_dim);
              attention output RMS-normed (post_attention_norm) before the residual add; FFN
              down(gelu_tanh(gate) * up), RMS-normed (post_ffw_norm) before its residual add;
              every 6th layer (il % 6 == 5) global with rope.freq_base, the others see only the
              last attention.sliding_window positions with base 10000. Norm weights are used
              as stored (the converter already added Gemma's +1).
      gemma2: as gemma3 without QK-norm; every other layer (il % 2 == 0) sliding, all with
              rope.freq_base; scores soft-capped (cap * tanh(s / cap), attn_logit_softcapping)
              after scaling, and the output logits (final_logit_softcapping).
      llama:  rope_freqs.weight, when present, divides pair i's frequency (Llama 3).
      phi3:   Q, K and V are the rows of one matrix (attn_qkv: query rows, then key, then value,
              as Hugging Face's Phi3Attention slices qkv_proj's output), gate and up the two
              halves of ffn_up (gate first: Phi3MLP's gate_up_proj chunked in two); NEOX."""

    def __init__(self, path):
        r = gguf.GGUFReader(path)
        f = r.fields
        arch = f["general.architecture"].contents()
        assert arch in ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3",
                        "phi3"), arch
        self.arch = arch
        g = lambda k: f[arch + "." + k].contents()
        has = lambda k: arch + "." + k in f
        self.n_layer = int(g("block_count"))
        self.n_embd = int(g("embedding_length"))
        self.n_ff = int(g("feed_forward_length"))
        self.n_head = int(g("attention.head_count"))
        self.n_kv = int(g("attention.head_count_kv"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.theta = float(g("rope.freq_base")) if has("rope.freq_base") else 10000.0
        self.head_dim = int(g("attention.key_length")) if has("attention.key_length") else self.n_embd // self.n_head
        # a mixture of experts (Mixtral: llama; Qwen3-MoE: qwen3moe), as Hugging Face's
        # MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock (norm_topk_prob): the router's softmax
        # over all experts, the top n_used kept and renormalized, their FFNs' outputs summed
        self.n_expert = int(g("expert_count")) if has("expert_count") else 0
        self.n_used = int(g("expert_used_count")) if self.n_expert else 0
        # Qwen2-MoE (Qwen2MoeSparseMoeBlock): the chosen weights not renormalized
        # (norm_topk_prob false), and a shared expert beside them, weighted by
        # sigmoid(shared_expert_gate(x)), its width expert_shared_feed_forward_length
        self.norm_topk = arch != "qwen2moe"
        self.n_ff_shexp = (int(g("expert_shared_feed_forward_length"))
                           if has("expert_shared_feed_forward_length") else self.n_ff) \
            if arch == "qwen2moe" else 0
        if has("expert_feed_forward_length"):
            self.n_ff = int(g("expert_feed_forward_length"))
        self.n_rot = int(g("rope.dimension_count")) if has("rope.dimension_count") else self.head_dim
        assert 0 < self.n_rot <= self.head_dim and self.n_rot % 2 == 0
        self.neox = arch != "llama"
        self.gemma = arch in ("gemma2", "gemma3")
        self.window = int(g("attention.sliding_window")) if self.gemma else 0
        self.pattern = (int(g("attention.sliding_window_pattern"))
                        if has("attention.sliding_window_pattern") else 2 if arch == "gemma2" else 6)
        self.theta_swa = 10000.0 if arch == "gemma3" else self.theta
        self.attn_cap = float(g("attn_logit_softcapping")) if has("attn_logit_softcapping") else 0.0
        self.final_cap = float(g("final_logit_softcapping")) if has("final_logit_softcapping") else 0.0
        self.eps = np.float64(np.float32(self.eps))  # stored as f32 in GGUF
        tens = {t.name: t for t in r.tensors}

        def W(name):
            t = tens[name]
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            ne = [int(x) for x in t.shape]  # ne0 first
            assert list(a.shape) == ne[::-1] or (len(ne) == 1 and a.shape == (ne[0],)), (name, a.shape, ne)
            return np.ascontiguousarray(a, dtype=DT)

        self.tok_embd = W("token_embd.weight")           # (n_vocab, n_embd)
        self.n_vocab = self.tok_embd.shape[0]
        self.out_norm = W("output_norm.weight")
        self.out_w = W("output.weight") if "output.weight" in tens else self.tok_embd
        self.freq_factors = W("rope_freqs.weight") if "rope_freqs.weight" in tens else None
        # LongRoPE (Phi-3's 128k models), as Hugging Face's _compute_longrope_parameters: the
        # long factors for a sequence longer than the original context, else the short ones
        # (set use_long), cos and sin times the attention factor
        self.mscale = 1.0
        self.use_long = False
        if "rope_factors_long.weight" in tens:
            self.long_f, self.short_f = W("rope_factors_long.weight"), W("rope_factors_short.weight")
            orig = int(g("rope.scaling.original_context_length"))
            fac = int(g("context_length")) / orig
            self.mscale = (float(g("rope.scaling.attn_factor")) if has("rope.scaling.attn_factor")
                           else math.sqrt(1 + math.log(fac) / math.log(orig)) if fac > 1 else 1.0)
        extra = {"qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                 "qwen2moe": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                 "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
                 "qwen3moe": ("attn_q_norm.weight", "attn_k_norm.weight"),
                 "gemma3": ("attn_q_norm.weight", "attn_k_norm.weight",
                            "post_attention_norm.weight", "post_ffw_norm.weight"),
                 "gemma2": ("post_attention_norm.weight", "post_ffw_norm.weight")}.get(arch, ())
        self.layers = []
        for i in range(self.n_layer):
            p = "blk.%d." % i
            if arch == "phi3":
                L = {k: W(p + k + ".weight") for k in
                     ("attn_norm", "attn_output", "ffn_norm", "ffn_down")}
                qkv, gate_up = W(p + "attn_qkv.weight"), W(p + "ffn_up.weight")
                nq, nk = self.n_head * self.head_dim, self.n_kv * self.head_dim
                assert qkv.shape == (nq + 2 * nk, self.n_embd)
                assert gate_up.shape == (2 * self.n_ff, self.n_embd)
                L["attn_q"], L["attn_k"], L["attn_v"] = qkv[:nq], qkv[nq:nq + nk], qkv[nq + nk:]
                L["ffn_gate"], L["ffn_up"] = gate_up[:self.n_ff], gate_up[self.n_ff:]
            elif self.n_expert:
                L = {k: W(p + k + ".weight") for k in
                     ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                      "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
                X, F, E = self.n_expert, self.n_ff, self.n_embd
                assert L["ffn_gate_inp"].shape == (X, E)
                assert L["ffn_gate_exps"].shape == (X, F, E) == L["ffn_up_exps"].shape
                assert L["ffn_down_exps"].shape == (X, E, F)
                if self.n_ff_shexp:
                    for k in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp",
                              "ffn_down_shexp"):
                        L[k] = W(p + k + ".weight")
                    assert L["ffn_gate_shexp"].shape == (self.n_ff_shexp, E)
            else:
                L = {k: W(p + k + ".weight") for k in
                     ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            for k in extra:
                L[k] = W(p + k)
            assert L["attn_q"].shape == (self.n_head * self.head_dim, self.n_embd)
            assert L["attn_k"].shape == (self.n_kv * self.head_dim, self.n_embd)
            assert self.n_expert or L["ffn_gate"].shape == (self.n_ff, self.n_embd)
            assert self.n_expert or L["ffn_down"].shape == (self.n_embd, self.n_ff)
            L["swa"] = self.window > 0 and i % self.pattern != self.pattern - 1
            self.layers.append(L)
        self.meta = dict(arch=arch, n_layer=self.n_layer, n_embd=self.n_embd, n_ff=self.n_ff,
                         n_head=self.n_head, n_kv=self.n_kv, head_dim=self.head_dim,
                         rope_theta=self.theta, rms_eps=float(self.eps), n_vocab=self.n_vocab,
                         window=self.window, attn_softcap=self.attn_cap,
                         final_softcap=self.final_cap, n_expert=self.n_expert,
                         n_expert_used=self.n_used)
        self.route_margin = math.inf  # smallest gap between a chosen and an unchosen router logit
        self.kv_f16 = True

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, theta, factors=None):
        # x: (T, H, D); pair i of the first n_rot channels rotated by pos * theta^(-2i/n_rot)
        # (/ factor i); the rest pass (partial rotary: Phi-4-mini, Hugging Face's
        # partial_rotary_factor)
        if self.n_rot < x.shape[-1]:
            out = x.copy()
            out[..., :self.n_rot] = self.rope(x[..., :self.n_rot], pos, theta, factors)
            return out
        D = x.shape[-1]
        inv = theta ** (-np.arange(0, D, 2, dtype=DT) / D)             # (D/2,)
        if factors is not None:
            inv = inv / factors
        ang = pos[:, None].astype(DT) * inv[None, :]                    # (T, D/2)
        c = self.mscale * np.cos(ang)[:, None, :]
        s = self.mscale * np.sin(ang)[:, None, :]
        if self.neox:
            x0, x1 = x[..., :D // 2], x[..., D // 2:]
        else:
            x0, x1 = x[..., 0::2], x[..., 1::2]
        r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
        out = np.empty_like(x)
        if self.neox:
            out[..., :D // 2], out[..., D // 2:] = r0, r1
        else:
            out[..., 0::2], out[..., 1::2] = r0, r1
        return out

    def ffn(self, h, gate, up, down):
        gt = h @ gate.T
        if self.gemma:
            act = 0.5 * gt * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gt + 0.044715 * gt ** 3)))
        else:
            act = gt / (1.0 + np.exp(-gt))
        return (act * (h @ up.T)) @ down.T

    def moe(self, L, h):
        logits = h @ L["ffn_gate_inp"].T                                # (T, n_expert)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = np.zeros_like(h)
        for t in range(h.shape[0]):
            order = np.argsort(-logits[t], kind="stable")
            top = order[:self.n_used]
            if self.n_used < self.n_expert:
                self.route_margin = min(self.route_margin,
                                        float(logits[t, top[-1]] - logits[t, order[self.n_used]]))
            w = p[t, top] / p[t, top].sum() if self.norm_topk else p[t, top]
            for e, we in zip(top, w):
                y[t] += we * self.ffn(h[t:t + 1], L["ffn_gate_exps"][e], L["ffn_up_exps"][e],
                                      L["ffn_down_exps"][e])[0]
        if self.n_ff_shexp:
            gate = 1.0 / (1.0 + np.exp(-(h @ L["ffn_gate_inp_shexp"])))     # (T,)
            y += gate[:, None] * self.ffn(h, L["ffn_gate_shexp"], L["ffn_up_shexp"],
                                          L["ffn_down_shexp"])
        return y

    def new_cache(self):
        return [([], []) for _ in range(self.n_layer)]

    def forward(self, tokens, cache):
        """Process `tokens` appended after what `cache` holds. Returns logits (T, n_vocab)."""
        T = len(tokens)
        start = sum(k.shape[0] for k in cache[0][0])
        pos = np.arange(start, start + T)
        x = self.tok_embd[np.asarray(tokens)]
        gemma = self.gemma
        if gemma:
            x = x * np.float64(np.float32(np.sqrt(np.float32(self.n_embd))))
        H, KV, D = self.n_head, self.n_kv, self.head_dim
        grp = H // KV
        scale = 1.0 / np.sqrt(D)
        for L, (kc, vc) in zip(self.layers, cache):
            h = self.rmsnorm(x, L["attn_norm"])
            q = h @ L["attn_q"].T
            k = h @ L["attn_k"].T
            v = h @ L["attn_v"].T
            if "attn_q.bias" in L:
                q, k, v = q + L["attn_q.bias"], k + L["attn_k.bias"], v + L["attn_v.bias"]
            q, k, v = q.reshape(T, H, D), k.reshape(T, KV, D), v.reshape(T, KV, D)
            if "attn_q_norm.weight" in L:
                q = self.rmsnorm(q, L["attn_q_norm.weight"])
                k = self.rmsnorm(k, L["attn_k_norm.weight"])
            theta = self.theta_swa if L["swa"] else self.theta
            factors = None if L["swa"] else self.freq_factors
            if hasattr(self, "long_f"):
                factors = self.long_f if self.use_long else self.short_f
            q, k = self.rope(q, pos, theta, factors), self.rope(k, pos, theta, factors)
            if self.kv_f16:
                k = k.astype(np.float16).astype(DT)
                v = v.astype(np.float16).astype(DT)
            kc.append(k)
            vc.append(v)
            K, V = np.concatenate(kc, 0), np.concatenate(vc, 0)    # (S, KV, D)
            S = K.shape[0]
            kpos = np.arange(S)
            mask = kpos[None, :] > pos[:, None]                       # (T, S)
            if L["swa"]:
                mask |= pos[:, None] - kpos[None, :] >= self.window
            att = np.empty((T, H, D), dtype=DT)
            for hh in range(H):
                kv = hh // grp
                sc = (q[:, hh, :] @ K[:, kv, :].T) * scale            # (T, S)
                if self.attn_cap:
                    sc = self.attn_cap * np.tanh(sc / self.attn_cap)
                sc = np.where(mask, -np.inf, sc)
                sc = sc - sc.max(axis=1, keepdims=True)
                p = np.exp(sc)
                p /= p.sum(axis=1, keepdims=True)
                att[:, hh, :] = p @ V[:, kv, :]
            a = att.reshape(T, H * D) @ L["attn_output"].T
            if gemma:
                a = self.rmsnorm(a, L["post_attention_norm.weight"])
            x = x + a
            h = self.rmsnorm(x, L["ffn_norm"])
            if self.n_expert:
                y = self.moe(L, h)
            else:
                y = self.ffn(h, L["ffn_gate"], L["ffn_up"], L["ffn_down"])
            if gemma:
                y = self.rmsnorm(y, L["post_ffw_norm.weight"])
            x = x + y
        x = self.rmsnorm(x, self.out_norm)
        logits = x @ self.out_w.T
        if self.final_cap:
            logits = self.final_cap * np.tanh(logits / self.final_cap)
        return logits


def top2_margin(l):
    i = np.argpartition(-l, 2)[:2]
    a, b = sorted(l[i], reverse=True)
    return float(a - b)


def position_record(l, probe):
    top = np.argsort(-l, kind="stable")[:16]
    return {"top": [[int(i), round(float(l[i]), 6)] for i in top],
            "probe": [round(float(l[i]), 6) for i in probe],
            "margin": round(float(l[top[0]] - l[top[1]]), 6)}


def greedy(m, prompt, n, cache=None, first_logits=None):
    cache = m.new_cache() if cache is None else cache
    logits = m.forward(prompt, cache)[-1] if first_logits is None else first_logits
    out, margins = [], []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        margins.append(round(top2_margin(logits), 6))
        logits = m.forward([t], cache)[-1]
    return out, margins


def make_llama_checks(model, n_ctx=256):
    """(1) strict: llama.cpp on an F32 re-quantized copy (exact dequantized weights) with an F32
    KV cache -- must match this reference to ~1e-4; (2) informational: llama.cpp on the native
    Q4_1 file (Q8 activation quantization in its matmuls, F16 KV cache)."""
    import ctypes
    import tempfile
    import llama_cpp
    from llama_cpp import Llama
    f32 = os.path.join(tempfile.mkdtemp(prefix="quern_ref_"), "model_f32.gguf")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = 0  # LLAMA_FTYPE_ALL_F32
    p.allow_requantize = True
    assert llama_cpp.llama_model_quantize(model.encode(), f32.encode(), ctypes.byref(p)) == 0
    kw = dict(n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=os.cpu_count())
    ref = Llama(model_path=f32, type_k=0, type_v=0, use_mmap=False, **kw)
    os.remove(f32)
    os.rmdir(os.path.dirname(f32))
    return [("F32 weights, F32 KV:", ref, True),
            ("native Q4_1, F16 KV:", Llama(model_path=model, **kw), False)]


def llama_logits_and_greedy(llm, toks, n):
    llm.reset()
    llm.eval(toks)
    lg = np.array(llm.scores[:len(toks)], dtype=DT)
    out, cur = [], int(np.argmax(lg[-1]))
    for _ in range(n):
        out.append(cur)
        llm.eval([cur])
        cur = int(np.argmax(np.array(llm.scores[llm.n_tokens - 1])))
    return lg, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "forward_ref.json"))
    ap.add_argument("--n-greedy", type=int, default=32)
    ap.add_argument("--kv-dtype", choices=("f16", "f32"), default="f16",
                    help="precision the KV cache stores (quern: f16); f32 keeps float64")
    ap.add_argument("--check-llama", action="store_true",
                    help="also compare logits against llama.cpp (llama-cpp-python) and print diffs")
    args = ap.parse_args()

    t0 = time.time()
    m = Model(args.model)
    m.kv_f16 = args.kv_dtype == "f16"
    print("loaded model in %.1fs: %s" % (time.time() - t0, m.meta))
    meta = ref_tokenizer.gguf_tokenizer_meta(args.model)
    hf = ref_tokenizer.HFRef(meta)
    special = {t: i for i, (t, ty) in enumerate(zip(meta["tokens"], meta["token_type"])) if ty == 3}

    # sanity: greedy chat answer mentions Paris
    _, chat_ids = ref_tokenizer.chat_ids(meta["chat_template"],
                                         [{"role": "user", "content": "What is the capital of France?"}],
                                         True, hf.encode, special)
    ans, _ = greedy(m, chat_ids, 16)
    ans_text = hf.decode(ans)
    print("sanity greedy answer: %r" % ans_text)
    assert "Paris" in ans_text, ans_text

    prompts = [
        ("short", hf.encode("The capital of France is")),
        ("chat_france", chat_ids),
        ("code_c", hf.encode("#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 10; i++) {\n        printf(\"%d\\n\", i);\n    }\n")),
        ("digits", hf.encode("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,")),
        ("prose", hf.encode("Once upon a time, in a small village nestled between rolling hills and a "
                            "quiet river, there lived an old clockmaker who")),
        ("python_code", hf.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n")),
        ("unicode_mix", hf.encode("Le café est très bon. 東京は日本の首都です。 The Japanese word for cat is")),
    ]
    for name, toks in prompts:
        assert 4 <= len(toks) <= 60, (name, len(toks))

    rng = np.random.default_rng(1234)
    fixed = [0, 1, 2, 3, 17, 28, 30, 198, 216, 253, 260, 314, 330, 905, 4649, 19556,
             49151, 49150, 49000, 40000, 32000, 25000, 16384, 12345, 8192, 4096, 1024, 512]
    extra = [int(i) for i in rng.choice(np.setdiff1d(np.arange(m.n_vocab), fixed),
                                        64 - len(fixed), replace=False)]
    probe = fixed + sorted(extra)
    assert len(probe) == 64 and len(set(probe)) == 64

    checks = []
    if args.check_llama:
        checks = make_llama_checks(args.model)

    out = {"model_sha256": sha256(args.model),
           "precision": "float64 compute; weights dequantized to float32 by gguf.quants.dequantize then widened",
           "kv_dtype": args.kv_dtype,
           "config": m.meta, "probe_ids": probe, "prompts": []}
    all_margins = []
    for name, toks in prompts:
        t0 = time.time()
        cache = m.new_cache()
        L = m.forward(toks, cache)
        g, gm = greedy(m, toks, args.n_greedy, cache=cache, first_logits=L[-1])
        rec = {"name": name, "tokens": [int(t) for t in toks],
               "positions": [position_record(L[i], probe) for i in range(len(toks))],
               "greedy": g, "greedy_margins": gm}
        out["prompts"].append(rec)
        pm = [p["margin"] for p in rec["positions"]]
        all_margins += [(v, name, "pos", i) for i, v in enumerate(pm)]
        all_margins += [(v, name, "greedy", i) for i, v in enumerate(gm)]
        print("%-12s n=%2d  %.1fs  min pos margin %.4f  min greedy margin %.4f  greedy=%r"
              % (name, len(toks), time.time() - t0, min(pm), min(gm), hf.decode(g)))
        for label, llm, strict in checks:
            lg, ll_g = llama_logits_and_greedy(llm, toks, args.n_greedy)
            d = np.abs(lg - L)
            agree = float(np.mean(np.argmax(lg, 1) == np.argmax(L, 1)))
            ng = next((i for i, (x, y) in enumerate(zip(ll_g, g)) if x != y), len(g))
            print("   vs llama.cpp %-26s max|dlogit| %.5f mean %.6f argmax agree %.3f greedy agree %d/%d"
                  % (label, d.max(), d.mean(), agree, ng, len(g)))
            if strict and not m.kv_f16:
                assert d.max() < 1e-3 and ng == len(g), "reference disagrees with llama.cpp F32"
    all_margins.sort()
    out["smallest_margins"] = [{"margin": v, "prompt": n, "kind": k, "index": i}
                               for v, n, k, i in all_margins[:10]]
    print("smallest top1-top2 margins:")
    for v, n, k, i in all_margins[:10]:
        print("  %.6f  %s %s[%d]" % (v, n, k, i))
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print("wrote %s (%d bytes)" % (args.out, os.path.getsize(args.out)))


if __name__ == "__main__":
    main()
