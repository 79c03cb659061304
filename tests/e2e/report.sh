#!/usr/bin/env bash
# quern report, with the real binary and model:
#  1. a job with two bad lines, a run killed with -9 and a run that finishes: the report has
#     every section, is self-contained (no script, no link, no src, nothing fetched; every
#     SVG well-formed), and its figures are status --json's (items by state, tokens, errors
#     by code), its P50/P90/P99 the nearest-rank percentiles of the items' stored latencies
#     and lengths, its runs the queue's (the killed one marked), its cost run hours x price;
#  2. headless Chromium renders it at desktop and phone widths without a console message or a
#     failed load, prints it to a PDF of several pages, and its DOM has every section;
#  3. a partitioned queue's report covers every part.
set -euo pipefail
Q=$(realpath "${QUERN_BIN:-bin/quern}")
M=$(realpath "${QUERN_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
EX=$(realpath examples/prompts.jsonl)
. "$(dirname "$0")/lib/common.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
e2e_workdir
# The first run must still be working when it has recorded a second sample (every 5 s): N
# requests of the examples (cycled, max_tokens MAXT) on one thread, ~30 s of work in the normal
# build here; the kill's check below says so when a faster machine finishes first.
N=171 MAXT=64
[ -n "${QUERN_SANITIZE:-}" ] && N=96 MAXT=48
CHROME=$(command -v chromium || command -v chromium-browser || true)
[ -n "$CHROME" ] || fail "chromium is needed (make test installs it: tools/install_deps.sh test)"
python3 - "$EX" "$N" "$MAXT" >in.jsonl <<'PY'
import json, sys
ex = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for i in range(int(sys.argv[2])):
    r = dict(ex[i % len(ex)])
    r["custom_id"] = f"{r['custom_id']}-{i}"
    if "body" in r:
        r["body"] = dict(r["body"], max_tokens=int(sys.argv[3]))
    else:
        r["max_tokens"] = int(sys.argv[3])
    print(json.dumps(r))
print(json.dumps({"custom_id": "bad1", "prompt": "x", "max_tokens": -3}))
print("not json")
# (an output audit: the error's field path, cut at its 160-byte cap inside a character, left a
# bare byte in the report; text from users' files is well-formed UTF-8 there now)
print(json.dumps({"custom_id": "bad2", "prompt": "x", "max_tokens": 1, "\u00e9" * 100: 1}))
PY
"$Q" submit --db q.db --name jr --model "$M" in.jsonl >/dev/null 2>&1 || fail submit
RUN=(--threads 1 --max-seqs 8 --flush-records 2 --flush-secs 0.2)
"$Q" run --db q.db "${RUN[@]}" >/dev/null 2>r1.err &
p=$!
pids+=("$p")
kill_after_second_sample q.db "$p" 3
"$Q" run --db q.db "${RUN[@]}" >/dev/null 2>r2.err || { cat r2.err >&2; fail "second run"; }
"$Q" report --db q.db --job jr --out report.html --cost-per-hour 3 2>rep.err ||
    { cat rep.err >&2; fail "report"; }
python3 -c 'open("report.html", "rb").read().decode("utf-8")' || fail "the report is not UTF-8"
set +e # a queue file without --job is a usage error (2), and writes nothing
"$Q" report --db q.db --out nojob.html 2>/dev/null
rc=$?
set -e
[ $rc -eq 2 ] && [ ! -e nojob.html ] || fail "report without --job: exit $rc, want 2"
# (a crash-safety audit) the temporary file of a report killed on this host is removed by the
# next one (its tag names a process that is gone), those of live processes and other hosts
# kept; a replaced report keeps its permissions (0600 became 0644)
ns=$(readlink /proc/$$/ns/pid | tr -dc 0-9)
boot=$(head -c 12 /proc/sys/kernel/random/boot_id)
ticks=$(sed 's/.*) //' /proc/$$/stat | cut -d' ' -f20)
dead=$(sh -c 'echo $$')
touch ".report.html.tmp.$dead.1.$ns.$boot.$(hostname)" ".report.html.tmp.$$.$ticks.$ns.$boot.$(hostname)" \
    ".report.html.tmp.$dead.1.$ns.$boot.not-$(hostname)"
chmod 600 report.html
"$Q" report --db q.db --job jr --out report.html --cost-per-hour 3 2>rep.err || fail "report again"
[ "$(ls -A | grep -c '^\.report\.html\.tmp\.')" = 2 ] && [ ! -e ".report.html.tmp.$dead.1.$ns.$boot.$(hostname)" ] ||
    fail "temp files after a report: $(ls -A | grep tmp)"
[ "$(stat -c %a report.html)" = 600 ] || fail "report.html became $(stat -c %a report.html)"
rm -f .report.html.tmp.*
"$Q" status --db q.db --json >st.json 2>/dev/null
sqlite3 -json q.db "SELECT state, prompt_tokens, completion_tokens, ttft_ms, tpot_ms FROM items" >items.json
sqlite3 -json q.db "SELECT id, started, ended, heartbeat, exit_reason FROM runs WHERE kind = 'run'" >runs.json

python3 - <<'PY' || fail "report contents"
import json, math, re, xml.dom.minidom
from html.parser import HTMLParser
t = open("report.html").read()

class P(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.tags, self.attrs, self.k, self.cur = set(), set(), [], {}, None
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        self.attrs += [(tag, k, v) for k, v in attrs]
        if "id" in a:
            self.ids.add(a["id"])
        self.cur = a.get("data-k")
    def handle_data(self, d):
        if self.cur:
            self.k[self.cur] = d
            self.cur = None
p = P()
p.feed(t)
need = {"summary", "throughput", "load", "latency", "lengths", "errors", "parts", "runs", "cost",
        "ttft", "tpot", "prompt_len", "output_len"}
assert need <= p.ids, need - p.ids
assert not ({"script", "link", "img", "iframe", "object"} & p.tags), p.tags
assert not [a for a in p.attrs if a[1] in ("src", "href")], "a reference to something else"
assert "url(" not in t and "@import" not in t
assert set(re.findall(r"https?://[^\"' ]+", t)) == {"http://www.w3.org/2000/svg"}
svgs = re.findall(r"<svg.*?</svg>", t, re.S)
assert len(svgs) == 7, len(svgs)
for s in svgs:
    xml.dom.minidom.parseString(s)
num = lambda k: float(p.k[k])
j = json.load(open("st.json"))[0]
bs = j["by_state"]
assert num("items") == j["items"] and num("done") == bs["done"] and num("failed") == bs["failed"]
assert num("cancelled") == bs["cancelled"] and num("unfinished") == bs["queued"] + bs["leased"] == 0
assert num("prompt_tokens") == j["prompt_tokens"] and num("completion_tokens") == j["completion_tokens"]
for code, n in j["errors"].items():
    assert num("error_" + code) == n, code
assert sum(j["errors"].values()) == 3
items = json.load(open("items.json"))
def pct(v, q):
    v = sorted(v)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]
done = [i for i in items if i["state"] == "done"]
cols = {"ttft": [i["ttft_ms"] for i in done if i["ttft_ms"]],
        "tpot": [i["tpot_ms"] for i in done if i["tpot_ms"]],
        "prompt_len": [i["prompt_tokens"] for i in done],
        "output_len": [i["completion_tokens"] for i in done]}
for name, v in cols.items():
    assert len(v) > 0, name
    for q in (50, 90, 99):
        want, got = pct(v, q), num(f"{name}_p{q}")
        assert abs(got - want) <= 1e-3 * abs(want) + 1e-9, (name, q, got, want)
runs = json.load(open("runs.json"))
assert len(runs) == 2 and runs[0]["exit_reason"] == "dead" and runs[1]["exit_reason"] == "drained", runs
rows = re.findall(r'<section id="runs">.*?</section>', t, re.S)[0]
assert rows.count("<tr>") == 3 and ">dead<" in rows and ">drained<" in rows
# each run's engine, as it recorded it
assert rows.count("matmul ") == 2 and "unknown" not in rows, rows
# a run found dead stopped at its last heartbeat, not when another run noticed
end = lambda r: r["heartbeat"] if r["exit_reason"] == "dead" else (r["ended"] or r["heartbeat"])
hours = sum((end(r) - r["started"]) / 3.6e6 for r in runs)
assert abs(num("run_hours") - hours) < 1e-3, (num("run_hours"), hours)
assert abs(num("cost") - 3 * hours) <= 1e-3 * 3 * hours + 1e-4
assert abs(num("cost_per_mtok") - num("cost") / (num("completion_tokens") / 1e6)) <= 1e-3 * num("cost_per_mtok")
thr = re.findall(r'<section id="throughput">.*?</section>', t, re.S)[0]
assert 'class="run-killed"' in thr, "the killed run is not marked"
pts = re.findall(r'<polyline class="line1" points="([^"]+)"', thr)[0].split()
ys = [float(q.split(",")[1]) for q in pts]
assert min(ys) < max(ys), "no throughput drawn"
PY

# ---- Chromium: desktop and phone, no console message, every section in its DOM ------------
for w in 1280 390; do
    timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars \
        --enable-logging=stderr --v=0 --window-size=$w,2400 --screenshot="shot$w.png" \
        "file://$tmp/report.html" >"chrome$w.out" 2>"chrome$w.err" || { cat "chrome$w.err" >&2; fail "chromium at $w px"; }
    if grep -E "CONSOLE|Uncaught|Failed to load|ERR_" "chrome$w.err"; then fail "chromium reported a problem at $w px"; fi
    python3 -c 'import sys; d=open(sys.argv[1],"rb").read(); assert d[:8]==b"\x89PNG\r\n\x1a\n" and len(d)>20000, len(d)' "shot$w.png" ||
        fail "screenshot at $w px"
done
# printed: Chromium's print to PDF gives a document of more than one page
timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --no-pdf-header-footer \
    --print-to-pdf="$tmp/report.pdf" "file://$tmp/report.html" >/dev/null 2>pdf.err ||
    { cat pdf.err >&2; fail "chromium --print-to-pdf"; }
python3 -c 'import re,sys; d=open(sys.argv[1],"rb").read(); assert d[:5]==b"%PDF-", d[:8]; n=len(re.findall(rb"/Type\s*/Page[^s]", d)); assert n >= 2, n' report.pdf ||
    fail "the printed report"
timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --dump-dom "file://$tmp/report.html" \
    >dom.html 2>/dev/null || fail "chromium --dump-dom"
for id in summary throughput load latency lengths errors parts runs cost; do
    grep -q "<section id=\"$id\">" dom.html || fail "section $id not in Chromium's DOM"
done

# ---- a partitioned queue --------------------------------------------------------------------
head -12 "$EX" >p.jsonl
"$Q" submit --db P --partitions 2 --name jp --model "$M" --max-tokens 8 p.jsonl >/dev/null 2>&1 || fail "submit parts"
"$Q" run --db P "${RUN[@]}" >/dev/null 2>&1 || fail "run parts"
"$Q" report --db P --out parts.html 2>/dev/null || fail "report of parts"
python3 - <<'PY' || fail "parts report"
import re
t = open("parts.html").read()
sec = re.findall(r'<section id="parts">.*?</section>', t, re.S)[0]
rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td>", sec)
assert [r[0] for r in rows] == ["0", "1"], rows
assert sum(int(r[4]) for r in rows) == 12 and all(r[1] == r[4] for r in rows), rows
assert re.search(r'data-k="items">12<', t) and re.search(r'data-k="done">12<', t)
PY
echo "report: ok"
