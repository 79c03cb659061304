#!/usr/bin/env python3
"""Seeds for tests/fuzz/fuzz_grammar.c: the schemas and grammars of tests/fuzz/request_seeds.jsonl
and tests/e2e/gen_schemas.py, each as <mode byte><text>\\0<a sentence or two to feed>."""
import json, os, subprocess, sys

out = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
seeds = []
for line in open(os.path.join(here, "request_seeds.jsonl")):
    d = json.loads(line)
    b = d.get("body", d)
    if "grammar" in b:
        seeds.append(b"\x00" + b["grammar"].encode() + b"\x00" + b"The answer is yes.")
    rf = b.get("response_format", {})
    if rf.get("type") == "json_schema":
        seeds.append(b"\x01" + json.dumps(rf["json_schema"]["schema"]).encode() + b"\x00" +
                     b'{"name": "x", "age": 3, "tags": ["a"]}')
gen = subprocess.run([sys.executable, os.path.join(here, "..", "e2e", "gen_schemas.py"), "20", "5"],
                     capture_output=True, check=True, text=True).stdout
for line in gen.splitlines():
    rf = json.loads(line).get("body", json.loads(line))["response_format"]
    if rf["type"] == "json_schema":
        seeds.append(b"\x01" + json.dumps(rf["json_schema"]["schema"]).encode() + b"\x00{}")
seeds.append(b"\x00root ::= [a-z]+ (\",\" [0-9]{1,3})* \"\\n\"\x00abc,12,7\n")
for i, s in enumerate(seeds):
    with open(os.path.join(out, "seed_%03d" % i), "wb") as f:
        f.write(s)
