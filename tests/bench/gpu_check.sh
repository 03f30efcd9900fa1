#!/usr/bin/env bash
# One GPU check, run from the repository root on a CUDA machine with no network:
#   a. environment (nvidia-smi, python/torch/triton)             -> env.txt
#   b. the package installed without network (pip -e, else a PYTHONPATH shim) -> install.txt
#   c. the gpu-marked tests                                        -> pytest_gpu.txt, pytest_gpu.xml
#      (meanwhile d's, e's and f's kernels compile in the background -> warm_*.txt)
#   d. the weight-only matmul microbenchmark (L2-cold graphs) + config sweep -> gpu_kernels.{md,json,txt}
#   e. decode attention: paged (k8v4, f16, k8v8) vs f16 SDPA       -> gpu_attention.{md,json,txt}
#   f. end-to-end decode through the engine, CUDA graphs vs eager, batch sizes -> cuda_decode.{md,json,txt}
#
#   bash tests/bench/gpu_check.sh [RESULTS_DIR]        (default: $OUT, else gpu_results)
#
# Keeps going past a failing step and exits 1 at the end if any step failed or was skipped (a
# benchmark that had to skip measurements for its time budget exits 3: a failed step too).
# Time: the whole run stays under GPU_CHECK_BUDGET_S (default 270 s, 4.5 minutes; the device's call
# limit is 600 s): each step's timeout is the smaller of its own cap and what is left after a reserve
# for the steps after it, and the benchmarks get --budget-s so they stop starting measurements, and
# still write their outputs, before the timeout would kill them. Expected on an H200 with the tests
# taking ~60-100 s: env + install ~15 s, tests (compiles of d-f beside them), d ~50 s, e ~25 s,
# f ~50 s; the caps (150 / 90 / 45 / 90 s) are what each may take when the others leave it room.
# Optional: wheels in .whl/ (e.g. gguf, platformdirs) are installed to /tmp/site first;
# GPU_CHECK_GGUF=path.gguf makes cuda_decode.py load that model instead of synthetic weights.
set -uo pipefail

PY="${PYTHON:-python3}"
RESULTS="${1:-${OUT:-gpu_results}}"
mkdir -p "$RESULTS" && RESULTS="$(cd "$RESULTS" && pwd)"
BUDGET="${GPU_CHECK_BUDGET_S:-270}"
START=$SECONDS
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
FAILED=0

left() { echo $((BUDGET - (SECONDS - START))); }
# timeout for a step: its own cap, or what is left after reserving $2 seconds for later steps
cap() {
    local t=$(($(left) - $2))
    echo $((t < $1 ? t : $1))
}
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LOG TIMEOUT CMD...: run CMD under `timeout`, output to the console and LOG
step() {
    local name=$1 log=$2 t=$3 rc t0=$SECONDS
    shift 3
    if ((t < 10)); then
        note "SKIP  $name: no time left in the ${BUDGET}s budget"
        FAILED=1
        return
    fi
    echo "=== $name (timeout ${t}s, $(left)s of the budget left) ==="
    timeout -k 10 "$t" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if ((rc == 0)); then
        note "OK    $name ($((SECONDS - t0))s)"
    else
        FAILED=1
        local why=""
        ((rc == 124 || rc == 137)) && why=" (timed out)"
        ((rc == 3)) && why=" (incomplete: measurements skipped for the time budget)"
        note "FAIL  $name: exit $rc$why ($((SECONDS - t0))s), see $(basename "$log")"
    fi
}

# a. environment
{
    echo "# $(date -u +%FT%TZ) $(uname -a)"
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,driver_version,power.limit --format=csv
    echo "# $(nproc) CPUs"
    free -g
    "$PY" --version
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|numpy|pytest|jinja2|tokenizers|safetensors|tqdm|gguf|platformdirs|setuptools|wheel) '
} >"$RESULTS/env.txt" 2>&1
ENV_PY='
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__)
assert torch.cuda.is_available(), "torch sees no CUDA GPU"
p = torch.cuda.get_device_properties(0)
print("device", torch.cuda.get_device_name(0), "|", p.multi_processor_count, "SMs |", p.total_memory // 2**20, "MiB")
'
if "$PY" -c "$ENV_PY" >>"$RESULTS/env.txt" 2>&1; then
    note "OK    env: $(grep '^device' "$RESULTS/env.txt")"
else
    note "FAIL  env: $(tail -n 1 "$RESULTS/env.txt")"
    FAILED=1
fi

# b. install, no network: pip -e (setuptools, no build isolation), else a lowbit/ of symlinks on PYTHONPATH
install() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
            export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local check="import lowbit.kernels.wq_mm, lowbit.models.llama, lowbit.runtime.engine.engine"
    if PIP_NO_INDEX=1 "$PY" -m pip install --no-deps --no-build-isolation -e . -q && (cd /tmp && "$PY" -c "$check"); then
        echo "installed with pip install -e ."
        return 0
    fi
    echo "pip install -e . failed or does not import; falling back to a PYTHONPATH shim (/tmp/lowbit_shim)"
    rm -rf /tmp/lowbit_shim && mkdir -p /tmp/lowbit_shim/lowbit
    for d in runtime quant kernels models tui; do ln -s "$PWD/$d" "/tmp/lowbit_shim/lowbit/$d"; done
    export PYTHONPATH="/tmp/lowbit_shim${PYTHONPATH:+:$PYTHONPATH}"
    (cd /tmp && "$PY" -c "$check") && echo "installed as a PYTHONPATH shim of symlinks"
}
t0=$SECONDS
if install >"$RESULTS/install.txt" 2>&1; then
    note "OK    install: $(tail -n 1 "$RESULTS/install.txt") ($((SECONDS - t0))s)"
else
    note "FAIL  install: see install.txt"
    FAILED=1
fi

MODEL=()
[[ -n "${GPU_CHECK_GGUF:-}" ]] && MODEL=(--model "$GPU_CHECK_GGUF")

# Triton compiles are CPU-bound and d-f need ~150 of them: fill Triton's disk cache for d, e and f
# in the background while c runs (c only checks results, so sharing the machine costs it nothing).
WARM=()
tw=$(cap 120 130)
if ((tw >= 10)); then
    timeout -k 5 "$tw" "$PY" tests/bench/gpu_kernels.py --sweep --compile-only >"$RESULTS/warm_gpu_kernels.txt" 2>&1 &
    WARM+=($!)
    timeout -k 5 "$tw" "$PY" tests/bench/gpu_attention.py --compile-only >"$RESULTS/warm_gpu_attention.txt" 2>&1 &
    WARM+=($!)
    timeout -k 5 "$tw" "$PY" tests/bench/cuda_decode.py --compile-only ${MODEL[@]+"${MODEL[@]}"} \
        >"$RESULTS/warm_cuda_decode.txt" 2>&1 &
    WARM+=($!)
fi

# c. gpu-marked tests, only the files that have any: the other test modules import packages
# (gguf, transformers, llama_cpp) this machine may lack
mapfile -t GPU_TESTS < <(grep -l "pytest.mark.gpu" tests/test_*.py)
# each kernel specialization compiles once (~1 s of host CPU): spread the tests over processes
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 6)
step "pytest -m gpu (${#GPU_TESTS[@]} files)" "$RESULTS/pytest_gpu.txt" "$(cap 150 130)" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors ${XDIST[@]+"${XDIST[@]}"} \
    --junitxml="$RESULTS/pytest_gpu.xml" "${GPU_TESTS[@]}"
t0=$SECONDS
((${#WARM[@]})) && wait "${WARM[@]}"
echo "compile warm-up: waited $((SECONDS - t0))s more; $(tail -n 1 "$RESULTS/warm_gpu_kernels.txt" 2>/dev/null)" \
    "| $(tail -n 1 "$RESULTS/warm_gpu_attention.txt" 2>/dev/null)" \
    "| $(tail -n 1 "$RESULTS/warm_cuda_decode.txt" 2>/dev/null)" | tee -a "$SUMMARY"

# d. microbenchmark, L2-cold graph replays (+ sweep with whatever its budget leaves); reserve: e and f
t=$(cap 90 70)
step "gpu_kernels.py" "$RESULTS/gpu_kernels.txt" "$t" \
    "$PY" tests/bench/gpu_kernels.py --out "$RESULTS" --graphs --sweep --budget-s $((t > 30 ? t - 15 : 10))

# e. decode attention; reserve: f
t=$(cap 45 40)
step "gpu_attention.py" "$RESULTS/gpu_attention.txt" "$t" \
    "$PY" tests/bench/gpu_attention.py --out "$RESULTS" --budget-s $((t > 25 ? t - 12 : 10))

# f. end-to-end decode, CUDA graphs vs eager
t=$(cap 90 3)
step "cuda_decode.py" "$RESULTS/cuda_decode.txt" "$t" \
    "$PY" tests/bench/cuda_decode.py --out "$RESULTS" --budget-s $((t > 40 ? t - 25 : 15)) ${MODEL[@]+"${MODEL[@]}"}

echo
echo "=== summary ($((SECONDS - START))s) ==="
{
    grep -hE '^(PASS|MISS|N/A|INCOMPLETE|correctness|FAILED|ERROR)' "$RESULTS/gpu_kernels.txt" 2>/dev/null
    grep -hE '^sweep ' "$RESULTS/gpu_kernels.txt" 2>/dev/null
    grep -hE '^(attention |correctness|INCOMPLETE|FAILED|ERROR)' "$RESULTS/gpu_attention.txt" 2>/dev/null |
        sed 's/^/gpu_attention: /'
    grep -hE '^(decode B=|generate |prefill |ERROR|INCOMPLETE|SYNTHETIC)' "$RESULTS/cuda_decode.txt" 2>/dev/null
    tail -n 1 "$RESULTS/pytest_gpu.txt" 2>/dev/null
} | tee -a "$SUMMARY"
echo
echo "results in $RESULTS:"
ls -l "$RESULTS"
if ((FAILED)); then
    note "gpu_check: FAILED (a step above failed or was skipped)"
    exit 1
fi
note "gpu_check: all steps passed"
