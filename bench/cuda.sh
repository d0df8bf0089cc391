#!/bin/bash
# The CUDA paths, on a machine with an NVIDIA GPU and a CUDA torch: the tests
# that need CUDA (the shadow-KV check word for word on CUDA as on the CPU over
# every trace, the KV audit's digests equal on both, the Triton digest kernel
# on every layout) and the benchmarks that measure on CUDA (the digests
# against the GPU's memory bandwidth, the shadow-KV check). Wheels of
# kvtrace's own dependencies that the machine lacks may wait in .whl/ (they
# are installed to /tmp/site first).
#
#   bash bench/cuda.sh [OUTDIR]
set -o pipefail
out=${1:-${OUT:-/tmp/kvtrace-cuda}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 -rs -k cuda \
    tests/unit/replay/kv_content/test_check.py tests/unit/replay/kv_content/test_core.py \
    tests/unit/replay/test_data_path.py tests/unit/record/vllm/test_kv_digest_triton.py 2>&1 | tee "$out/tests.log" | tail -15
timeout 120 python3 -m bench.kv_audit --no-vllm 2>&1 | tee "$out/kv_audit.log"
timeout 120 python3 -m bench.shadow_kv --device cuda 2>&1 | tee "$out/shadow_kv.log" | tail -25
