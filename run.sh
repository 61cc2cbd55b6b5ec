#!/usr/bin/env bash
# Tidal on a fresh machine. Every command first makes sure both environments exist
# (installed once, cached by the hash of their requirement files):
#   ./run.sh demo [ARGS]   the main job: the local flywheel demo (`tidal demo`)
#   ./run.sh test [ARGS]   the test suite (pytest; GPU tests skip without CUDA)
#   ./run.sh setup         the environments only
# Settings: TIDAL_CACHE_DIR (where environments live, default ~/.cache/tidal),
# TIDAL_ENGINE_FLAVOR=cpu|cuda (default: cuda when nvidia-smi sees a GPU),
# TIDAL_BASE_PYTHON (default python3.11).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}
BASE_PY=${TIDAL_BASE_PYTHON:-python3.11}
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true

log() { printf '[tidal setup] %s\n' "$*" >&2; }

digest() { cat "$@" | sha256sum | cut -c1-12; }

engine_flavor() {
  if [ -n "${TIDAL_ENGINE_FLAVOR:-}" ]; then
    case "$TIDAL_ENGINE_FLAVOR" in cpu|cuda) echo "$TIDAL_ENGINE_FLAVOR" ;;
      *) log "TIDAL_ENGINE_FLAVOR must be 'cpu' or 'cuda', got '$TIDAL_ENGINE_FLAVOR'"; exit 2 ;; esac
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda
  else echo cpu; fi
}

# make_env NAME DIGEST REQUIREMENTS POST_COMMAND: a venv under the cache, built once per digest.
make_env() {
  local name=$1 dig=$2 req=$3 post=$4 dir="$CACHE/envs/$1-$2"
  if [ -f "$dir/.tidal-ready" ]; then echo "$dir"; return; fi
  command -v "$BASE_PY" >/dev/null || { log "need $BASE_PY (set TIDAL_BASE_PYTHON to a Python 3.11 interpreter)"; exit 2; }
  log "creating the $name environment in $dir (first run only, a few minutes)"
  rm -rf "$dir"; mkdir -p "$CACHE/envs"
  "$BASE_PY" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip >&2
  "$dir/bin/python" -m pip install --quiet -r "$req" >&2
  if [ -n "$post" ]; then (cd "$dir" && eval "$post") >&2; fi
  touch "$dir/.tidal-ready"
  echo "$dir"
}

# Prometheus, promtool and the Pushgateway (Debian's `prometheus` and `prometheus-pushgateway` packages): `tidal up
# --with-prometheus` and the platform tests use them. Installed with apt-get where this runs as root; elsewhere the
# missing tool is named and setup goes on.
ensure_prometheus() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    && command -v prometheus-pushgateway >/dev/null 2>&1; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian's prometheus and prometheus-pushgateway packages (first run only)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      prometheus prometheus-pushgateway) >&2 \
      || log "installing prometheus failed (see above): the monitoring tests will say what is missing"
  else
    log "prometheus, promtool or prometheus-pushgateway not found: install Debian's prometheus and" \
      "prometheus-pushgateway packages (or put them on PATH); the platform tests and \`tidal up --with-prometheus\` need them"
  fi
}

setup() {
  local plat eng flavor built pids=() pid
  ensure_prometheus
  flavor=$(engine_flavor)
  # Both environments build at once (pip spends much of its time unpacking; on 2 cores this saves minutes).
  built=$(mktemp -d)
  make_env platform "$(digest "$ROOT/requirements/platform.txt")" "$ROOT/requirements/platform.txt" "" > "$built/platform" &
  pids+=($!)
  make_env "engine-$flavor" "$(digest "$ROOT/requirements/engine-$flavor.txt")" "$ROOT/requirements/engine-$flavor.txt" \
    "bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true" > "$built/engine" &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || { log "building an environment failed (see above)"; exit 1; }; done
  plat=$(cat "$built/platform"); eng=$(cat "$built/engine"); rm -rf "$built"
  # The project itself is an editable install, redone when the checkout moves or pyproject.toml changes
  # (its package list decides what the install exposes).
  local stamp
  stamp="$ROOT $(digest "$ROOT/pyproject.toml")"
  if [ "$(cat "$plat/.tidal-root" 2>/dev/null)" != "$stamp" ] || ! "$plat/bin/python" -c 'import tidal' 2>/dev/null; then
    "$plat/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" >&2
    echo "$stamp" > "$plat/.tidal-root"
  fi
  ln -sfn "$plat" "$ROOT/.venv"
  ln -sfn "$eng" "$ROOT/.engine-venv"
  log "platform: $ROOT/.venv -> $plat"
  log "engine ($flavor): $ROOT/.engine-venv -> $eng"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$ROOT/.venv/bin/tidal" demo "$@" ;;
  test)
    setup
    cd "$ROOT"
    set +e
    "$ROOT/.venv/bin/python" -m pytest "$@"
    rc=$?
    set -e
    # pytest's 5 means "no tests collected": a failure for CI, said plainly.
    [ $rc -eq 5 ] && log "pytest collected no tests"
    exit $rc ;;
  *) echo "usage: ./run.sh demo|test|setup [ARGS]" >&2; exit 2 ;;
esac
