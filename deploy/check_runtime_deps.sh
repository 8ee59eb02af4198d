#!/usr/bin/env bash
# Proves the Dockerfile's runtime stage complete: every shared library the
# built binaries load must come from a package that
# `install_deps.sh --runtime` installs (or pulls in), or from the base image.
#
#   deploy/check_runtime_deps.sh BUILD_DIR
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${1:?usage: check_runtime_deps.sh BUILD_DIR}"
BINARIES=("$BUILD_DIR/server/attnserve" "$BUILD_DIR/client/attnctl")
# In debian:12-slim already (apt itself needs them).
BASE_PKGS="libc6 libgcc-s1 libstdc++6 zlib1g libssl3 libzstd1"

for b in "${BINARIES[@]}"; do
  [ -x "$b" ] || { echo "check_runtime_deps: $b is not built" >&2; exit 1; }
done

read -r -a runtime <<< "$("$REPO/deploy/install_deps.sh" --print-runtime)"
allowed="$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances "${runtime[@]}" 2>/dev/null | grep -v '^ ' |
  sed 's/:amd64$//' | sort -u) $BASE_PKGS"

missing=0
for lib in $(ldd "${BINARIES[@]}" | awk '/=> \// {print $3}' | sort -u); do
  real="$(realpath "$lib")"
  pkg="$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true)"
  pkg="${pkg%%:*}"
  if [ -z "$pkg" ]; then
    echo "check_runtime_deps: $lib belongs to no package" >&2; missing=1; continue
  fi
  if ! grep -qx "$pkg" <<< "$(tr ' ' '\n' <<< "$allowed")"; then
    echo "check_runtime_deps: $lib comes from $pkg, which the runtime stage does not install" >&2
    missing=1
  fi
done
if [ "$missing" -ne 0 ]; then exit 1; fi
echo "check_runtime_deps: every library of attnserve and attnctl comes from the runtime packages"
