#!/usr/bin/env bash
# Install tools/requirements-test.txt into DIR (default build-py) with pip --target, once: a
# stamp holding the requirements' sha256 marks a finished install. No virtual environment is
# needed (the tests put DIR on PYTHONPATH), so any python3 with pip will do.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-build-py}
REQ=tools/requirements-test.txt
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ -f "$DIR/.stamp" ] && [ "$(cat "$DIR/.stamp")" = "$want" ]; then exit 0; fi
rm -rf "$DIR.tmp"
py=$(command -v python3 || command -v python)
"$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$DIR.tmp" -r "$REQ" 2>&1 | grep -v "dependency resolver\|requires pydantic\|as the 'root' user" || true
PYTHONPATH="$DIR.tmp" "$py" -c 'import openai, jsonschema, rfc3339_validator, prometheus_client' ||
    { echo "pydeps: install into $DIR failed" >&2; exit 1; }
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "$want" > "$DIR/.stamp"
echo "pydeps: installed $(grep -c '==' "$REQ") packages into $DIR"
