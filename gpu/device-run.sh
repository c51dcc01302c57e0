#!/usr/bin/env bash
# Issue 53's GPU run on a lent GPU machine (one H100 or H200, 16 cores, no network): the CUDA build of dgr's
# llama-cpp-python and of llama-server, CUDA's certification, and the benchmarks beside llama-server -ngl 99.
# gpu/README.md says how to call it with the device tool; gpu/carry.sh makes the .gpu-carry/ it needs.
#
#   bash gpu/device-run.sh [--dry-run] [STEP|PHASE ...]      (default: all)
#
# Steps, in order; each one that ends well leaves build/gpu-run/done/STEP, and is skipped by a later call on the
# same (warm) machine, so a call cut off resumes where it stopped:
#   setup    install .gpu-carry/whl into python3 (the image's, /opt/torch/.venv), put the sdist where
#            llama/build.sh looks; then `shapes` starts in the background (the random GGUFs, about a minute)
#   build    llama/build.sh with the Makefile's GPU=cuda flags, offline, its CMake tree kept (a cut build resumes)
#   check    what the build sees (env.json); stops the run if it sees no CUDA device
#   server   llama-server from that same tree (tools switched on, only that target): the same kernels as dgr
#   certify  GPU_FAMILIES split == whole on CUDA, fusion on and off (certify.json)
#   mixed    the 1B shape: split on the GPU, GPU head + CPU tail, against whole (mixed.json)
#   bench    1B, 8B and the MoE: dgr routes on the GPU beside llama-server -ngl 99 (bench.json)
#   summary  summary.md from the JSON files (always runs)
# Phases: all = every step; phase1 = setup build check server certify mixed; phase2 = setup build check server
# bench (the steps done already are no-ops).
#
# Each step runs only if the time left in this call (GPU_RUN_BUDGET_S, default 570 s of the device's 600)
# is enough for it, and under a timeout that leaves time for the summary. Results go to build/gpu-run/out and
# are copied to $OUT after every step (at most 8 files come back: log.txt, build.log, env.json, certify.json,
# mixed.json, bench.json, summary.md, state.txt).
#
# --dry-run: the plumbing on a machine without a GPU: .venv's build as it is (no setup, build or server), every
# step on the CPU (gpu_run --cpu: tiny shapes, 1 thread), the CPU llama-server of dgr.bench.peers.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=${GPU_RUN_DRY:-0}
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
export GPU_RUN_DRY=$DRY
[ $# -gt 0 ] || set -- all
STATE=$REPO/build/gpu-run
RES=$STATE/out
OUTDIR=${OUT:-$STATE/out-collected}
CARRY=$REPO/.gpu-carry
SELF=$REPO/gpu/device-run.sh
START=${GPU_RUN_START:-$(date +%s)}  # a step's process counts from its call's start
export GPU_RUN_START=$START
BUDGET=${GPU_RUN_BUDGET_S:-570}
RESERVE=25  # seconds kept for the summary and the copy to $OUT
VERSION=$(sed -n 's/^LLAMA_VERSION := //p' Makefile)
mkdir -p "$STATE/done" "$RES" "$OUTDIR"
# a step runs as `bash gpu/device-run.sh __step NAME` under timeout, its output already going to the log
[ "$1" = __step ] || exec > >(tee -a "$RES/log.txt" "$OUTDIR/log.txt") 2>&1

log() { echo "[device-run $(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
record() { echo "$(date +%H:%M:%S) $*" >> "$RES/state.txt"; log "$*"; }
sync_out() {
    [ -f "$RES/build.log" ] && [ "$(stat -c %s "$RES/build.log")" -gt 15000000 ] \
        && tail -c 12000000 "$RES/build.log" > "$RES/build.log.tmp" && mv "$RES/build.log.tmp" "$RES/build.log"
    for f in "$RES"/*; do
        [ "$(basename "$f")" = log.txt ] || cp -f "$f" "$OUTDIR/" 2>/dev/null
    done
}

if [ "$DRY" = 1 ]; then
    PY=$REPO/.venv/bin/python
    CPU=(--cpu)
else
    PY=$(command -v python3)
    CPU=()
    export XDG_CACHE_HOME=$STATE/cache     # the random GGUFs: kept on a warm machine
    export DGR_WHEEL_CACHE=$STATE/wheels DGR_LLAMA_BUILD_DIR=$STATE/llama DGR_OFFLINE=1
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=$CARRY/whl PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
    export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    # the toolkit where CMake and the loader may not look by themselves (nvcc off the PATH; libcublas for
    # libggml-cuda, whose installed RUNPATH is only $ORIGIN)
    for d in /usr/local/cuda/bin; do [ -x "$d/nvcc" ] && case ":$PATH:" in *":$d:"*) ;; *) export PATH=$PATH:$d ;; esac; done
    command -v nvcc >/dev/null && export CUDACXX=${CUDACXX:-$(command -v nvcc)}
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d
    done
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
VOCAB=$CARRY/vocab.gguf
[ "$DRY" = 0 ] || [ -f "$VOCAB" ] || VOCAB=$STATE/vocab.gguf  # a dry run without gpu/carry.sh makes its own
SERVER_BIN=$STATE/server/llama-server
DRIVER=("$PY" -m dgr.bench.gpu_run)

# run_step NAME MIN_SECONDS COMMAND...: once, if MIN_SECONDS are left, under a timeout that keeps RESERVE
run_step() {
    local name=$1 min=$2 t0 rc budget
    shift 2
    if [ -f "$STATE/done/$name" ]; then log "$name: done earlier"; return 0; fi
    budget=$(( $(left) - RESERVE ))
    if [ "$budget" -lt "$min" ]; then record "$name: skipped, ${budget}s left (it wants ${min}s)"; return 1; fi
    log "$name: start (${budget}s at most)"
    t0=$(date +%s)
    timeout --kill-after=10 "$budget" "$@"
    rc=$?
    if [ $rc = 0 ]; then
        touch "$STATE/done/$name"
        record "$name: ok in $(( $(date +%s) - t0 ))s"
    else
        record "$name: FAILED (exit $rc$([ $rc = 124 ] && echo ', out of time')) after $(( $(date +%s) - t0 ))s"
    fi
    sync_out
    return $rc
}

step_setup() {
    log "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
    log "python3: $PY ($("$PY" -V 2>&1)); nvcc: $(nvcc --version 2>&1 | tail -1); cmake: $(cmake --version 2>&1 | head -1); ninja: $(ninja --version 2>&1)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile "$CARRY"/whl/*.whl || return 1
    "$PY" -c 'import trio, quart_trio, quart, hypercorn, flask, cryptography, gguf, diskcache, attrs, httpx, numpy
print("imports ok")' || return 1
    mkdir -p "$DGR_WHEEL_CACHE/sdist"
    cp -f "$CARRY/sdist/llama_cpp_python-$VERSION.tar.gz" "$DGR_WHEEL_CACHE/sdist/"
}

step_build() {
    local args
    args=$("${DRIVER[@]}" cmake-args --cuda-archs "${CUDA_ARCHS:-90}") || return 1
    log "llama/build.sh with: $args (output: build.log)"
    bash llama/build.sh "$PY" "$VERSION" "$args" >> "$RES/build.log" 2>&1
    local rc=$?
    tail -5 "$RES/build.log"
    # a library the loader will not find shows here rather than as an import error later
    local lib
    lib=$("$PY" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")' 2>/dev/null)
    [ -n "$lib" ] && ldd "$lib"/libggml-cuda.so 2>&1 | grep -E "not found|cublas|cudart" | sed 's/^/ldd libggml-cuda.so: /'
    return $rc
}

step_server() {
    local cache tree src
    cache=$(ls -t "$DGR_LLAMA_BUILD_DIR"/"$VERSION"-*/build/CMakeCache.txt 2>/dev/null | head -1)
    [ -n "$cache" ] || { log "no kept CMake tree under $DGR_LLAMA_BUILD_DIR"; return 1; }
    # the paths as the wheel's build spelled them: another spelling of the same folder changes every compile
    # command, and ninja builds everything again
    tree=$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$cache")
    src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$cache")
    # only switches tools on: the library's objects keep their flags, so only the server's own sources compile
    # (mtmd, which the server links, and the server: 73 steps where the wheel's tree has a few hundred)
    cmake -S "$src" -B "$tree" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
        >> "$RES/build.log" 2>&1 || return 1
    cmake --build "$tree" --target llama-server -j "$(nproc)" >> "$RES/build.log" 2>&1 || { tail -20 "$RES/build.log"; return 1; }
    mkdir -p "$STATE/server"
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
        "$tree/bin" "$tree/bin/llama-server" > "$SERVER_BIN"
    chmod +x "$SERVER_BIN"
    "$SERVER_BIN" --version 2>&1 | tail -2
    "$SERVER_BIN" --list-devices 2>&1 | tail -3
}

# the shapes are written by one background process (it leaves done/shapes); a step that needs them waits for it
# (a step's own process learns its pid from the environment)
export SHAPES_PID=${SHAPES_PID:-}
start_shapes() {
    [ -f "$STATE/done/shapes" ] && return 0
    [ -f "$VOCAB" ] || "$PY" -c 'import sys; from pathlib import Path; from dgr.bench.shapes import write_vocab_gguf
write_vocab_gguf(Path(sys.argv[1]))' "$VOCAB"
    log "shapes: writing the random GGUFs in the background"
    "${DRIVER[@]}" shapes --vocab "$VOCAB" --done "$STATE/done/shapes" "${CPU[@]}" &
    SHAPES_PID=$!
}
wait_shapes() {
    while [ -n "$SHAPES_PID" ] && kill -0 "$SHAPES_PID" 2>/dev/null; do sleep 1; done
    [ -f "$STATE/done/shapes" ] || "${DRIVER[@]}" shapes --vocab "$VOCAB" --done "$STATE/done/shapes" "${CPU[@]}"
}

step_mixed() { wait_shapes && "${DRIVER[@]}" mixed --vocab "$VOCAB" --out "$RES/mixed.json" "${CPU[@]}" \
    $([ "$DRY" = 1 ] && echo --threads 1); }
step_bench() {
    wait_shapes || return 1
    local server=() opts=()
    if [ "$DRY" = 1 ]; then
        opts=(--threads 1 --rounds 1 --decode-tokens 8 --prompt-tokens 32 --short-tokens 8)
    else
        server=(--llama-server "$SERVER_BIN")
    fi
    "${DRIVER[@]}" bench --vocab "$VOCAB" --out "$RES/bench.json" "${server[@]}" "${opts[@]}" "${CPU[@]}" \
        --deadline-s $(( $(left) - RESERVE - 10 ))
}

if [ "$1" = __step ]; then
    "step_$2"
    exit $?
fi

steps=()
for p in "$@"; do
    case $p in
        all) steps+=(setup build check server certify mixed bench) ;;
        phase1) steps+=(setup build check server certify mixed) ;;
        phase2) steps+=(setup build check server bench) ;;
        setup|build|server|check|certify|mixed|bench|summary) steps+=("$p") ;;
        *) echo "gpu/device-run.sh: unknown step $p" >&2; exit 2 ;;
    esac
done
log "steps: ${steps[*]}; ${BUDGET}s budget; dry run: $DRY; done before: $(ls "$STATE/done" | tr '\n' ' ')"
record "call begins: ${steps[*]}"

stop=0
for s in "${steps[@]}"; do
    [ "$stop" = 1 ] && { record "$s: not run (an earlier step this needs failed)"; continue; }
    case $s in
        setup)
            if [ "$DRY" = 1 ]; then log "setup: dry run, .venv as it is"; else run_step setup 20 bash "$SELF" __step setup || stop=1; fi
            [ "$stop" = 1 ] || start_shapes ;;
        build)
            [ "$DRY" = 1 ] && { log "build: dry run, .venv's build"; continue; }
            run_step build 60 bash "$SELF" __step build || stop=1 ;;
        server)
            [ "$DRY" = 1 ] && { log "server: dry run, dgr.bench.peers' CPU llama-server"; continue; }
            run_step server 45 bash "$SELF" __step server ;;  # the benchmarks need it; certify does not
        check) run_step check 10 "${DRIVER[@]}" check --out "$RES/env.json" "${CPU[@]}" || stop=1 ;;
        certify)
            opts=(--jobs 12); [ "$DRY" = 1 ] && opts=(--jobs 1 --families llama,qwen3moe)
            run_step certify 75 "${DRIVER[@]}" certify --out "$RES/certify.json" "${opts[@]}" "${CPU[@]}" ;;
        mixed) run_step mixed 30 bash "$SELF" __step mixed ;;
        bench)
            if [ "$DRY" = 0 ] && [ ! -f "$STATE/done/server" ]; then record "bench: not run (no llama-server)"; continue; fi
            run_step bench 90 bash "$SELF" __step bench ;;
        summary) ;;
    esac
done
# a call that ends before the shapes were needed: no child may outlive it holding the output open (the file it
# was writing is a .part that the next call writes again)
if [ -n "$SHAPES_PID" ]; then kill "$SHAPES_PID" 2>/dev/null; wait "$SHAPES_PID" 2>/dev/null; fi
"${DRIVER[@]}" summary --dir "$RES" > /dev/null && log "summary.md written"
record "call ends after $(( $(date +%s) - START ))s; done: $(ls "$STATE/done" | tr '\n' ' ')"
sync_out
cp -f "$RES/log.txt" "$OUTDIR/log.txt" 2>/dev/null
exit 0
