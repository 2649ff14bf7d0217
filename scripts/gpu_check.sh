#!/usr/bin/env bash
# One GPU check, under 5 minutes: install what is missing, compile the kernels, run the GPU
# tests and the kernel benchmark, print a summary. Exit status 0 only if every step passed.
#
#   scripts/gpu_check.sh
#
# Environment: PYTHON (default python3; used as is when it already has CUDA torch and CuPy),
# VENV (default build/venv-gpu, git-ignored; made when PYTHON lacks them), SKIP_INSTALL=1
# (use PYTHON as is, e.g. on a machine without network), OUT (logs; default a temp dir).
#
# Offline GPU machines (such as the lent H200, whose image has torch and CuPy but not redis-py):
# fetch the pure-Python wheels the store imports into .whl/ (git-ignored) on a machine with
# network, carry .whl with the tree, and this script installs them into /tmp/site first:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl redis==8.1.0
# Without a redis-server binary the GPU test that needs one is deselected, not failed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-build/venv-gpu}
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
SUMMARY=()
FAILED=0
export PYTHONUNBUFFERED=1
# The packages import from the checkout; no install of the project is needed to test it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# step NAME SECONDS FUNCTION: run FUNCTION (exported) under a time limit, log it, record it.
step() {
    local name=$1 limit=$2 fn=$3 rc=0
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" bash -c "set -euo pipefail; $fn" 2>&1 \
        | tee "$LOGS/$name.log" || rc=$?
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("ok    $name")
    else
        SUMMARY+=("FAIL  $name (exit $rc; log $LOGS/$name.log)")
        FAILED=1
    fi
}

ready() {  # does interpreter $1 have CUDA torch and CuPy?
    "$1" -c 'import sys, torch, cupy; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}

cuda_major() {  # the CUDA major version of nvcc, else of the driver, else 12
    local v=""
    if command -v nvcc >/dev/null; then
        v=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    fi
    if [ -z "$v" ] && command -v nvidia-smi >/dev/null; then
        v=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\)\..*/\1/p' | head -n1)
    fi
    echo "${v:-12}"
}

install_env() {  # a venv with CUDA torch, the matching CuPy and the project's dev extras
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # PyPI's Linux torch wheels bundle their CUDA runtime; the driver only has to be recent.
    "$VENV/bin/python" -m pip install -q torch "cupy-cuda$(cuda_major)x"
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
}

echo "=== nvidia-smi"
nvidia-smi || echo "nvidia-smi failed"

export PYTHON VENV
export -f cuda_major install_env
if [ "${SKIP_INSTALL:-0}" = 1 ] || ready "$PYTHON"; then
    PY=$PYTHON
    SUMMARY+=("ok    env ($PYTHON as is)")
else
    step install 200 install_env
    PY=$VENV/bin/python
fi
export PY
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
"$PY" -c 'import redis' 2>/dev/null || echo "redis-py missing: the store's GPU tests will fail (see .whl above)"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")' || true
"$PY" -c 'import cupy; print("cupy", cupy.__version__)' || true

nvcc_check() { "$PY" -m kernels.build --check; }
export -f nvcc_check
step nvcc-check 60 nvcc_check

gpu_tests() {
    local rc=0 skip=()
    command -v redis-server >/dev/null || skip=(-k "not redis")
    "$PY" -m pytest -q -m gpu -p no:cacheprovider "${skip[@]}" \
        tests/kernels tests/gpu_arena tests/tierstore || rc=$?
    [ "$rc" -eq 5 ] && { echo "no GPU tests collected"; rc=0; }
    return "$rc"
}
export -f gpu_tests
step gpu-tests 150 gpu_tests

bench() {
    if "$PY" -c 'import tierstore.bench as b; b.available()' >/dev/null 2>&1; then
        "$PY" -m tierstore.cli bench kernels --json
    else  # another benchmark's imports are missing here: run this one alone, same output
        "$PY" - <<'PYEOF'
import argparse, json
from tierstore.bench import kernels as bench
parser = argparse.ArgumentParser()
bench.add_arguments(parser)
result = bench.run(parser.parse_args([]))
print(bench.render(result))
print(json.dumps(result, sort_keys=True))
PYEOF
    fi
}
export -f bench
step bench-kernels 120 bench

echo
echo "=== summary (${SECONDS}s, logs in $LOGS)"
printf '%s\n' "${SUMMARY[@]}"
if [ -s "$LOGS/bench-kernels.log" ]; then
    "$PY" - "$LOGS/bench-kernels.log" <<'PYEOF' || true
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
result = json.loads(lines[-1])
best = {}
for row in result["copy"]:
    key = (row["path"], row["size_kib"])
    best.setdefault(key, {})[row["method"]] = row["gb_s"]
print(f"device {result['device']}  cuda kernels {result['cuda_kernels']}")
for (path, kib), m in sorted(best.items()):
    figures = "  ".join(f"{k} {v:.1f}" for k, v in sorted(m.items()))
    print(f"{path} {kib:>5} KiB  GB/s: {figures}")
for row in result["remap"]:
    print(f"remap {row['remap']} page {row['page_size']}: {row['ids_per_s']:.3g} ids/s")
for row in result.get("table_sync", []):
    print(f"table sync {row['device']} {row['slots']} slots, {row['changed']} moved: "
          f"patch {row['patch_us']:.1f} us, full copy {row['full_copy_us']:.1f} us")
PYEOF
fi
exit "$FAILED"
