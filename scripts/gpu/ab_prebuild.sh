#!/usr/bin/env bash
# Run here, on a machine without a GPU but with nvcc, before a device A/B: builds the TARGETs
# (default "megamoe-bench test_api_moe_layer", what gpu_ab.sh with MEGAMOE_AB_TESTS runs;
# gpu2_ab.sh needs "megamoe-run megamoe-ep-bench comm_ep_layer_rank") of the tree as it is (A) and
# of the tree with each PATCH applied (B1, B2, ...; the variants of scripts/gpu/gpu_variants.sh), and
# leaves the binaries with their sources' hash in .ab-prebuilt/variants.tar.xz (ignored by git; xz
# keeps a variant under ~1 MB instead of ~7, so that .deps travels beside it within the carry
# limit). The device call then carries ".ab-prebuilt" and runs the A/B with
# MEGAMOE_AB_PREBUILT=.ab-prebuilt: each variant whose sources still hash the same takes its
# binaries instead of building them there.
#   MEGAMOE_AB_TARGETS="..." scripts/gpu/ab_prebuild.sh CHANGE.patch|flags:ARGS ...
# (MEGAMOE_TORCH=OFF where this machine has no PyTorch: the targets above do not need it.)
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: ab_prebuild.sh CHANGE.patch|flags:ARGS ..."; exit 2; }
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/ab_prebuild.log
# shellcheck source=gpu_variants.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_variants.sh"
read -ra targets <<<"${MEGAMOE_AB_TARGETS:-megamoe-bench test_api_moe_layer}"
prebuilt=$root/.ab-prebuilt
scratch=$(mktemp -d "${TMPDIR:-/tmp}/ab-prebuild.XXXXXX") || exit 1
trap 'rm -rf "$scratch"' EXIT
staging=$scratch/prebuilt
rm -rf "$prebuilt"
# Build here (A in build-gpu, incrementally; the others afresh), whatever was carried in before.
MEGAMOE_AB_PREBUILT='' MEGAMOE_AB_SCRATCH=$scratch build_variants "${targets[*]}" "$@"
for v in "${!names[@]}"; do
  [ -n "${flags[$v]}" ] && continue  # runs A's binaries
  mkdir -p "$staging/${names[$v]}"
  for t in "${targets[@]}"; do
    binary=$(target_binary "${roots[$v]}/build-gpu" "$t")
    [ -n "$binary" ] || { echo "${names[$v]}: $t was not built" | tee -a "$log"; exit 1; }
    mkdir -p "$staging/${names[$v]}/$(dirname "$binary")"
    cp "${roots[$v]}/build-gpu/$binary" "$staging/${names[$v]}/$binary"
  done
  source_hash "${roots[$v]}" >"$staging/${names[$v]}/source_hash"
done
mapfile -t packed < <(ls "$staging")
mkdir -p "$prebuilt" && tar -cJf "$prebuilt/variants.tar.xz" -C "$staging" "${packed[@]}" || exit 1
echo "$(du -h "$prebuilt/variants.tar.xz" | cut -f1) in $prebuilt/variants.tar.xz (${packed[*]}: ${targets[*]};" \
  "flags: variants run A's);" \
  "carry \".ab-prebuilt\" and set MEGAMOE_AB_PREBUILT=.ab-prebuilt for gpu_ab.sh / gpu2_ab.sh with the same patches"
