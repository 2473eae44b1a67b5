#!/usr/bin/env bash
# The GPU check of sharded sites (docs/sharded-sites.md, "On a GPU"), one time-boxed script for a
# machine with one CUDA GPU, 16 cores and 64 GB or more, where a lease's minutes are few:
#
#   1. the environment: the GPU's name, torch, the project's imports;
#   2. a site of one rank on the GPU (torchrun, FSDP2 on a NCCL group of one) and an unsharded CUDA peer
#      training together in DiLoCo with int8 over loopback at ~1B parameters (bench_sharded_swarm):
#      equal state digests after every outer step, round times, GPU memory per process, host memory
#      while stepping; if it fails, the same at 0.4M parameters, to tell the size from the path;
#   3. with the time left, two CPU sites of 4 ranks (gloo) at ~1B parameters (bench_sharded): every
#      rank's peak RSS over the fp32 parameter bytes, identical parameters, the round's time.
#
# Usage: simulations/gpu_check.sh OUT_FOLDER [SECONDS]   (run from the repository's root; SECONDS, the
# whole budget, default 540). Logs and JSON reports go to OUT_FOLDER (at most 7 files).
set -o pipefail
out=${1:?usage: simulations/gpu_check.sh OUT_FOLDER [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python=${PYTHON:-python3}
began=$(date +%s)
left() { echo $((budget - ($(date +%s) - began))); }
say() { echo "[$(($(date +%s) - began))s] $*" | tee -a "$out/check.log"; }
step() {  # NAME SECONDS COMMAND...: the command's output to OUT/NAME.log, at most SECONDS
    local name=$1 secs=$2
    shift 2
    say "$name: start, at most ${secs}s: $*"
    local t0
    t0=$(date +%s)
    timeout -k 10 "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    say "$name: exit $rc after $(($(date +%s) - t0))s"
    tail -n 25 "$out/$name.log"
    return $rc
}

say "budget ${budget}s"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    free -g | head -2
    "$python" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
    "$python" -c 'import p2ptrain, trio, nacl, torch.distributed.fsdp as f; print("imports ok", f.fully_shard)'
} 2>&1 | tee -a "$out/check.log"

gpu=(--device cuda --ranks 1 --peer unsharded --compression int8 --skip-unsharded --checkpoint-every 0
    --eval-every 0 --target 64)
if ! step gpu 270 "$python" -m simulations.bench_sharded_swarm "${gpu[@]}" --layers 36 --heads 20 --width 1520 \
    --steps 3 --timeout 250 --json "$out/gpu.json"; then
    step gpu-small 80 "$python" -m simulations.bench_sharded_swarm "${gpu[@]}" --layers 2 --width 128 --steps 2 \
        --timeout 70 --json "$out/gpu-small.json"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$out/check.log"

secs=$(($(left) - 5))
if [ "$secs" -ge 60 ]; then
    step cpu "$secs" "$python" -m simulations.bench_sharded --size 1b --ranks "" --skip-unsharded \
        --pair-size 1b --pair-ranks 4 --pair-steps 2 --inner 1 --compression int8 --timeout "$((secs - 10))" \
        --json "$out/cpu.json"
else
    say "cpu: skipped, ${secs}s left"
fi
say "done"
