#!/usr/bin/env python3
"""tools/ref_forward.py against llama.cpp on the random-weight fixtures (NOT run by CI).

The reference that tests/test_arch.c compares quern with is this repository's own numpy code;
this checks it against an implementation written by others: llama.cpp (llama-cpp-python). Each
fixture of tests/fixtures/arch_ref.json is copied with a vocabulary of its 128 ids (the fixtures
carry none; SentencePiece-style: <unk>, <s>, </s> and byte tokens, never used: the ids are fed
as they are) and its F16 matrices widened, re-quantized to F32 by llama.cpp (its own exact
dequantization), and run over the
fixture's prompt with an F32 KV cache and every position's logits; ref_forward.Model runs the
same prompt with its KV in float64. Prints the largest |llama.cpp - reference| / (1 + |ref|)
per fixture and fails above --tol. For Gemma's the reference's GELU is computed as llama.cpp's
CPU backend computes it, from a table of f16 inputs (with the exact GELU they differ by 1.3e-3
and 2.0e-3; this isolates that). The phi3 and phi3_longrope fixtures are not checked:
llama.cpp's phi3 takes head_dim = hidden / heads, theirs is wider (phi3_partial's is not).
Measured 2026-12-07 (llama-cpp-python 0.3.36): llama3, qwen2, qwen3, qwen3moe, mixtral, qwen2moe
0.8-2.7e-5; gemma2 1.5e-5, gemma3 1.2e-4; phi3_partial (RoPE on 12 of 16 channels, LongRoPE's
long factors, the output tied) 4.8e-5.

Usage: python3 tools/check_arch_llamacpp.py [--tol 1e-3] [name ...]
Needs numpy, gguf and llama-cpp-python (tools/requirements-ref.txt; llama-cpp-python builds
llama.cpp from source: `pip install llama-cpp-python`)."""
import argparse
import ctypes
import json
import os
import sys
import tempfile

import numpy as np
import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_forward  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_vocab(src, dst, n_vocab):
    """src with a SentencePiece vocabulary of n_vocab tokens added, and its F16 matrices widened
    to F32 (llama.cpp's re-quantization keeps a router, ffn_gate_inp, as it is, and an F16
    matrix multiplies inputs rounded to F16), written to dst."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(n_vocab - 3)]
    V = gguf.GGUFValueType
    meta = {
        "tokenizer.ggml.model": (V.STRING, "llama", None),
        "tokenizer.ggml.tokens": (V.ARRAY, tokens, V.STRING),
        "tokenizer.ggml.scores": (V.ARRAY, [0.0] * n_vocab, V.FLOAT32),
        "tokenizer.ggml.token_type": (V.ARRAY, [2, 3, 3] + [6] * (n_vocab - 3), V.INT32),
        "tokenizer.ggml.bos_token_id": (V.UINT32, 1, None),
        "tokenizer.ggml.eos_token_id": (V.UINT32, 2, None),
        "tokenizer.ggml.add_bos_token": (V.BOOL, False, None),
    }
    w = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        w.add_key_value(f.name, f.contents(), f.types[0],
                        sub_type=f.types[-1] if f.types[0] == V.ARRAY else None)
    for k, (t, v, sub) in meta.items():
        w.add_key_value(k, v, t, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F16:
            w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32))
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gelu_f16_ffn(h, gate, up, down):
    """Gemma's FFN with GELU as llama.cpp's CPU backend computes it (ggml-cpu/vec.h,
    GGML_GELU_FP16): 0 at or below -10, x at or above 10, else the tanh GELU of the input
    rounded to f16, itself rounded to f16 (its table)."""
    g = h @ gate.T
    x = g.astype(np.float16).astype(np.float64)
    act = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
    act = np.where(g <= -10, 0.0, np.where(g >= 10, g, act.astype(np.float16).astype(np.float64)))
    return (act * (h @ up.T)) @ down.T


def llama_logits(path, tokens):
    import llama_cpp
    from llama_cpp import Llama
    f32 = path + ".f32.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = 0  # LLAMA_FTYPE_ALL_F32
    p.allow_requantize = True
    assert llama_cpp.llama_model_quantize(path.encode(), f32.encode(), ctypes.byref(p)) == 0
    llm = Llama(model_path=f32, n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0,
                use_mmap=False, n_threads=os.cpu_count())
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    del llm
    os.remove(f32)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    with open(os.path.join(ROOT, "tests", "fixtures", "arch_ref.json")) as f:
        models = json.load(f)["models"]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="quern_arch_") as tmp:
        for md in models:
            if args.names and md["name"] not in args.names:
                continue
            cfg = md["config"]
            if cfg["arch"] == "phi3" and cfg["head_dim"] * cfg["n_head"] != cfg["n_embd"]:
                print("%-14s not checked: llama.cpp's phi3 takes head_dim = hidden / heads (%d "
                      "here), the fixture's is %d" % (md["name"], cfg["n_embd"] // cfg["n_head"],
                                                      cfg["head_dim"]))
                continue
            src = os.path.join(ROOT, md["file"])
            m = ref_forward.Model(src)
            m.kv_f16 = False
            if m.gemma:  # llama.cpp's CPU GELU: a table indexed by the input rounded to f16
                m.ffn = lambda h, g, u, d: gelu_f16_ffn(h, g, u, d)
            # LongRoPE: llama.cpp takes the long factors when its context (64) passes the
            # original one (16), as this run's does
            m.use_long = "rope_factors_long.weight" in [t.name for t in gguf.GGUFReader(src).tensors]
            ref = m.forward(md["tokens"], m.new_cache())
            dst = os.path.join(tmp, md["name"] + ".gguf")
            with_vocab(src, dst, m.n_vocab)
            try:
                got = llama_logits(dst, md["tokens"])
            except ValueError as e:  # (llama.cpp says why on stderr)
                print("%-14s llama.cpp did not load it: %s" % (md["name"], e))
                bad += 1
                continue
            err = float(np.max(np.abs(got - ref) / (1 + np.abs(ref))))
            agree = float(np.mean(np.argmax(got, 1) == np.argmax(ref, 1)))
            tol = args.tol
            print("%-14s max |llama.cpp - reference| / (1 + |ref|) = %.2e  argmax agree %.3f%s"
                  % (md["name"], err, agree, "" if err <= tol else "  FAIL (over %g)" % tol))
            bad += err > tol
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
