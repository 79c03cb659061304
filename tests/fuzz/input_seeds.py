#!/usr/bin/env python3
"""Seeds for fuzz_input: the same few JSONL lines as plain text, gzip (one and two members),
bzip2, xz, tar, tar.gz and zip (standard library only; zstd when the zstd command is there)."""
import bz2, gzip, io, lzma, os, shutil, subprocess, sys, tarfile, zipfile

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
text = b'{"custom_id": "a", "prompt": "hi"}\r\n\n{"messages": [{"role": "user", "content": "x"}]}\nlast'


def put(name, data):
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)


put("plain.jsonl", text)
put("one.gz", gzip.compress(text))
put("two.gz", gzip.compress(text[:20]) + gzip.compress(text[20:]) + b"\0\0")
put("a.bz2", bz2.compress(text))
put("a.xz", lzma.compress(text))
for mode, name in (("w", "a.tar"), ("w:gz", "a.tar.gz")):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode=mode) as t:
        for member in ("a.jsonl", "d/b.jsonl", "c.txt"):
            ti = tarfile.TarInfo(member)
            ti.size = len(text)
            t.addfile(ti, io.BytesIO(text))
    put(name, b.getvalue())
b = io.BytesIO()
with zipfile.ZipFile(b, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("a.jsonl", text)
    z.writestr("caf\u00e9.jsonl", text)
    z.writestr("._a.jsonl", text)
put("a.zip", b.getvalue())
if shutil.which("zstd"):
    put("a.zst", subprocess.run(["zstd", "-q", "-c"], input=text, capture_output=True,
                                check=True).stdout)
