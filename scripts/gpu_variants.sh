# Sourced by the A/B scripts (gpu_ab.sh, gpu2_ab.sh) after gpu_build.sh: variant A is this tree,
# variant B1, B2, ... a copy of it with the patch given as the 1st, 2nd, ... argument applied
# (`git diff main > change.patch` on a checkout of main; patches travel as untracked files).
#   build_variants "TARGET ..." PATCH...
# fills names[] and roots[] and builds the TARGETs of every variant side by side (each build is
# mostly one long nvcc compile), appending to LOG=$log; it exits on a patch that does not apply or
# a build that fails. Variant Bi is built in $MEGAMOE_AB_SCRATCH/Bi/build-gpu (default: a fresh
# temporary folder), so that a later command of the same device call can run its binaries.
build_variants() {
  local targets=($1)
  shift
  names=(A)
  roots=("$root")
  local scratch
  scratch=${MEGAMOE_AB_SCRATCH:-$(mktemp -d)}
  mkdir -p "$scratch"
  for i in $(seq 1 $#); do
    local patch_file variant
    patch_file=$(realpath "${!i}")
    variant=$scratch/B$i
    cp -r "$root" "$variant" && rm -rf "$variant/build-gpu"
    (cd "$variant" && patch -p1 --quiet <"$patch_file") || { echo "B$i: $patch_file does not apply" | tee -a "$log"; exit 1; }
    echo "B$i = A + $(basename "$patch_file")" | tee -a "$log"
    names+=("B$i")
    roots+=("$variant")
  done
  local pids=()
  for v in "${!names[@]}"; do
    (root=${roots[$v]} build=${roots[$v]}/build-gpu gpu_build "$scratch/build.${names[$v]}.log" "${targets[@]}") &
    pids+=($!)
  done
  for v in "${!names[@]}"; do
    wait "${pids[$v]}" || { cat "$scratch/build.${names[$v]}.log" >>"$log"; echo "${names[$v]}: build failed" | tee -a "$log"; exit 1; }
  done
}
