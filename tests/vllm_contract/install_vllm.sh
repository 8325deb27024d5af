#!/usr/bin/env bash
# Install vllm==0.33.0 and ray==2.60.0 (what the engine image holds) into a cached virtualenv
# outside the repository, for the vllm tier. About 9.5 GB (torch with CUDA libraries);
# reused across runs once complete. vLLM's ParallelConfig imports Ray for the Ray backend.
# Env: VLLM_VERSION (0.33.0), RAY_VERSION (2.60.0), VLLM_CONTRACT_VENV (default below),
# PYTHON (python3.11).
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
RAY_VERSION="${RAY_VERSION:-2.60.0}"
VENV="${VLLM_CONTRACT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-dp-operator/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
NEED_GB=15

installed() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" "$RAY_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit((md.version("vllm"), md.version("ray")) != (sys.argv[1], sys.argv[2]))
PY
}

if installed; then
  echo "vllm ${VLLM_VERSION} and ray ${RAY_VERSION} already installed in ${VENV}"
  exit 0
fi

mkdir -p "$(dirname "$VENV")"
avail_gb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1024 / 1024)}')
if [ "$avail_gb" -lt "$NEED_GB" ]; then
  echo "only ${avail_gb} GB free under $(dirname "$VENV"); vllm ${VLLM_VERSION} needs about ${NEED_GB} GB" >&2
  exit 1
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install "vllm==${VLLM_VERSION}" "ray[default]==${RAY_VERSION}"
installed
echo "vllm ${VLLM_VERSION} and ray ${RAY_VERSION} installed in ${VENV}"
