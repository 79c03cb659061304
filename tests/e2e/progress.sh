#!/usr/bin/env bash
# Progress an operator can watch (README "Progress."):
#  1. `quern run` under a pseudo-terminal, on a job whose requests all finish at the end: the
#     live line changes at least once a second, shows generated tok/s > 0 while 0 requests
#     have finished, fits the terminal, and the last thing on the screen is the summary line;
#  2. not a terminal: `run --progress 0.5` logs "progress: key=value" lines half a second
#     apart (parsed), and `status --watch --progress 0.5` in another process does the same
#     from the queue, ending with the summary when the job is done;
#  3. `status --json` against the queue itself (sqlite3): counts, tokens and the live run's
#     facts (run id, pid, host, live rates) mid-run, and the totals at the end;
#  4. `status --watch` under a pseudo-terminal with TERM=dumb and NO_COLOR: live frames with
#     no escape sequence at all, and Ctrl-C ends it with exit 0 and the summary line.
# Under sanitizers (QUERN_SANITIZE) timing is not asserted.
set -euo pipefail
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
tmp=$(mktemp -d)
bg=()
trap 'for p in "${bg[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
cd "$tmp"
fail() { echo "FAIL: $*" >&2; exit 1; }

SAN=${QUERN_SANITIZE:-}
N=24 TOK=96 TOK2=256 # job two lasts long enough for step 4's watch on fast CPUs (AMX: exact
# mode at ~770 tok/s finished 24 x 128 tokens before that watch's Ctrl-C)
# N requests that all run at once and stop at max_tokens together (counting never ends early)
make_job() {
    python3 - "$1" "$N" "$2" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"Count: {i}, {i + 1}, {i + 2},",
                            "max_tokens": int(sys.argv[3]), "temperature": 0}) + "\n")
PY
}
make_job one.jsonl $TOK
make_job two.jsonl $TOK2
"$Q" submit --db p.db --model "$M" --name one one.jsonl >/dev/null 2>&1 || fail "submit one"
"$Q" submit --db p.db --model "$M" --name two two.jsonl >/dev/null 2>&1 || fail "submit two"
# --matmul exact: the jobs are sized so a run lasts several seconds at exact mode's pace (the
# checks watch it live); the faster default modes finish them before the watchers look.
RUN=(--out out --max-seqs 32 --threads 2 --matmul exact)

# pty_capture.py OUT.json SECS ENV... -- CMD...: run CMD with stdin/stderr on a pty of 100
# columns (stdout too when STDOUT_PTY=1 is among ENV, else to OUT.stdout), SIGINT after SECS
# (0: never), record every read as [time, text]
cat >pty_capture.py <<'PY'
import fcntl, json, os, pty, select, signal, struct, subprocess, sys, termios, time
out, secs = sys.argv[1], float(sys.argv[2])
i = sys.argv.index("--")
env = dict(os.environ)
env.pop("NO_COLOR", None)
for kv in sys.argv[3:i]:
    k, v = kv.split("=", 1)
    env[k] = v
cmd = sys.argv[i + 1:]
m, s = pty.openpty()
fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
so = s if env.get("STDOUT_PTY") == "1" else open(out + ".stdout", "w")
t0 = time.time()
p = subprocess.Popen(cmd, stdin=s, stdout=so, stderr=s, env=env)
os.close(s)
ev, sent = [], False
while True:
    if secs and not sent and time.time() - t0 >= secs:
        p.send_signal(signal.SIGINT)
        sent = True
    r, _, _ = select.select([m], [], [], 0.05)
    if r:
        try:
            d = os.read(m, 65536)
        except OSError:
            d = b""
        if not d:
            break
        ev.append([time.time() - t0, d.decode("utf-8", "replace")])
    elif p.poll() is not None:
        break
json.dump({"rc": p.wait(), "events": ev}, open(out, "w"))
PY

# frames.py: the lines drawn in a capture, each [time, text without escape sequences, raw]
cat >frames.py <<'PY'
import json, re
ESC = re.compile(r"\x1b\[[0-9;?]*[@-~]")
def frames(path):
    cap = json.load(open(path))
    out, cur, t_cur = [], "", 0.0
    for t, d in cap["events"]:
        for ch in re.split(r"(\r|\n)", d):
            if ch in ("\r", "\n"):
                if cur.strip():
                    out.append([t_cur, ESC.sub("", cur).rstrip(), cur])
                cur = ""
            elif ch:
                if not cur:
                    t_cur = t
                cur += ch
    if cur.strip():
        out.append([t_cur, ESC.sub("", cur).rstrip(), cur])
    return cap["rc"], out
def rate(s):
    m = re.search(r"gen ([0-9.]+)(k|M)? tok/s", s)
    return float(m.group(1)) * {None: 1, "k": 1e3, "M": 1e6}[m.group(2)] if m else None
def count(s):
    m = re.search(r"(\d+)/(\d+) \d+%", s)
    return (int(m.group(1)), int(m.group(2))) if m else None
PY

# 1. the live line of `quern run` on a terminal
python3 pty_capture.py run1.json 0 TERM=xterm -- "$Q" run --db p.db --job one "${RUN[@]}"
python3 - run1.json "$N" "$SAN" <<'PY' || fail "1: live display"
import sys
sys.path.insert(0, ".")
from frames import frames, rate, count
rc, fr = frames(sys.argv[1])
n, san = int(sys.argv[2]), sys.argv[3]
assert rc == 0, f"run exited {rc}"
live = [f for f in fr if count(f[1]) and rate(f[1]) is not None]
assert len(live) >= 2, f"only {len(live)} live frames: {fr}"
for t, text, raw in live:
    assert len(text) <= 99, f"frame wider than the terminal: {text!r}"
    assert "\x1b[K" in raw, f"not redrawn in place: {raw!r}"
    assert count(text)[1] == n, text
last = fr[-1][1]
assert last.startswith(f"quern run: job one: {n}/{n} finished (0 failed"), f"last line: {last!r}"
# the summary is drawn over the live line: nothing after it but its newline
t_end = fr[-1][0]
early = [f for f in live if count(f[1])[0] == 0 and rate(f[1]) > 0]
assert early, "no frame with generated tok/s > 0 before the first request finished"
changes = [live[0]] + [b for a, b in zip(live, live[1:]) if a[1] != b[1]]
span = t_end - live[0][0]
gaps = [b[0] - a[0] for a, b in zip(changes + [[t_end]], (changes + [[t_end]])[1:])]
print(f"run: {len(changes)} distinct frames over {span:.1f} s (max gap {max(gaps):.2f} s), "
      f"first frame with tok/s {rate(early[0][1])} at 0/{n} finished")
if not san:
    assert len(changes) >= int(span), f"{len(changes)} distinct frames in {span:.1f} s"
    assert max(gaps) < 2.0, f"the display stood still for {max(gaps):.2f} s"
PY

# 2-4. job two runs in another process (not a terminal): log lines, status --json, --watch
"$Q" run --db p.db --job two "${RUN[@]}" --progress 0.5 --flush-secs 1000 >run2.json \
    2>run2.log &
run_pid=$!
bg+=("$run_pid")
"$Q" status --db p.db --job two --watch --progress 0.5 >watch.log 2>watch.err &
watch_pid=$!
bg+=("$watch_pid")
# wait until the run has published live numbers
for _ in $(seq 1 600); do
    "$Q" status --db p.db --job two --json 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)[0]["runs"]
sys.exit(0 if r and r[0]["progress"] and r[0]["progress"]["gen_tok_s"] > 0 else 1)' && break
    sleep 0.1
done
# 3a. mid-run: nothing commits before the end (--flush-secs 1000), so the queue holds still
"$Q" status --db p.db --job two --json >mid.json || fail "3: status --json mid-run"
python3 - mid.json p.db "$run_pid" "$N" <<'PY' || fail "3: status --json mid-run vs the queue"
import json, socket, sqlite3, sys
s = json.load(open(sys.argv[1]))[0]
db = sqlite3.connect(sys.argv[2])
pid, n = int(sys.argv[3]), int(sys.argv[4])
jid = db.execute("SELECT id FROM jobs WHERE name = 'two'").fetchone()[0]
assert s["id"] == jid and s["items"] == n, s
for st, c in db.execute("SELECT state, count(*) FROM items WHERE job_id = ? GROUP BY state",
                        (jid,)):
    assert s["by_state"][st] == c, (st, c, s["by_state"])
assert s["by_state"]["leased"] == n and s["state"] == "running", s
rid, host, rpid, started, prog = db.execute(
    "SELECT id, host, pid, started, progress_json FROM runs WHERE ended IS NULL AND job_id = ?",
    (jid,)).fetchone()
assert len(s["runs"]) == 1, s["runs"]
r = s["runs"][0]
assert (r["run_id"], r["host"], r["pid"], r["started_ms"]) == (rid, host, pid, started), r
assert host == socket.gethostname() and 0 <= r["heartbeat_age_s"] < 5 and not r["stale"], r
p = r["progress"]
stored = json.loads(prog)
assert p["job_id"] == jid and p["total"] == n and p["kv_total"] > 0, p
assert p["running"] == n and 0 < p["kv_used"] <= p["kv_total"], p
assert p["gen_tok_s"] > 0 and p["gen_tokens"] > 0, p
assert p["eta_s"] is None and p["done"] == 0, p  # no request has finished: ETA unknown
assert stored["job_id"] == jid and stored["gen_tokens"] >= p["gen_tokens"], stored
live = s["live"]
assert live["runs"] == 1 and live["gen_tok_s"] == p["gen_tok_s"], live
assert live["running"] == p["running"] and live["kv_total"] == p["kv_total"], live
assert s["eta_s"] is None and s["eta_basis"] is None, s
print(f"status --json mid-run: run {rid} pid {pid}, gen {p['gen_tok_s']:.1f} tok/s, "
      f"{p['running']} running, KV {p['kv_used']}/{p['kv_total']}")
PY

# 4. status --watch on a terminal, TERM=dumb and NO_COLOR: Ctrl-C after 1.5 s
python3 pty_capture.py watch.json 1.5 TERM=dumb NO_COLOR=1 STDOUT_PTY=1 -- \
    "$Q" status --db p.db --job two --watch
python3 - watch.json "$N" "$SAN" <<'PY' || fail "4: status --watch on a terminal"
import json, sys
sys.path.insert(0, ".")
from frames import frames, rate, count
rc, fr = frames(sys.argv[1])
n = int(sys.argv[2])
assert rc == 0, f"status --watch exited {rc} on SIGINT"
raw = "".join(d for _, d in json.load(open(sys.argv[1]))["events"])
assert "\x1b" not in raw, f"escape sequences with TERM=dumb NO_COLOR: {raw!r}"
live = [f for f in fr if count(f[1]) and rate(f[1]) is not None]
assert live and any(rate(f[1]) > 0 for f in live), fr
last = fr[-1][1]
assert last.startswith("quern status: job two: "), last
# interrupted by the Ctrl-C; a sanitizer build may see the job end first
assert last.endswith("(interrupted)") or (sys.argv[3] and f"{n}/{n} finished" in last), last
print(f"status --watch (pty): {len(live)} frames, last: {last}")
PY

wait "$run_pid" || { cat run2.log; fail "2: run of job two"; }
wait "$watch_pid" || { cat watch.err; fail "2: status --watch exited non-zero"; }
bg=()

# 2. log lines of the run and of the watcher
python3 - run2.log watch.log "$N" "$SAN" <<'PY' || fail "2: log lines"
import re, sys
n, san = int(sys.argv[3]), sys.argv[4]
def parse(path, prefix):
    rows = []
    for line in open(path):
        if line.startswith(prefix):
            kv = dict(f.split("=", 1) for f in line[len(prefix):].split())
            rows.append(kv)
    return rows
for path, prefix, who in ((sys.argv[1], "quern info: progress: ", "run"),
                          (sys.argv[2], "progress: ", "status --watch")):
    rows = parse(path, prefix)
    assert len(rows) >= 3, f"{who}: {len(rows)} progress lines"
    keys = {"job", "done", "failed", "cancelled", "total", "pct", "gen_tok_s", "prompt_tok_s",
            "gen_tokens", "prompt_tokens", "running", "waiting", "kv_pct", "runs", "elapsed_s",
            "eta_s"}
    for r in rows:
        assert set(r) == keys, (who, sorted(r))
        assert r["job"] == "two" and int(r["total"]) == n, (who, r)
        assert r["eta_s"] == "--" or float(r["eta_s"]) >= 0, (who, r)
    el = [float(r["elapsed_s"]) for r in rows]
    gaps = [b - a for a, b in zip(el, el[1:])]
    print(f"{who}: {len(rows)} lines, gaps {min(gaps):.2f}..{max(gaps):.2f} s, "
          f"mean {sum(gaps) / len(gaps):.2f} s")
    if who == "run":
        assert any(int(r["done"]) == 0 and float(r["gen_tok_s"]) > 0 for r in rows), rows
    # a fixed 0.5 s cadence: a line is due every half second, written after the step that
    # passes it (the watcher sleeps 0.25 s at most)
    mean = sum(gaps) / len(gaps)
    if not san:
        assert 0.4 <= mean <= 0.7 and max(gaps) < 1.5, (mean, gaps)
    if who == "status --watch":
        assert any(float(r["gen_tok_s"]) > 0 for r in rows), rows
last = [l for l in open(sys.argv[2]) if l.strip()][-1]
assert last.startswith(f"quern status: job two: {n}/{n} finished (0 failed"), last
run_last = [l for l in open(sys.argv[1]) if l.strip()][-1]
assert run_last.startswith(f"quern info: job two: {n}/{n} finished (0 failed"), run_last
PY

# 3b. at the end: totals against the queue, no live run left
"$Q" status --db p.db --json >end.json || fail "3: status --json at the end"
python3 - end.json p.db <<'PY' || fail "3: status --json at the end vs the queue"
import json, sqlite3, sys
jobs = json.load(open(sys.argv[1]))
db = sqlite3.connect(sys.argv[2])
assert len(jobs) == 2, jobs
for s in jobs:
    n, pt, ct = db.execute("SELECT count(*), total(prompt_tokens), total(completion_tokens)"
                           " FROM items WHERE job_id = ? AND state = 'done'", (s["id"],)).fetchone()
    assert s["state"] == "done" and s["by_state"]["done"] == n == s["items"], s
    assert s["prompt_tokens"] == pt and s["completion_tokens"] == ct, (s, pt, ct)
    assert s["eta_s"] == 0 and s["runs"] == [] and s["live"]["runs"] == 0, s
    summary = json.loads(db.execute("SELECT summary_json FROM runs WHERE job_id = ? AND kind ="
                                    " 'run' ORDER BY id DESC", (s["id"],)).fetchone()[0])
    assert summary["completion_tokens"] == ct, (summary, ct)
assert db.execute("SELECT count(*) FROM runs WHERE ended IS NULL").fetchone()[0] == 0
PY
echo "e2e progress: ok"
