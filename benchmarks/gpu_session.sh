#!/usr/bin/env bash
# The one prepared GPU session: every check that needs a real CUDA device, in one call that fits the device
# time a task is lent (15 minutes, start included; one command at most 10). Run from the repository root on
# the device machine, after carrying the wheels its image lacks (docs/benchmarks.md, "The GPU session"):
#
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=570)
#
# Stages, most valuable first, each under its own time limit so that a slow one cannot take the rest down;
# each writes its log (and JSON where the script has one) under $OUT:
#   1. gpu_modes.py: every placement and the residency budgets (30/60/90%) against diffusers and accelerate —
#      step time, max_memory_allocated, bus use, and the planner's predicted step time and peak next to them;
#   2. load_into_mode.py: quantizing while loading, each layer packed on the GPU against packing on the CPU;
#   3. comfy_formats.py: each ComfyUI format's decoding forward on the GPU against comfy-kitchen's (its CUDA
#      kernels where it has them) and bf16;
#   4. device_sharing.py: two models on one card, another process taking memory between calls, onloads the
#      allocator refuses — max_memory_allocated against the room, outputs against each model alone;
#   5. the suite on real CUDA (streams, events, pinned staging, cudaHostRegister; the CUDA-only tests: the GGUF
#      decoders on the device, a library's quantized tensors moved leaf by leaf to the device and back).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

stage() {  # stage NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, never stop the session
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - began)) s"
    tail -n 40 "$OUT/$name.log"
}

nvidia-smi -L
site=/tmp/memmode-site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . plugins/* || exit 1
export PYTHONPATH=$site
python3 -c "import torch, diffusers, memmode_core; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
  'diffusers', diffusers.__version__, 'plugins', [p.name for p in memmode_core.list_plugins()])" || exit 1

stage gpu_modes 220 python3 benchmarks/gpu_modes.py --json "$OUT/gpu_modes.json"
stage load_into_mode 90 python3 benchmarks/load_into_mode.py --layers 12 --rounds 2 --threads 16 \
    --variants load_qfloat8_disk,load_qfloat8_disk_on_cuda,load_qfloat8_pinned_on_cuda --save "$OUT/load.json"
stage comfy_formats 60 python3 benchmarks/comfy_formats.py --device cuda --rounds 5
stage device_sharing 60 python3 benchmarks/device_sharing.py --device cuda --json "$OUT/device_sharing.json"
stage suite 140 python3 -m pytest -q -ra -o addopts="" -n 14 -p no:cacheprovider tests
