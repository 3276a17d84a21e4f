#!/usr/bin/env bash
# Runs one fuzz target's binary (as `cargo xtask fuzz` builds it, under
# fuzz/target/<triple>/release or crates/ddo-source/fuzz/target/<triple>/release) as WORKERS
# processes on this machine's cores, each with its own seed, until together they ran RUNS inputs
# or SECONDS passed; prints the inputs each ran, the total and whether any crashed. The first
# corpus folder receives new inputs; the others are read.
# Usage: bash fuzz/parallel.sh BINARY WORKERS RUNS SECONDS CORPUS [CORPUS...]
set -uo pipefail
if [ $# -lt 5 ]; then
  sed -n 2,8p "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bin=$1 workers=$2 runs=$3 seconds=$4
shift 4
for n in "$workers" "$runs" "$seconds"; do
  case $n in '' | *[!0-9]* | 0)
    echo "WORKERS, RUNS and SECONDS are whole numbers above 0 (got $workers $runs $seconds)"
    exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "$bin is not an executable fuzz target (build it with cargo xtask fuzz)"; exit 2; }
mkdir -p "$1"
logs=$(mktemp -d)
per=$(((runs + workers - 1) / workers))
for i in $(seq 1 "$workers"); do
  "$bin" -runs="$per" -max_total_time="$seconds" -seed="$i" -artifact_prefix="$logs/" "$@" \
    >"$logs/worker-$i.log" 2>&1 &
done
wait
status=0 total=0
for i in $(seq 1 "$workers"); do
  n=$(grep -a '^Done ' "$logs/worker-$i.log" | awk '{print $2}')
  if [ -z "$n" ]; then
    status=1
    echo "worker $i did not finish:"
    tail -n 30 "$logs/worker-$i.log"
    continue
  fi
  echo "worker $i: $n inputs"
  total=$((total + n))
done
crashes=$(find "$logs" -name 'crash-*' -o -name 'timeout-*' -o -name 'leak-*' -o -name 'oom-*' | wc -l)
[ "$crashes" -gt 0 ] && status=1
echo "$(basename "$bin"): $total inputs in $workers processes; findings: $crashes (artifacts in $logs)"
exit $status
