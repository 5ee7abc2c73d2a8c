# shellcheck shell=bash
# Sourced by the GPU scripts: samples the GPU's SM clock, utilization and software power cap while
# a command runs, and sums them up, so that a figure timed under the power cap says so (large
# batches run at ~1.6 GHz against 1.98, docs/decisions.md#h200-facts).
#   clock_sampling_start FILE   nvidia-smi writes a sample every 100 ms into FILE (CSV)
#   clock_sampling_stop         stops it
#   clock_summary FILE          one line: the busy samples' mean SM clock and how many had the
#                               software power cap active (busy: utilization of 50% or more)
# Without nvidia-smi, start does nothing and the summary says that nothing was sampled.

clock_sampler_pid=

clock_sampling_start() {
  : >"$1"
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=clocks.sm,utilization.gpu,power.draw,clocks_event_reasons.sw_power_cap \
    --format=csv,noheader,nounits -lms 100 >"$1" 2>/dev/null &
  clock_sampler_pid=$!
}

clock_sampling_stop() {
  [ -n "$clock_sampler_pid" ] || return 0
  kill "$clock_sampler_pid" 2>/dev/null || true
  wait "$clock_sampler_pid" 2>/dev/null || true  # its status is the kill's
  clock_sampler_pid=
}

clock_summary() {
  awk -F', *' '
    $1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ {
      ++samples
      if ($2 + 0 < 50) next
      ++busy; clock += $1; power += $3
      if ($4 == "Active") ++capped
    }
    END {
      if (busy == 0) { printf "SM clock: no busy sample (%d samples)\n", samples; exit }
      printf "SM clock while busy: %.0f MHz mean over %d samples of 100 ms, %.0f W mean, software power cap active in %d (%.0f%%)\n",
             clock / busy, busy, power / busy, capped, 100 * capped / busy
    }' "$1"
}
