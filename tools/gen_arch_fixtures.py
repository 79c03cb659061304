#!/usr/bin/env python3
"""Small random-weight GGUFs of each supported architecture and their reference logits (NOT run
by CI; the outputs are committed):

  tests/fixtures/arch/{llama3,qwen2,qwen3,gemma3,gemma2,phi3,phi3_longrope,qwen3moe,
                      mixtral,phi3_partial,qwen2moe}.gguf  (`gguf`)
  tests/fixtures/arch_ref.json                           logits at every position of a prompt,
                                                         from tools/ref_forward.py's Model

Each file has only what the forward pass reads (no tokenizer): 64 hidden, 4 query heads, 2 KV
heads (so --tp 2 splits them), FFN 96, 128 tokens of vocabulary, 6 layers, matrices in a mix of
Q8_0, Q4_0, Q4_1 and F16. llama3 carries rope_freqs.weight with Llama 3.1's factors formula;
qwen3 and gemma3 a head_dim (32) that is not hidden / heads (16); gemma3 a 5-token sliding
window, so a 24-token prompt crosses it in the five sliding layers of every six; gemma2 the
same window in every other layer and soft-capping (attention 4, logits 30: caps these random
weights' scores and logits reach, so that tanh bends them); phi3 Q/K/V in one matrix and gate/up
in one, head_dim 48 (not a power of two), the sliding window Phi-3 mini's GGUF declares;
phi3_longrope Phi-3.5's LongRoPE (short and long factors, original context 16 of 64, attention
factor 1.19), with reference logits for each factor set; qwen3moe and mixtral mixtures of
experts (Qwen3-MoE's 3 of 8 experts a token, Mixtral's 2 of 4: the router's softmax over all,
renormalized over the chosen); phi3_partial Phi-4-mini's RoPE on the first 3/4 of each head
(with LongRoPE, the output head tied); qwen2moe Qwen2-MoE's experts (not renormalized) and
shared expert.

Usage: python3 tools/gen_arch_fixtures.py   (needs numpy and gguf: tools/requirements-ref.txt)"""
import json
import math
import os
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as Q
from gguf import quants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, H, KV, FF, V, NL, CTX = 64, 4, 2, 96, 128, 6, 64
N_PROMPT = 24
# mixtures of experts: (experts, used per token) by architecture, each expert's FFN width
MOE = {"qwen3moe": (8, 3), "llama": (4, 2), "qwen2moe": (6, 2)}
FF_QWEN3MOE, FF_MIXTRAL, FF_SHEXP = 32, 64, 64  # (Qwen2-MoE's experts as Qwen3-MoE's, 32)
LONGROPE_ORIG = 16


def llama3_factors(dim, theta):
    """Llama 3.1 RoPE frequency factors (factor 8, low 1, high 4, original context 8192), as the
    GGUF converter writes them: wavelengths past the low band are slowed 8x, those under the
    high band kept, the rest blended."""
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192
    lo_wl, hi_wl = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wl = 2 * math.pi / freq
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(name, arch, head_dim, extra, types, rng):
    path = os.path.join(ROOT, "tests", "fixtures", "arch", name + ".gguf")
    w = GGUFWriter(path, arch)
    w.add_context_length(CTX)
    w.add_embedding_length(E)
    w.add_block_count(NL)
    moe = "moe" in extra
    w.add_feed_forward_length(FF_MIXTRAL if moe and arch == "llama" else FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    if head_dim != E // H:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    theta = {"llama3": 500000.0, "gemma3": 1000000.0}.get(name, 10000.0 * 3)
    w.add_rope_freq_base(theta)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(5)
    if "window" in extra:
        w.add_sliding_window(2047)
    if "partial" in extra:  # RoPE on the first 3/4 of each head (Phi-4-mini: 96 of 128)
        w.add_rope_dimension_count(head_dim * 3 // 4)
    if "longrope" in extra:  # Phi-3.5 mini's keys (original context 4096 of 131072 there)
        w.add_uint32(arch + ".rope.scaling.original_context_length", LONGROPE_ORIG)
        w.add_float32(arch + ".rope.scaling.attn_factor", 1.19)
    if moe:  # Mixtral's keys (its experts' width is feed_forward_length), or Qwen3-MoE's
        n_expert, n_used = MOE[arch]
        w.add_uint32(arch + ".expert_count", n_expert)
        w.add_uint32(arch + ".expert_used_count", n_used)
        if arch in ("qwen3moe", "qwen2moe"):
            w.add_uint32(arch + ".expert_feed_forward_length", FF_QWEN3MOE)
        if arch == "qwen2moe":
            w.add_uint32(arch + ".expert_shared_feed_forward_length", FF_SHEXP)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", 4.0)
        w.add_float32("gemma2.final_logit_softcapping", 30.0)

    def mat(tname, n_in, n_out, qt, scale=1.0, n_expert=0):
        shape = (n_expert, n_out, n_in) if n_expert else (n_out, n_in)
        x = (rng.standard_normal(shape) * scale / math.sqrt(n_in)).astype(np.float32)
        if qt == Q.F16:
            w.add_tensor(tname, x.astype(np.float16))
        elif qt == Q.F32:
            w.add_tensor(tname, x)
        else:
            q = quants.quantize(x, qt)
            w.add_tensor(tname, q, raw_shape=q.shape, raw_dtype=qt)

    def vec(tname, n, mean, spread):
        w.add_tensor(tname, (mean + spread * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", E, V, types[0], scale=math.sqrt(E))
    vec("output_norm.weight", E, 1.0, 0.2)
    if name in ("llama3", "mixtral", "qwen2moe") or (arch == "phi3" and "partial" not in extra):
        mat("output.weight", E, V, types[1], scale=2.0)
    if name == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(head_dim, theta))
    if "longrope" in extra:  # long factors up to ~6 for the slow pairs, short ones near 1
        ramp = np.linspace(0, 1, (head_dim * 3 // 4 if "partial" in extra else head_dim) // 2)
        w.add_tensor("rope_factors_long.weight", (1 + 5 * ramp ** 2).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1 + 0.5 * ramp).astype(np.float32))
    for l in range(NL):
        p = "blk.%d." % l
        vec(p + "attn_norm.weight", E, 1.0, 0.2)
        vec(p + "ffn_norm.weight", E, 1.0, 0.2)
        if arch == "phi3":  # [Q; K; V] and [gate; up], each one matrix
            mat(p + "attn_qkv.weight", E, (H + 2 * KV) * head_dim, types[l % len(types)], 2.0)
            mat(p + "attn_output.weight", H * head_dim, E, types[(l + 3) % len(types)])
            mat(p + "ffn_up.weight", E, 2 * FF, types[(l + 1) % len(types)], 1.5)
            mat(p + "ffn_down.weight", FF, E, types[(l + 2) % len(types)])
            continue
        mat(p + "attn_q.weight", E, H * head_dim, types[l % len(types)], 2.0)
        mat(p + "attn_k.weight", E, KV * head_dim, types[(l + 1) % len(types)], 2.0)
        mat(p + "attn_v.weight", E, KV * head_dim, types[(l + 2) % len(types)])
        mat(p + "attn_output.weight", H * head_dim, E, types[(l + 3) % len(types)])
        if moe:  # the router (F32 as llama.cpp keeps it; F16 in qwen3moe), experts 3-D
            n_expert = MOE[arch][0]
            ff = FF_MIXTRAL if arch == "llama" else FF_QWEN3MOE
            mat(p + "ffn_gate_inp.weight", E, n_expert, Q.F16 if arch == "qwen3moe" else Q.F32,
                2.0)
            mat(p + "ffn_gate_exps.weight", E, ff, types[l % len(types)], 2.0, n_expert)
            mat(p + "ffn_up_exps.weight", E, ff, types[(l + 1) % len(types)], 1.0, n_expert)
            mat(p + "ffn_down_exps.weight", ff, E, types[(l + 2) % len(types)], 1.0, n_expert)
            if arch == "qwen2moe":  # the shared expert: its gate (a vector), its FFN
                vec(p + "ffn_gate_inp_shexp.weight", E, 0.0, 2.0 / math.sqrt(E))
                mat(p + "ffn_gate_shexp.weight", E, FF_SHEXP, types[(l + 1) % len(types)], 2.0)
                mat(p + "ffn_up_shexp.weight", E, FF_SHEXP, types[l % len(types)])
                mat(p + "ffn_down_shexp.weight", FF_SHEXP, E, types[(l + 2) % len(types)])
        else:
            mat(p + "ffn_gate.weight", E, FF, types[l % len(types)], 2.0)
            mat(p + "ffn_up.weight", E, FF, types[(l + 1) % len(types)])
            mat(p + "ffn_down.weight", FF, E, types[(l + 2) % len(types)])
        if "bias" in extra:
            vec(p + "attn_q.bias", H * head_dim, 0.0, 0.3)
            vec(p + "attn_k.bias", KV * head_dim, 0.0, 0.3)
            vec(p + "attn_v.bias", KV * head_dim, 0.0, 0.3)
        if "qk_norm" in extra:
            vec(p + "attn_q_norm.weight", head_dim, 1.0, 0.2)
            vec(p + "attn_k_norm.weight", head_dim, 1.0, 0.2)
        if "post_norm" in extra:
            vec(p + "post_attention_norm.weight", E, 1.0, 0.2)
            vec(p + "post_ffw_norm.weight", E, 1.0, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    os.makedirs(os.path.join(ROOT, "tests", "fixtures", "arch"), exist_ok=True)
    rng = np.random.default_rng(2026)
    specs = [
        ("llama3", "llama", E // H, (), (Q.Q8_0, Q.Q4_0)),
        ("qwen2", "qwen2", E // H, ("bias",), (Q.Q8_0, Q.F16, Q.Q4_1)),
        ("qwen3", "qwen3", 32, ("qk_norm",), (Q.Q4_1, Q.Q8_0)),
        ("gemma3", "gemma3", 32, ("qk_norm", "post_norm"), (Q.Q8_0, Q.Q4_0, Q.Q4_1)),
        ("gemma2", "gemma2", 32, ("post_norm",), (Q.Q4_0, Q.Q8_0, Q.F16)),
        # Phi-3's head_dim is 96 (mini) or 128: 48 here, not a power of two; its mini's GGUF
        # declares a sliding window that is not applied (only a warning)
        ("phi3", "phi3", 48, ("window",), (Q.Q4_1, Q.Q8_0, Q.Q4_0)),
        # Phi-3.5 mini's LongRoPE: short and long factors, the attention factor; reference logits
        # with each ("logits": short, "logits_long": long)
        ("phi3_longrope", "phi3", 48, ("longrope",), (Q.Q4_1, Q.Q8_0, Q.Q4_0)),
        # mixtures of experts: Qwen3-MoE's (8 experts, 3 a token, each 32 wide, F16 router) and
        # Mixtral's (llama with 4 experts, 2 a token, each 64 wide)
        ("qwen3moe", "qwen3moe", 32, ("qk_norm", "moe"), (Q.Q8_0, Q.Q4_1, Q.Q4_0)),
        ("mixtral", "llama", E // H, ("moe",), (Q.Q4_0, Q.Q8_0)),
        # Phi-4-mini's shape: RoPE on 12 of each head's 16 channels, LongRoPE, the output tied
        ("phi3_partial", "phi3", E // H, ("partial", "longrope"), (Q.Q8_0, Q.Q4_0)),
        # Qwen2-MoE's (Qwen1.5-MoE, Qwen2-57B-A14B): Q/K/V biases, 2 of 6 experts 32 wide with
        # their softmax weights not renormalized, and a shared expert 64 wide behind a gate
        ("qwen2moe", "qwen2moe", E // H, ("bias", "moe"), (Q.Q8_0, Q.Q4_1, Q.Q4_0)),
    ]
    out = {"note": "tools/gen_arch_fixtures.py: logits of tools/ref_forward.py (float64, KV "
                   "rounded to f16) at every position", "models": []}
    for name, arch, hd, extra, types in specs:
        # a mixture of experts is drawn again (the generator going on) until no token of its
        # prompt comes within 4e-3 of choosing another expert
        for attempt in range(20):
            path = write(name, arch, hd, extra, types, rng)
            m = ref_forward.Model(path)
            m.kv_f16 = True
            toks = [int(t) for t in rng.integers(0, V, N_PROMPT)]
            logits = m.forward(toks, m.new_cache())
            if "moe" not in extra or m.route_margin > 4e-3:
                break
        # the same logits one token at a time (the reference's KV cache path)
        cache = m.new_cache()
        step = np.concatenate([m.forward([t], cache) for t in toks], 0)
        assert np.abs(step - logits).max() < 1e-9
        rec = {"name": name, "file": "tests/fixtures/arch/%s.gguf" % name, "config": m.meta,
               "tokens": toks, "logits": [[round(float(v), 5) for v in row] for row in logits]}
        if "moe" in extra:
            print("%-7s smallest gap between a chosen and an unchosen expert's router logit: %.4f"
                  % (name, m.route_margin))
            assert m.route_margin > 4e-3  # sums in another order choose the same experts
        if "longrope" in extra:
            m.use_long = True
            long = m.forward(toks, m.new_cache())
            assert np.abs(long - logits).max() > 0.1  # the factors matter at these positions
            rec["logits_long"] = [[round(float(v), 5) for v in row] for row in long]
        out["models"].append(rec)
        print("%-7s %6d bytes  logits |max| %.2f  std %.2f" %
              (name, os.path.getsize(path), float(np.abs(logits).max()), float(logits.std())))
    # an architecture quern does not run: only its name (the loader refuses it first)
    w = GGUFWriter(os.path.join(ROOT, "tests", "fixtures", "arch", "phi2.gguf"), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dst = os.path.join(ROOT, "tests", "fixtures", "arch_ref.json")
    with open(dst, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print("wrote %s (%d bytes)" % (dst, os.path.getsize(dst)))


if __name__ == "__main__":
    main()
