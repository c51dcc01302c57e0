#!/usr/bin/env bash
# What gpu/device-run.sh needs on a GPU machine that reaches no registry, gathered here into .gpu-carry/ (ignored
# by git; the device tool's `carry` takes it along: gpu/README.md). Run it in the checkout the session calls the
# device from, with this machine's network, before the first device call:
#
#   bash gpu/carry.sh [PYTHON]        (PYTHON: default .venv/bin/python; prints .gpu-carry's size)
#
#   .gpu-carry/sdist/llama_cpp_python-VERSION.tar.gz  the llama-cpp-python sdist, slimmed from 77 MB to what a
#                    CUDA build of the library and llama-server reads: no .git packs, vocabulary GGUFs, docs, web
#                    UI sources or other GPU backends (llama/build.sh patches and builds it as it would the whole)
#   .gpu-carry/whl/  Python 3.12 wheels of dgr's dependencies the machine's image lacks (KINDS.md lists what it
#                    has), installed there with --no-deps
#   .gpu-carry/vocab.gguf  the default model's tokenizer alone (1.8 MB; the model is 98 MB): the random shapes'
#   .gpu-carry/commit.txt  the commit carried (.git does not travel)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
VERSION=$(sed -n 's/^LLAMA_VERSION := //p' Makefile)
OUT=.gpu-carry
# dgr's dependencies (and theirs) that the GPU image does not hold, at the versions this checkout tests with; and
# two it holds at a version that may be too old (flask wants werkzeug>=3.1, trio attrs>=23.2). Not h11: the
# image's httpcore pins the h11 it has.
WHEELS=(trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 quart-trio==0.12.0 quart==0.22.0 hypercorn==0.18.0
        h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2 flask==3.1.3 werkzeug==3.1.9
        blinker==1.9.0 itsdangerous==2.2.0 cryptography==51.0.1 cffi==2.1.1 pycparser==3.12 gguf==0.19.0
        diskcache==5.6.3 attrs==26.1.0)
# what a CUDA build of the library and of llama-server does not read (paths under vendor/llama.cpp)
DROP=(.git models/ggml-vocab-* docs benches media examples gguf-py conversion tools/ui/src tools/ui/tests
      tools/ui/static tools/ui/scripts tools/ui/package-lock.json)
for b in blas cann et hip metal musa rpc virtgpu sycl vulkan webgpu zdnn opencl hexagon zendnn openvino; do
    DROP+=("ggml/src/ggml-$b")
done

mkdir -p "$OUT/sdist" "$OUT/whl"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

full="${DGR_WHEEL_CACHE:-$HOME/.cache/dgr/wheels}/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$full" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
    full="$work/llama_cpp_python-$VERSION.tar.gz"
fi
slim="$OUT/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$slim" ] || [ "$full" -nt "$slim" ] || [ "$0" -nt "$slim" ]; then
    tar -xzf "$full" -C "$work" --exclude="llama_cpp_python-$VERSION/.git" --exclude="*/vendor/llama.cpp/.git"
    top="$work/llama_cpp_python-$VERSION"
    for d in "${DROP[@]}"; do
        # shellcheck disable=SC2086  # the globs are meant
        rm -rf $top/vendor/llama.cpp/$d
    done
    # a fixed order and timestamps: the same sdist gives the same file, and llama/build.sh the same wheel key
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work" -cf - "llama_cpp_python-$VERSION" \
        | gzip -n -9 > "$slim.tmp"
    mv "$slim.tmp" "$slim"
fi

# only the listed wheels travel (a version dropped from the list leaves no second copy behind)
for f in "$OUT"/whl/*.whl; do
    [ -e "$f" ] || continue
    keep=0
    for w in "${WHEELS[@]}"; do
        n=${w%%==*}
        case "$(basename "$f")" in "${n//-/_}-${w##*==}-"*) keep=1 ;; esac
    done
    [ "$keep" = 1 ] || rm -f "$f"
done
want=()
for w in "${WHEELS[@]}"; do
    name=${w%%==*}
    ls "$OUT/whl/" 2>/dev/null | grep -qi "^${name//-/_}-${w##*==}-" || want+=("$w")
done
if [ ${#want[@]} -gt 0 ]; then
    platforms=()
    for n in 39 38 37 36 35 34 33 32 31 30 29 28 27 26 25 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 -d "$OUT/whl" "${want[@]}"
fi

[ -f "$OUT/vocab.gguf" ] || "$PY" -c 'import sys; from pathlib import Path; from dgr.bench.shapes import write_vocab_gguf
write_vocab_gguf(Path(sys.argv[1]))' "$OUT/vocab.gguf"
{ git rev-parse HEAD; git status --porcelain --untracked-files=no | grep -q . && echo "+dirty"; } | paste -sd '' \
    > "$OUT/commit.txt" || true

du -sh "$OUT"/* | sed 's/^/carry: /'
du -sh "$OUT" | sed 's/^/carry, in all: /'
total=$(du -sbL "$OUT" | cut -f1)
if [ "$total" -gt $((52 * 1024 * 1024)) ]; then
    echo "gpu/carry.sh: .gpu-carry is $((total / 1048576)) MiB; the device takes 64 MiB with the whole tree" >&2
    exit 1
fi
