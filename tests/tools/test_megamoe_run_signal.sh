#!/bin/bash
# megamoe-run stopped by a signal (Ctrl-C, a CI job's timeout): its ranks, in process groups of
# their own, must stop with it, and its rendezvous folder go, instead of outliving it.
#   test_megamoe_run_signal.sh MEGAMOE_RUN WORK_DIR
set -u
run=$1 work=$2
rm -rf "$work"
mkdir -p "$work"
status=0

# Each rank writes its pid and folder, then sleeps far longer than the test runs.
rank_command="echo \$\$ > '$work'/rank\$RANK.pid; echo \$MEGAMOE_RENDEZVOUS_DIR > '$work'/folder; exec sleep 60"
"$run" -n 2 -- sh -c "$rank_command" >"$work/out" 2>&1 &
launcher=$!
for _ in $(seq 100); do
  [ -s "$work/rank0.pid" ] && [ -s "$work/rank1.pid" ] && [ -s "$work/folder" ] && break
  sleep 0.1
done
if ! { [ -s "$work/rank0.pid" ] && [ -s "$work/rank1.pid" ] && [ -s "$work/folder" ]; }; then
  echo "FAILED: the ranks did not start"
  kill -KILL "$launcher"
  exit 1
fi
kill -TERM "$launcher"
wait "$launcher"
launcher_status=$?
cat "$work/out"

for rank in 0 1; do
  pid=$(cat "$work/rank$rank.pid")
  if kill -0 "$pid" 2>/dev/null; then
    echo "FAILED: rank $rank (pid $pid) outlived the launcher"
    kill -KILL "$pid"  # this test's own process
    status=1
  fi
done
folder=$(cat "$work/folder")
if [ -d "$folder" ]; then
  echo "FAILED: the rendezvous folder $folder outlived the launcher"
  rm -rf "$folder"
  status=1
fi
# 143 = 128 + SIGTERM: the launcher ends by the signal it got, after the ranks.
if [ "$launcher_status" != 143 ]; then
  echo "FAILED: megamoe-run exited with $launcher_status, not 143 (SIGTERM)"
  status=1
fi
if ! grep -q "megamoe-run: FAILED: stopped by signal Terminated" "$work/out"; then
  echo "FAILED: megamoe-run did not say that a signal stopped it"
  status=1
fi
[ $status = 0 ] && echo "megamoe-run stopped its ranks on SIGTERM"
rm -rf "$work"
exit $status
