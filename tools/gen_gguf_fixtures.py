#!/usr/bin/env python3
"""Generate the GGUF test fixtures with the independent `gguf` Python package:
  tests/fixtures/small.gguf          a tiny file exercising every metadata value type,
                                     nested arrays and several tensor types (fuzz seed)
  tests/fixtures/small_gguf.json     what the reader must report for it
  tests/fixtures/model_tensors.tsv   name, type, dims, nbytes, FNV-1a 64 of the data for
                                     every tensor of the default model
Usage: python3 tools/gen_gguf_fixtures.py MODEL.gguf"""
import json
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as Q
from gguf import quants


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    arr = np.frombuffer(data, dtype=np.uint8)
    # plain loop over bytes would be slow for 30 MB; do it in chunks with python ints
    for b in arr.tobytes():
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def model_table(path: str, out: str) -> None:
    r = GGUFReader(path)
    with open(out, "w") as f:
        f.write("# name\ttype\tne0,ne1,...\tnbytes\tfnv1a64(data)\n")
        for t in r.tensors:
            data = bytes(t.data.tobytes())
            dims = ",".join(str(int(d)) for d in t.shape)
            f.write(f"{t.name}\t{int(t.tensor_type)}\t{dims}\t{int(t.n_bytes)}\t{fnv1a64(data):016x}\n")


def small(out_gguf: str, out_json: str) -> None:
    rng = np.random.default_rng(1234)
    w = GGUFWriter(out_gguf, "llama")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -5)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 1.5)
    w.add_uint64("test.u64", 2**40)
    w.add_int64("test.i64", -(2**40))
    w.add_float64("test.f64", -2.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo wörld")
    w.add_array("test.arr_str", ["a", "bc", "", "déf"])
    w.add_array("test.arr_i32", [1, -2, 3])
    w.add_array("test.arr_nested", [[1, 2], [3, 4, 5]])
    tensors = {}
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("t.f32", f32)
    tensors["t.f32"] = (0, [64, 3])
    f16 = rng.standard_normal((2, 32)).astype(np.float16)
    w.add_tensor("t.f16", f16)
    tensors["t.f16"] = (1, [32, 2])
    for name, qt in (("t.q4_0", Q.Q4_0), ("t.q4_1", Q.Q4_1), ("t.q8_0", Q.Q8_0)):
        x = rng.standard_normal((2, 64)).astype(np.float32)
        q = quants.quantize(x, qt)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
        tensors[name] = (int(qt), [64, 2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = GGUFReader(out_gguf)
    expect = {"n_kv": sum(1 for k in r.fields if not k.startswith("GGUF.")), "tensors": []}
    for t in r.tensors:
        expect["tensors"].append({"name": t.name, "type": int(t.tensor_type),
                                  "ne": [int(d) for d in t.shape], "nbytes": int(t.n_bytes),
                                  "fnv": f"{fnv1a64(bytes(t.data.tobytes())):016x}"})
    with open(out_json, "w") as f:
        json.dump(expect, f, indent=1)


if __name__ == "__main__":
    small("tests/fixtures/small.gguf", "tests/fixtures/small_gguf.json")
    model_table(sys.argv[1], "tests/fixtures/model_tensors.tsv")
