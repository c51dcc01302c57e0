#!/usr/bin/env bash
# What llama.cpp's Vulkan backend needs to build and run on Debian 12, from Debian's own archive
# (../shared/GPU.md): bookworm's driver (Mesa's lavapipe), loader and shader compiler, installed; and
# trixie's Vulkan and SPIR-V headers, header-only, unpacked under DEST (bookworm's are too old for
# ggml-vulkan: no vk::LayerSettingEXT). The system's apt sources are left alone.
#
# usage: gpu/vulkan-deps.sh DEST     (prints nothing on a second run)
set -euo pipefail
DEST=$1
HEADERS=(libvulkan-dev=1.4.309.0-1 spirv-headers=1.6.1+1.4.309.0-1)

missing=()
for pkg in mesa-vulkan-drivers libvulkan1 glslc; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (Debian packages)"
    sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_=sudo
    $sudo_ apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -f "$DEST/usr/include/vulkan/vulkan.hpp" ] || [ ! -d "$DEST/usr/share/cmake/SPIRV-Headers" ]; then
    echo "fetching trixie's Vulkan headers into $DEST"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial" "$work/parts" "$work/debs"
    echo "deb http://deb.debian.org/debian trixie main" > "$work/parts/trixie.list"
    apt_=(apt-get -q -o Dir::State::Lists="$work/lists" -o Dir::Etc::SourceList=/dev/null
          -o Dir::Etc::SourceParts="$work/parts" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
    "${apt_[@]}" update >/dev/null
    (cd "$work/debs" && "${apt_[@]}" download "${HEADERS[@]}" >/dev/null)
    mkdir -p "$DEST"
    for deb in "$work"/debs/*.deb; do
        dpkg -x "$deb" "$DEST"
    done
fi
