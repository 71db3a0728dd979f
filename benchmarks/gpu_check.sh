#!/usr/bin/env bash
# The GPU checks of a session that is lent a CUDA machine, as one prepared run (device time is short):
# build the extension with the CUDA kernels, run every test that has a CUDA case, then gpu.py, then
# (optionally) the 1 GB compare.py subset on that machine's cores. Each step's log goes to $OUT (the
# device tool's folder) or benchmarks/results/gpu-check, written as it runs, so a run cut off by its
# time limit still returns what finished.
#
#   bash benchmarks/gpu_check.sh                 # build, tests, gpu.py (3 rounds)
#   GPU_ARGS=--quick bash benchmarks/gpu_check.sh
#   COMPARE=1 bash benchmarks/gpu_check.sh       # also compare.py --size-gb 1 --repeats 3 (CPU side)
#   GPU=0 COMPARE=1 COMPARE_ARGS="--concurrency 8 ..." PROFILE=1 bash benchmarks/gpu_check.sh
#                                                # tests, compare.py with other flags, a cProfile
#
# Uses the machine's own python3 (it must hold a CUDA build of torch, pybind11 and pytest).
set -u
out=${OUT:-benchmarks/results/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() { echo "== $1 ($(date +%T))"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; free -g | sed -n 2p
$py -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'numpy', numpy.__version__)"
git rev-parse --short HEAD 2>/dev/null || true

step build
rm -f recsave/_C*.so recsave/_cuda_kernels.so
RECSAVE_CUDA_KERNELS_BUILD=1 RECSAVE_BUILD_JOBS=$(nproc) $py setup.py -q build_ext --inplace \
    >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
grep -i "cuda" "$out/build.log" | tail -3
$py -c "from recsave.tables import cudakernels as k; print('kernels', k.available(), k.unavailable_reason())"

step tests
# Every test file with a CUDA case; -rs lists what skipped, so a skip that should have run shows.
$py -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_tensor_idmap.py \
    tests/test_devcopy.py tests/test_source_parts.py tests/test_arg_types.py \
    tests/test_torch_interop.py 2>&1 | tee "$out/tests.log" | tail -25

if [ "${GPU:-1}" = 1 ]; then
    step gpu.py
    $py benchmarks/gpu.py ${GPU_ARGS:-} --json "$out/gpu.json" 2>&1 | tee "$out/gpu.log" | tail -60
fi

if [ "${COMPARE:-0}" = 1 ]; then
    step compare.py
    # shellcheck disable=SC2086 # COMPARE_ARGS is a list of flags
    $py benchmarks/compare.py --json "$out/compare.json" ${COMPARE_ARGS:---size-gb 1 --repeats 3 \
        --only save:raw,save:torch,save:dcp,save:engine,save:saver,load:raw,load:torch,load:dcp,load:engine_verify,load:saver} \
        2>&1 | tee "$out/compare.log" | tail -40
fi
if [ "${PROFILE:-0}" = 1 ]; then
    step "compare.py --profile"
    $py benchmarks/compare.py --profile --json "$out/compare.json" 2>&1 | tail -80
fi
step done
