#!/usr/bin/env bash
# scripts/gpu/pack_out.sh: JSON and named files stay, everything else (subfolders too) goes into
# logs.tar.gz, and nothing is lost.
set -euo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/sub"
echo a >"$dir/check.log"; echo b >"$dir/result.json"; echo c >"$dir/sub/san.log"; echo d >"$dir/keep.log"
OUT=$dir bash "$script" keep.log
[ -f "$dir/result.json" ] && [ -f "$dir/keep.log" ] && [ -f "$dir/logs.tar.gz" ] || { echo "missing a kept file"; exit 1; }
[ ! -e "$dir/check.log" ] && [ ! -e "$dir/sub" ] || { echo "a packed file was left behind"; exit 1; }
[ "$(tar xzOf "$dir/logs.tar.gz" check.log)" = a ] && [ "$(tar xzOf "$dir/logs.tar.gz" sub/san.log)" = c ] ||
  { echo "packed contents differ"; exit 1; }
echo "pack_out.sh keeps JSON and named files, packs the rest"
