#!/usr/bin/env bash
# Install llama-cpp-python built from its sdist with dgr's layer-range patches (llama/patches/) and its
# ctypes mirror of the struct they change (llama/bindings/).
#
# usage: llama/build.sh PYTHON VERSION "CMAKE_ARGS"
#
# The wheel is cached under $DGR_WHEEL_CACHE (default ~/.cache/dgr/wheels), keyed by the sha256 of the
# sdist, of the patches (both folders) and of the CMake arguments: a second install, and CI on a machine that built
# it once, only unpacks it. An installed build whose key matches is left alone.
set -euo pipefail

PY=$1
VERSION=$2
CMAKE_ARGS_IN=$3
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${DGR_WHEEL_CACHE:-$HOME/.cache/dgr/wheels}"
mkdir -p "$CACHE/sdist"

sdist="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    tmp="$(mktemp -d "$CACHE/sdist/.dl-XXXXXX")"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    mv "$tmp/llama_cpp_python-$VERSION.tar.gz" "$sdist"
    rm -rf "$tmp"
fi

key="$( { sha256sum "$sdist" | cut -d' ' -f1; cat "$HERE"/patches/*.patch | sha256sum | cut -d' ' -f1; \
          cat "$HERE"/bindings/*.patch | sha256sum | cut -d' ' -f1; echo "$CMAKE_ARGS_IN"; } | sha256sum | cut -c1-16)"
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
marker="$site/llama_cpp/.dgr-layer-range-$key"
if [ -f "$marker" ]; then
    exit 0
fi

wheels="$CACHE/$VERSION-$key"
if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    tar -xzf "$sdist" -C "$work"
    src="$work/llama_cpp_python-$VERSION"
    for p in "$HERE"/patches/*.patch; do
        echo "applying $(basename "$p")"
        patch -s -p1 -d "$src/vendor/llama.cpp" < "$p"
    done
    # the binding's ctypes mirror of what the series changes in llama.h
    for p in "$HERE"/bindings/*.patch; do
        echo "applying $(basename "$p")"
        patch -s -p1 -d "$src" < "$p"
    done
    echo "building llama-cpp-python $VERSION with the layer-range patches (3 to 8 minutes on 2 cores)"
    mkdir -p "$wheels.tmp"
    CMAKE_ARGS="$CMAKE_ARGS_IN" "$PY" -m pip wheel -q --no-deps "$src" -w "$wheels.tmp"
    rm -rf "$wheels"
    mv "$wheels.tmp" "$wheels"
fi
wheel="$(ls "$wheels"/llama_cpp_python-*.whl)"
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" -m pip install -q "$wheel"  # its own dependencies, where missing
rm -f "$site"/llama_cpp/.dgr-layer-range-*  # another build's, outside the wheel's RECORD: pip leaves it
touch "$marker"
