#!/usr/bin/env bash
# Sample the host's memory once a second until killed (for runs whose host memory is the question, e.g. ZenFlow's
# overlapped step): "T avail KB" from free, and "T PID RssAnon: KB" / "T PID RssShmem: KB" for every python process,
# with "T PID cmd ..." the first time a process is seen. T is seconds since the epoch.
declare -A seen
while true; do
  t=$(date +%s)
  free -k | awk -v t="$t" '/^Mem:/ {print t, "avail", $7}'
  for p in $(pgrep python3); do
    if [ -z "${seen[$p]:-}" ]; then seen[$p]=1; echo "$t $p cmd $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-200)"; fi
    awk -v t="$t" -v p="$p" '/^(RssAnon|RssShmem):/ {print t, p, $1, $2}' /proc/$p/status 2>/dev/null
  done
  sleep 1
done
