#!/usr/bin/env bash
# scripts/gpu/gpu_clocks.sh: a stand-in nvidia-smi's samples summed up (idle ones left out, the
# power cap counted), and no sampler where there is no nvidia-smi.
set -euo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/bin"
cat >"$dir/bin/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
printf '1980, 0, 75.10, Not Active\n1600, 100, 690.00, Active\n1700, 98, 650.00, Not Active\n1500, 100, 700.00, Active\n'
sleep 30
SMI
chmod +x "$dir/bin/nvidia-smi"
# shellcheck source=/dev/null
source "$script"
PATH="$dir/bin:$PATH" clock_sampling_start "$dir/clocks.csv"
sleep 1
clock_sampling_stop
summary=$(clock_summary "$dir/clocks.csv")
expected="SM clock while busy: 1600 MHz mean over 3 samples of 100 ms, 680 W mean, software power cap active in 2 (67%)"
[ "$summary" = "$expected" ] || { echo "FAILED: '$summary', expected '$expected'"; exit 1; }
# A PATH without nvidia-smi (a GPU machine has it in /bin or /usr/bin too): the sampler needs
# nothing else before it looks.
PATH="$dir/empty" clock_sampling_start "$dir/none.csv" 2>/dev/null || true
[ -z "$clock_sampler_pid" ] || { echo "FAILED: a sampler started without nvidia-smi"; exit 1; }
summary=$(clock_summary "$dir/none.csv")
[ "$summary" = "SM clock: no busy sample (0 samples)" ] || { echo "FAILED: '$summary' without samples"; exit 1; }
echo "gpu_clocks.sh sums up busy samples and the power cap"
