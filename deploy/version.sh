#!/usr/bin/env bash
# Prints attnserve's version. Its one source is project(attnserve VERSION ...) in
# CMakeLists.txt; --version, attnserve_build_info and the image's labels say it.
#
#   docker build --build-arg VERSION="$(deploy/version.sh)" \
#     --build-arg REVISION="$(git rev-parse --short=12 HEAD)" -t attnserve:"$(deploy/version.sh)" .
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,6p' "$0"; exit 0 ;; esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
version="$(sed -n 's/^project(attnserve VERSION \([0-9][0-9.]*\).*/\1/p' "$REPO/CMakeLists.txt")"
[ -n "$version" ] || { echo "version.sh: no project(attnserve VERSION ...) in CMakeLists.txt" >&2; exit 1; }
echo "$version"
