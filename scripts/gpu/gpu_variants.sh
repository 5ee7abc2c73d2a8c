# shellcheck shell=bash disable=SC2154  # log, root: set by the sourcing script
# Sourced by the A/B scripts (gpu_ab.sh, gpu2_ab.sh, ab_prebuild.sh) after gpu_build.sh: variant A
# is this tree, variant B1, B2, ... a copy of it with the patch given as the 1st, 2nd, ... argument
# applied (`git diff main > change.patch` on a checkout of main; patches travel as untracked files),
# or, for an argument flags:ARGS, A's own binaries run with the extra bench arguments ARGS, separated
# by commas or spaces (flags:--token-tile=32,--fc1-token-rows=row_copy: options of megamoe-bench,
# nothing to build).
#   build_variants "TARGET ..." VARIANT...
# fills names[], roots[] and flags[] (each variant's extra bench arguments, one word each, empty but
# for flags: variants; the scripts append ${flags[$v]} unquoted to the bench command) and builds the
# TARGETs of every variant side by side (each build is mostly one long nvcc compile), appending to
# LOG=$log; it exits on a patch that does not apply, a flags: argument holding something other than
# options, or a build that fails. Variant Bi is built in $MEGAMOE_AB_SCRATCH/Bi/build-gpu (default: a
# fresh temporary folder), so that a later command of the same device call can run its binaries.
# With MEGAMOE_AB_PREBUILT=DIR (a carried folder that scripts/gpu/ab_prebuild.sh filled on a machine
# without a GPU: DIR/variants.tar.xz), a variant whose sources hash as its source_hash there says
# takes its binaries from there instead of building them: device minutes go to measuring.

# The binary of target $2 under build folder $1, relative to it (empty if none).
target_binary() {
  (cd "$1" 2>/dev/null && find . -type f -name "$2" -perm -u+x | head -1 | cut -c3-)
}

# Puts variant $1's prebuilt binaries of TARGETs $2... into its build folder; fails (and says why)
# when there are none for these sources, or when they do not load here.
take_prebuilt() {
  local v=$1
  shift
  [ -n "${prebuilt_variants:-}" ] || return 1
  local from=$prebuilt_variants/${names[$v]} to=${roots[$v]}/build-gpu
  [ -f "$from/source_hash" ] || return 1
  if [ "$(source_hash "${roots[$v]}")" != "$(cat "$from/source_hash")" ]; then
    echo "${names[$v]}: the prebuilt binaries are of other sources; building" | tee -a "$log"
    return 1
  fi
  local t binary
  for t in "$@"; do
    binary=$(target_binary "$from" "$t")
    [ -n "$binary" ] || { echo "${names[$v]}: no prebuilt $t; building" | tee -a "$log"; return 1; }
    if ldd "$from/$binary" | grep -q "not found"; then
      echo "${names[$v]}: prebuilt $t does not load here; building" | tee -a "$log"
      return 1
    fi
    mkdir -p "$to/$(dirname "$binary")" && cp "$from/$binary" "$to/$binary"
  done
  echo "${names[$v]}: prebuilt binaries of $*" | tee -a "$log"
}

build_variants() {
  local -a targets
  read -ra targets <<<"$1"
  shift
  names=(A)
  roots=("$root")
  flags=("")
  local scratch
  scratch=${MEGAMOE_AB_SCRATCH:-$(mktemp -d)}
  mkdir -p "$scratch"
  for i in $(seq 1 $#); do
    local patch_file variant
    local -a words=()
    if [[ ${!i} == flags:* ]]; then
      read -ra words <<<"$(tr ',' ' ' <<<"${!i#flags:}")"
      # The scripts split ${flags[$v]} unquoted: options only, nothing a shell would glob.
      if [[ ${words[0]:-} != -* || ${words[*]} == *[\*\?\[]* ]]; then
        echo "B$i: '${!i}' is not flags:--OPTION[=VALUE][,--OPTION[=VALUE]...]" | tee -a "$log"
        exit 1
      fi
      names+=("B$i")
      roots+=("$root")
      flags+=("${words[*]}")
      echo "B$i = A with ${words[*]}" | tee -a "$log"
      continue
    fi
    patch_file=$(realpath "${!i}")
    variant=$scratch/B$i
    # The tree without its build folders and virtual environment (GBs with PyTorch); .deps comes along.
    # A copy left by an earlier call with the same scratch folder is replaced; its build folder stays,
    # and every copied file is stamped now (-m), so that nothing built from another patch survives.
    mkdir -p "$variant" && find "$variant" -mindepth 1 -maxdepth 1 ! -name build-gpu -exec rm -rf {} + &&
      tar -C "$root" --exclude=./.venv --exclude='./build*' --exclude=./.ab-prebuilt --exclude=./.gpu-prebuilt --exclude=./gpu-logs -cf - . |
      tar -C "$variant" -xmf -
    (cd "$variant" && patch -p1 --quiet <"$patch_file") || { echo "B$i: $patch_file does not apply" | tee -a "$log"; exit 1; }
    echo "B$i = A + $(basename "$patch_file")" | tee -a "$log"
    names+=("B$i")
    roots+=("$variant")
    flags+=("")
  done
  local prebuilt_variants=  # read by take_prebuilt
  if [ -f "${MEGAMOE_AB_PREBUILT:-}/variants.tar.xz" ]; then
    prebuilt_variants=$scratch/prebuilt
    mkdir -p "$prebuilt_variants" && tar -xJf "$MEGAMOE_AB_PREBUILT/variants.tar.xz" -C "$prebuilt_variants" ||
      prebuilt_variants=
  fi
  local pids=()
  for v in "${!names[@]}"; do
    if [ -n "${flags[$v]}" ] || take_prebuilt "$v" "${targets[@]}"; then  # a flags: variant runs A's binaries
      pids+=("")
      continue
    fi
    (root=${roots[$v]} build=${roots[$v]}/build-gpu gpu_build "$scratch/build.${names[$v]}.log" "${targets[@]}") &
    pids+=($!)
  done
  for v in "${!names[@]}"; do
    [ -z "${pids[$v]}" ] && continue
    wait "${pids[$v]}" || { cat "$scratch/build.${names[$v]}.log" >>"$log"; echo "${names[$v]}: build failed" | tee -a "$log"; exit 1; }
  done
}
