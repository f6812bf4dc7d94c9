#!/usr/bin/env bash
# The prepared accelerator check: one command that turns a short GPU loan into numbers.
#
#   bash scripts/device/gpu_check.sh                      # on the GPU machine (results under $OUT)
#   bash scripts/device/gpu_check.sh --cpu --out DIR      # here: jax on the CPU, tiny shapes
#   ... [--budget S] [--parts a,b] [--skip a,b] [--timeout PART=S] [--option KEY=JSON]
#
# On the GPU machine it first installs, into $GPU_CHECK_SITE (default /tmp/rljax-site), the wheels
# that scripts/device/fetch_wheels.sh put in .wheels/ (carry that folder) and rljax itself, all
# with --no-deps and no index (the machine has no network); rljax is imported from this tree.
# Then scripts/device/gpu_check.py runs each part in its own process under its own timeout and
# rewrites results.json and results.md after every part (see that file for the parts).
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
CPU=0
for arg in "$@"; do
  [ "$arg" = "--cpu" ] && CPU=1
done

RECORD="$(mktemp -t rljax-install.XXXXXX.json)"
if [ "$CPU" = 1 ]; then
  export JAX_PLATFORMS=cpu
  echo '{"status": "skipped", "note": "--cpu: the packages of this environment are used"}' > "$RECORD"
else
  SITE="${GPU_CHECK_SITE:-/tmp/rljax-site}"
  START=$(date +%s)
  LOG="$(mktemp -t rljax-install.XXXXXX.log)"
  shopt -s nullglob
  WHEELS=("$ROOT"/.wheels/*.whl)
  if [ "${#WHEELS[@]}" = 0 ]; then
    STATUS=error
    NOTE="no wheels in .wheels/: run scripts/device/fetch_wheels.sh where PyPI is reachable and carry .wheels"
  elif "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" "${WHEELS[@]}" > "$LOG" 2>&1; then
    STATUS=ok
    NOTE="${#WHEELS[@]} wheels into $SITE"
    # rljax itself, without its dependencies (setuptools from the machine; no build isolation, no index)
    if "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation --no-compile \
        --target "$SITE" "$ROOT" >> "$LOG" 2>&1; then
      NOTE="$NOTE, and rljax (imported from the tree)"
    else
      WHY="$(grep -v '^[[:space:]]*$' "$LOG" | tail -1 | tr -d '"\\' | cut -c1-200)"
      NOTE="$NOTE; installing rljax itself failed ($WHY), so it is imported from the tree"
    fi
  else
    STATUS=error
    NOTE="pip failed: $(grep -v '^ ' "$LOG" | tail -2 | tr -d '"\\' | tr '\n' ' ' | cut -c1-300)"
  fi
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
  printf '{"status": "%s", "seconds": %s, "note": "%s"}\n' "$STATUS" "$(( $(date +%s) - START ))" "$NOTE" > "$RECORD"
  cat "$LOG"
fi
export GPU_CHECK_INSTALL_RECORD="$RECORD"
"$PY" "$ROOT/scripts/device/gpu_check.py" "$@"
CODE=$?
rm -f "$RECORD"
exit $CODE
