#!/usr/bin/env python3
"""Where the CUDA kernels' register spills are: inside a loop that issues tensor-core MMAs (the
kernels' hot loops, where a local load costs every iteration) or outside (set-up, a pass's
bookkeeping, the epilogue). ptxas -v says how many bytes a kernel spills, not where.

Usage:
  python3 tools/cuda_spills.py build/kernels/cuda/cuda_kernels.o   (runs cuobjdump -sass)
  python3 tools/cuda_spills.py dump.sass                           (cuobjdump -sass's output)

cuobjdump is not in every CUDA toolkit install (this machine's has only nvcc and ptxas); the
PyPI wheel nvidia-cuda-cuobjdump carries it (nvidia/cu13/bin/cuobjdump): CUOBJDUMP=path.

A loop is a backward branch's range [target, branch]; each HMMA/IMMA's hot loop is the smallest
loop around it, and a spill instruction (LDL/STL) counts as hot when it lies in a hot loop (it
then runs on every iteration that issues the MMAs, unless branched around). Prints one line per kernel with spills:
LDL/STL total, in a hot loop, and the largest hot loop's size in instructions. Exit 1 when a
kernel has spills in its innermost MMA loop and --fail-hot is given."""
import os
import re
import subprocess
import sys

INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRA = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\d+,\s*)?(0x[0-9a-f]+)")


def kernels(text):
    fn, out = None, {}
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            fn = m.group(1)
            out[fn] = []
            continue
        m = INS.match(line)
        if m and fn:
            out[fn].append((int(m.group(1), 16), m.group(2)))
    return out


def analyse(ins):
    spills = [a for a, t in ins if re.search(r"\b(LDL|STL)\b", t)]
    if not spills:
        return None
    mma = [a for a, t in ins if re.search(r"\b(HMMA|IMMA)\b", t)]
    loops = []
    for a, t in ins:
        m = BRA.search(t)
        if m and int(m.group(1), 16) < a:
            loops.append((int(m.group(1), 16), a))
    # each MMA's innermost loop: the smallest range around it
    hot_loops = set()
    for x in mma:
        around = [l for l in loops if l[0] <= x <= l[1]]
        if around:
            hot_loops.add(min(around, key=lambda l: l[1] - l[0]))
    hot = [a for a in spills if any(lo <= a <= hi for lo, hi in hot_loops)]
    size = max(((hi - lo) // 16 + 1 for lo, hi in hot_loops), default=0)
    return len(spills), len(hot), size


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 1:
        sys.exit(__doc__)
    path = args[0]
    if path.endswith(".sass"):
        text = open(path).read()
    else:
        tool = os.environ.get("CUOBJDUMP", "cuobjdump")
        text = subprocess.run([tool, "-sass", path], check=True, capture_output=True,
                              text=True).stdout
    hot_any = 0
    for fn, ins in sorted(kernels(text).items()):
        r = analyse(ins)
        if r:
            n, hot, size = r
            hot_any |= hot > 0
            print(f"{fn}: {n} LDL/STL, {hot} in an MMA loop"
                  + (f" ({size} instructions)" if size else " (no MMA loop)"))
    return 1 if hot_any and "--fail-hot" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
