#!/usr/bin/env bash
# Static checks of the Terraform in infra/terraform:
#   infra/check.sh [all|fmt|checkov]   (default: all)
# fmt: `terraform fmt -check -recursive` (needs terraform on PATH).
# checkov: Checkov in its own virtualenv, created on first use under
#   ${TIDAL_CACHE_DIR:-~/.cache/tidal}/envs/checkov-<version> from TIDAL_BASE_PYTHON (default python3.11).
# Exits non-zero when a check fails or a tool cannot be had; inline `#checkov:skip=` comments carry
# the reason for every suppressed check.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TF_DIR="$ROOT/infra/terraform"
CHECKOV_VERSION=3.3.30
CACHE=${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}
BASE_PY=${TIDAL_BASE_PYTHON:-python3.11}
VENV="$CACHE/envs/checkov-$CHECKOV_VERSION"

log() { printf '[infra check] %s\n' "$*" >&2; }

check_fmt() {
  if ! command -v terraform >/dev/null 2>&1; then
    log "FAILED: terraform is not on PATH (install Terraform >= 1.9 to run the fmt check)"
    return 2
  fi
  log "terraform fmt -check -recursive infra/terraform"
  if ! terraform fmt -check -recursive -diff "$TF_DIR"; then
    log "FAILED: files above are not formatted; run: terraform fmt -recursive infra/terraform"
    return 1
  fi
  log "fmt: ok"
}

# The virtualenv counts as ready only after a complete install (marker file), so an interrupted
# first run is redone instead of leaving a half-installed Checkov behind.
checkov_env() {
  if [ -f "$VENV/.tidal-ready" ]; then return 0; fi
  if ! command -v "$BASE_PY" >/dev/null 2>&1; then
    log "FAILED: need $BASE_PY to create the Checkov environment (set TIDAL_BASE_PYTHON to a Python 3.9-3.12 interpreter)"
    return 2
  fi
  log "creating the Checkov $CHECKOV_VERSION environment in $VENV (first run only)"
  rm -rf "$VENV"
  mkdir -p "$CACHE/envs"
  if ! { "$BASE_PY" -m venv "$VENV" &&
         "$VENV/bin/python" -m pip install --quiet "checkov==$CHECKOV_VERSION" >&2; }; then
    log "FAILED: could not install checkov==$CHECKOV_VERSION into $VENV"
    rm -rf "$VENV"
    return 2
  fi
  touch "$VENV/.tidal-ready"
}

check_checkov() {
  checkov_env || return $?
  log "checkov -d infra/terraform (checkov $CHECKOV_VERSION)"
  # --skip-download: no calls to the vendor's platform; results and suppressions are all local.
  # Registry modules are not downloaded: their own resources are the modules' maintainers' to check.
  if ! (cd "$ROOT" && "$VENV/bin/checkov" -d infra/terraform --skip-download --compact --quiet); then
    log "FAILED: checkov reported failed checks (above). Fix them, or suppress one that does not apply with"
    log "        '#checkov:skip=CKV_...:<reason>' inside the resource."
    return 1
  fi
  log "checkov: ok"
}

main() {
  local what=${1:-all} rc=0
  case "$what" in
    fmt) check_fmt || rc=$? ;;
    checkov) check_checkov || rc=$? ;;
    all)
      check_fmt || rc=$?
      local rc2=0
      check_checkov || rc2=$?
      [ "$rc" -ne 0 ] || rc=$rc2
      ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}"; return 0 ;;
    *) log "unknown check '$what' (use all, fmt or checkov)"; return 2 ;;
  esac
  if [ "$rc" -eq 0 ]; then log "all infra checks passed"; else log "infra checks FAILED"; fi
  return "$rc"
}

main "$@"
