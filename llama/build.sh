#!/usr/bin/env bash
# Install llama-cpp-python built from its sdist with dgr's layer-range patches (llama/patches/) and its
# ctypes mirror of the struct they change (llama/bindings/), and, for a CPU build, llama.cpp's own
# test-llama-archs from the same patched source (tests/test_llama_archs.py runs it).
#
# usage: llama/build.sh PYTHON VERSION "CMAKE_ARGS"
#
# The wheel is cached under $DGR_WHEEL_CACHE (default ~/.cache/dgr/wheels), keyed by the sha256 of the
# sdist, of the patches (both folders) and of the CMake arguments: a second install, and CI on a machine that built
# it once, only unpacks it. An installed build whose key matches is left alone.
#
# Two settings for a machine that reaches no package registry (gpu/device-run.sh on a GPU machine):
#   DGR_OFFLINE=1          pip neither downloads nor isolates the build: the sdist must be in the cache already,
#                          and the build's own needs (scikit-build-core, CMake, ninja) installed beside PYTHON.
#   DGR_LLAMA_BUILD_DIR=D  the patched source and CMake's build tree stay under D/VERSION-KEY: a build cut off
#                          resumes where it stopped, and tools can be built from the same tree afterwards.
set -euo pipefail

PY=$1
VERSION=$2
CMAKE_ARGS_IN=$3
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${DGR_WHEEL_CACHE:-$HOME/.cache/dgr/wheels}"
mkdir -p "$CACHE/sdist"

pip_offline=()
[ "${DGR_OFFLINE:-0}" = 1 ] && pip_offline=(--no-index)
sdist="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ] && [ "${DGR_OFFLINE:-0}" = 1 ]; then
    echo "llama/build.sh: DGR_OFFLINE=1 and no $sdist" >&2
    exit 1
fi
if [ ! -f "$sdist" ]; then
    tmp="$(mktemp -d "$CACHE/sdist/.dl-XXXXXX")"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    mv "$tmp/llama_cpp_python-$VERSION.tar.gz" "$sdist"
    rm -rf "$tmp"
fi

key="$( { sha256sum "$sdist" | cut -d' ' -f1; cat "$HERE"/patches/*.patch | sha256sum | cut -d' ' -f1; \
          cat "$HERE"/bindings/*.patch | sha256sum | cut -d' ' -f1; echo "$CMAKE_ARGS_IN"; } | sha256sum | cut -c1-16)"
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
bindir="$(dirname "$PY")"
marker="$site/llama_cpp/.dgr-layer-range-$key"
# the test binary is built for the CPU only: a GPU build leaves the CPU build's in place
case "$CMAKE_ARGS_IN" in *GGML_VULKAN=ON*|*GGML_CUDA=ON*) with_test=0 ;; *) with_test=1 ;; esac
if [ -f "$marker" ] && { [ "$with_test" = 0 ] || [ -x "$bindir/test-llama-archs" ]; }; then
    exit 0
fi

wheels="$CACHE/$VERSION-$key"
if [ -n "${DGR_LLAMA_BUILD_DIR:-}" ]; then
    work="$DGR_LLAMA_BUILD_DIR/$VERSION-$key"
    mkdir -p "$work"
    export SKBUILD_BUILD_DIR="$work/build"  # scikit-build-core's build-dir: kept, so a second build is incremental
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
fi
src="$work/llama_cpp_python-$VERSION"
patched=0
[ -f "$work/.patched" ] && patched=1  # a kept source, patched by an earlier run
patch_source() {
    [ "$patched" = 1 ] && return
    rm -rf "$src"
    tar -xzf "$sdist" -C "$work"
    for p in "$HERE"/patches/*.patch; do
        echo "applying $(basename "$p")"
        patch -s -p1 -d "$src/vendor/llama.cpp" < "$p"
    done
    # the binding's ctypes mirror of what the series changes in llama.h
    for p in "$HERE"/bindings/*.patch; do
        echo "applying $(basename "$p")"
        patch -s -p1 -d "$src" < "$p"
    done
    touch "$work/.patched"
    patched=1
}

if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    patch_source
    echo "building llama-cpp-python $VERSION with the layer-range patches (3 to 8 minutes on 2 cores)"
    mkdir -p "$wheels.tmp"
    wheel_opts=(--no-deps)
    [ "${DGR_OFFLINE:-0}" = 1 ] && wheel_opts+=(--no-index --no-build-isolation)
    CMAKE_ARGS="$CMAKE_ARGS_IN" "$PY" -m pip wheel -q "${wheel_opts[@]}" "$src" -w "$wheels.tmp"
    rm -rf "$wheels"
    mv "$wheels.tmp" "$wheels"
fi
if [ "$with_test" = 1 ] && [ ! -x "$wheels/test-llama-archs" ]; then
    patch_source
    echo "building llama.cpp's test-llama-archs from the same source (3 to 8 minutes on 2 cores)"
    # static, so that it needs no library beside it; the wheel's own CPU flags
    # shellcheck disable=SC2086
    cmake -S "$src/vendor/llama.cpp" -B "$work/tests" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $CMAKE_ARGS_IN >/dev/null
    cmake --build "$work/tests" --target test-llama-archs -j "$(nproc)" >/dev/null
    cp "$work/tests/bin/test-llama-archs" "$wheels/test-llama-archs.tmp"
    mv "$wheels/test-llama-archs.tmp" "$wheels/test-llama-archs"
fi
if [ ! -f "$marker" ]; then
    wheel="$(ls "$wheels"/llama_cpp_python-*.whl)"
    "$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
    "$PY" -m pip install -q ${pip_offline[@]+"${pip_offline[@]}"} "$wheel"  # its own dependencies, where missing
    rm -f "$site"/llama_cpp/.dgr-layer-range-*  # another build's, outside the wheel's RECORD: pip leaves it
    touch "$marker"
fi
if [ "$with_test" = 1 ]; then
    cp "$wheels/test-llama-archs" "$bindir/test-llama-archs"
fi
