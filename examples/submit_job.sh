#!/usr/bin/env bash
# Run the RL example as a Ray job on a `ray start --head` cluster of its own:
#   1. ray start --head on free ports with a private --temp-dir (it never touches another cluster)
#   2. ray job submit --working-dir . -- python examples/rl_loop.py --json [ARGS...]
#   3. ray job status / ray job logs
#   4. stop exactly the head this script started (its process group), never `ray stop`
#
#   bash examples/submit_job.sh [rl_loop.py args, e.g. --steps 30 --rollouts 2]
#
# Prints the job's status line and its logs; the last line of the logs is rl_loop.py's JSON.
# Exit code: 0 when the job SUCCEEDED. Needs `pip install -e .` (the job's driver and actors
# import tensorhub from the installed package or from the uploaded working dir).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"   # the same auth rules as any Ray CLI call here

TMP="$(mktemp -d /tmp/tensorhub-job-XXXXXX)"
read -r GCS DASH CLIENT METRICS AGENT_GRPC AGENT_HTTP RTENV NM OM < <(python - <<'EOF'
import socket
socks = [socket.socket() for _ in range(9)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
)
WORKER_MIN=$(( 20000 + (RANDOM % 90) * 100 ))

# `--block` keeps `ray start` in the foreground as the parent of the head's processes; setsid
# gives it a process group of its own, so stopping it is one kill of that group.
setsid ray start --head --block --disable-usage-stats --temp-dir="$TMP/ray" \
  --port="$GCS" --dashboard-host=127.0.0.1 --dashboard-port="$DASH" --ray-client-server-port="$CLIENT" \
  --metrics-export-port="$METRICS" --dashboard-agent-grpc-port="$AGENT_GRPC" \
  --dashboard-agent-listen-port="$AGENT_HTTP" --runtime-env-agent-port="$RTENV" \
  --node-manager-port="$NM" --object-manager-port="$OM" \
  --min-worker-port="$WORKER_MIN" --max-worker-port="$((WORKER_MIN + 99))" \
  --num-cpus=2 --include-dashboard=true >"$TMP/head.log" 2>&1 &
HEAD_PID=$!

alive() {  # processes of the head's session that are still running (zombies do not count)
  ps -o stat= --sid "$HEAD_PID" 2>/dev/null | grep -vc '^Z' || true
}
stop_head() {
  # SIGTERM to the session's group, then SIGKILL whatever of that session is left after 10 s.
  kill -TERM -- "-$HEAD_PID" 2>/dev/null || true
  for _ in $(seq 1 20); do
    [ "$(alive)" -eq 0 ] && break
    sleep 0.5
  done
  if [ "$(alive)" -ne 0 ]; then
    ps -o pid= --sid "$HEAD_PID" | xargs -r kill -KILL 2>/dev/null || true
  fi
  wait "$HEAD_PID" 2>/dev/null || true
  rm -rf "$TMP"
}
trap stop_head EXIT

ADDR="http://127.0.0.1:$DASH"
echo "head: pid $HEAD_PID, GCS 127.0.0.1:$GCS, dashboard $ADDR, metrics :$METRICS, temp $TMP/ray"
for _ in $(seq 1 120); do  # the job API answers once the dashboard is up
  if ray job list --address "$ADDR" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$HEAD_PID" 2>/dev/null; then cat "$TMP/head.log"; exit 1; fi
  sleep 1
done

JOB_ID="rl-loop-$(date +%s)-$RANDOM"
# --no-wait, then follow the logs: the same as a submit that waits, but the id is ours to query.
# The job API answers before the head's job agent has registered; until then a submit fails
# with "No available agent to submit job, please try again later" (seen in CI): try again. The
# dashboard may also drop the connection without an answer ("Remote end closed connection",
# seen in CI): try again too; if that first request did create the job, the retry finds its id
# taken ("already exists"): submitted.
for attempt in $(seq 1 60); do
  if OUT="$(ray job submit --address "$ADDR" --submission-id "$JOB_ID" --no-wait \
      --working-dir . --runtime-env-json '{"excludes": [".git", "*.egg-info", "benchmarks", "tests"]}' \
      -- python examples/rl_loop.py --json "$@" 2>&1)"; then
    echo "$OUT"
    break
  fi
  if [ "$attempt" -gt 1 ] && [[ "$OUT" == *"already exists"* ]]; then
    echo "job $JOB_ID submitted (an earlier attempt's answer was lost)"
    break
  fi
  if { [[ "$OUT" != *"No available agent"* ]] && [[ "$OUT" != *"Connection aborted"* ]] \
      && [[ "$OUT" != *"Remote end closed connection"* ]]; } || [ "$attempt" -eq 60 ]; then
    echo "$OUT" >&2
    exit 1
  fi
  sleep 1
done
# Follow the logs. The dashboard's log stream can fail while its job agent settles (a 404 on its
# websocket right after a submission whose answer was lost, seen in CI): then wait for the job to
# end by its status and print its logs once. Each query is retried: the same agent may drop one.
if ! ray job logs --address "$ADDR" --follow "$JOB_ID"; then
  for attempt in $(seq 1 900); do
    S="$(ray job status --address "$ADDR" "$JOB_ID" 2>&1)" || S=""
    if echo "$S" | grep -qiE "succeeded|failed|stopped"; then break; fi
    sleep 1
  done
  for attempt in $(seq 1 30); do
    if ray job logs --address "$ADDR" "$JOB_ID"; then break; fi
    sleep 1
  done
fi
if [ -n "${TENSORHUB_SHOW_SESSION:-}" ]; then ps -o pid=,sid=,cmd= --sid "$HEAD_PID" | cut -c1-100; fi
STATUS=""
for attempt in $(seq 1 30); do
  if STATUS="$(ray job status --address "$ADDR" "$JOB_ID" 2>&1)"; then break; fi
  sleep 1
done
echo "$STATUS"
echo "$STATUS" | grep -qi "succeeded"
