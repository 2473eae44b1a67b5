#!/usr/bin/env bash
# The GPU check of sharded sites (docs/sharded-sites.md, "On a GPU"), one time-boxed script for a
# machine with one CUDA GPU, 16 cores and 64 GB or more, where a lease's minutes are few:
#
#   1. the environment: the GPU's name, torch, the project's imports;
#   2. a site of one rank on the GPU (torchrun, FSDP2 on a NCCL group of one) and an unsharded CUDA peer
#      training together in DiLoCo with int8 over loopback at ~1B parameters (bench_sharded_swarm):
#      equal state digests after every outer step, round times, GPU memory per process, host memory
#      while stepping; if it fails, the same at ~300M parameters, to tell the size from the path; each
#      node runs THREADS torch threads (default: half the cores, less one), and where `py-spy` is on the
#      PATH every node's Python stacks go to OUT/stacks.log every 30 s (a run that does not finish still
#      says where its time went);
#   3. with the time left, two CPU sites of 4 ranks (gloo) at ~1B parameters (bench_sharded): every
#      rank's peak RSS over the fp32 parameter bytes, identical parameters, the round's time.
#
# Usage: simulations/gpu_check.sh OUT_FOLDER [SECONDS] [PARTS]   (from the repository's root; SECONDS, the
# whole budget, default 540; PARTS, default "gpu cpu": which of 2 and 3 to run). Logs and JSON reports go
# to OUT_FOLDER (at most 8 files). Sizes: on one H200 at 7 threads, the 1B pair's first round formed
# about 40 s after the script began and committed 44 s later, and a 1B outer step of both nodes takes
# over a minute, so give the GPU part 400 s or more; two 1B CPU sites of 4 ranks need minutes more:
# with a budget under about 15 minutes, run one part per lease.
set -o pipefail
out=${1:?usage: simulations/gpu_check.sh OUT_FOLDER [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python=${PYTHON:-python3}
threads=${THREADS:-$(($(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / 2 - 1))}  # (nproc itself heeds OMP_NUM_THREADS)
[ "$threads" -ge 1 ] || threads=1
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
    env -u OMP_NUM_THREADS nproc
    free -g | head -2
    "$python" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
    "$python" -c 'import p2ptrain, trio, nacl, torch.distributed.fsdp as f; print("imports ok", f.fully_shard)'
} 2>&1 | tee -a "$out/check.log"

parts=${3:-gpu cpu}
gpu=(--device cuda --ranks 1 --peer unsharded --compression int8 --skip-unsharded --checkpoint-every 0
    --eval-every 0 --target 64 --threads "$threads")
stacks() {  # every 30 s, the Python stacks of every node of this run (py-spy), while the GPU part runs
    command -v py-spy >/dev/null || return 0
    while sleep 30; do
        for pid in $(pgrep -f "p2ptrain node"); do
            echo "=== [$(($(date +%s) - began))s] pid $pid: $(tr '\0' ' ' </proc/"$pid"/cmdline | cut -c1-120)"
            timeout 20 py-spy dump --pid "$pid" 2>&1 | head -60
        done >>"$out/stacks.log"
    done
}
if [[ " $parts " == *" gpu "* ]]; then
    secs=$(($(left) - 5))
    [[ " $parts " == *" cpu "* ]] && secs=$((secs / 2))
    stacks &
    sampler=$!
    if ! step gpu "$secs" "$python" -m simulations.bench_sharded_swarm "${gpu[@]}" --layers 36 --heads 20 \
        --width 1520 --steps 2 --timeout "$((secs - 15))" --json "$out/gpu.json" && [ "$(left)" -ge 90 ]; then
        secs=$(($(left) - 10))
        step gpu-mid "$secs" "$python" -m simulations.bench_sharded_swarm "${gpu[@]}" --layers 24 --heads 16 \
            --width 1024 --steps 2 --timeout "$((secs - 10))" --json "$out/gpu-mid.json"
    fi
    kill "$sampler" 2>/dev/null
    nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$out/check.log"
fi

if [[ " $parts " == *" cpu "* ]]; then
    secs=$(($(left) - 5))
    if [ "$secs" -ge 60 ]; then
        step cpu "$secs" "$python" -m simulations.bench_sharded --size 1b --ranks "" --skip-unsharded \
            --pair-size 1b --pair-ranks 4 --pair-steps 2 --inner 1 --compression int8 \
            --timeout "$((secs - 10))" --json "$out/cpu.json"
    else
        say "cpu: skipped, ${secs}s left"
    fi
fi
say "done"
