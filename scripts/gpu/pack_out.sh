#!/usr/bin/env bash
# Run last in a device call that chains several scripts: only 8 files come back from $OUT, and
# the checks' logs alone are more (a benchmark JSON was lost that way once). Keeps
# the JSON results and the files named on the command line as they are, packs every other file
# into logs.tar.gz, and lists what it packed.
#   bash scripts/gpu/pack_out.sh [FILE_TO_KEEP ...]
set -uo pipefail
out=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/gpu-logs}
[ -d "$out" ] || { echo "pack_out.sh: no $out"; exit 1; }
cd "$out" || exit 1
keep=("$@")
packed=()
while IFS= read -r -d '' file; do
  file=${file#./}
  [[ $file == *.json || $file == logs.tar.gz ]] && continue
  for k in "${keep[@]}"; do [ "$file" = "$k" ] && continue 2; done
  packed+=("$file")
done < <(find . -type f -print0)
[ ${#packed[@]} -gt 0 ] || { echo "pack_out.sh: nothing to pack"; exit 0; }
tar czf logs.tar.gz "${packed[@]}" && rm -f "${packed[@]}" && find . -mindepth 1 -type d -empty -delete
echo "pack_out.sh: ${#packed[@]} files into $out/logs.tar.gz: ${packed[*]}"
