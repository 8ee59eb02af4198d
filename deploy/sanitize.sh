#!/usr/bin/env bash
# Builds and tests attnserve under sanitizers.
#
#   deploy/sanitize.sh [asan|tsan|all]   default: asan
#
# asan: -fsanitize=address,undefined (UB aborts) in build-asan, then every
#       test labelled `asan`: those that parse untrusted input (requests,
#       checkpoints, the fuzz corpora), do buffer arithmetic (the kernels,
#       the KV cache, responses sent from the kernels' buffers) or manage
#       lifetimes across threads (the server's calls, streams and drain).
# tsan: -fsanitize=thread in build-tsan, then every test labelled `tsan`
#       (threads of ours without gRPC), against Abseil built with TSan from
#       Debian's source package of the installed version (apt-get source;
#       adds a deb-src entry for bookworm if there is none), cached in
#       build-tsan-absl/. Suppressions and what is not instrumented:
#       tests/tsan.supp.
# BUILD_ROOT (default: the repository) says where the build-* dirs go.
set -euo pipefail
shopt -s inherit_errexit
case "${1:-}" in -h | --help) sed -n '2,17p' "$0"; exit 0 ;; esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_ROOT="${BUILD_ROOT:-$REPO}"
WHAT="${1:-asan}"

run_asan() {
  local dir="$BUILD_ROOT/build-asan" start
  start=$(date +%s)
  # Only the binaries of the tests labelled `asan` (the target asan_tests).
  CMAKE_ARGS="-DATTNSERVE_SANITIZE=address,undefined" "$REPO/deploy/build.sh" "$dir" RelWithDebInfo asan_tests
  # oneDNN's JIT and OpenMP allocate per-thread buffers they free at exit in
  # ways LeakSanitizer cannot see through; the leak check stays on.
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:check_initialization_order=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest --test-dir "$dir" --output-on-failure --no-tests=error --timeout 900 -j2 -L asan
  echo "sanitize.sh: asan+ubsan built and tested in $(( $(date +%s) - start )) s"
}

# Abseil from Debian's own source package (the version installed, with
# Debian's patches: same SONAMEs, same inline namespace, same options.h),
# built as shared libraries with -fsanitize=thread into
# $BUILD_ROOT/build-tsan-absl/<version>/lib. Only the libraries named on the
# command line (and what they depend on) are built; ninja keeps them cached.
# Prints the lib directory.
build_tsan_abseil() {
  local version root src
  version="$(dpkg-query -W -f='${source:Version}' libabsl-dev)"
  root="$BUILD_ROOT/build-tsan-absl/$version"
  src="$root/src"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$root/download"
    if ! apt-cache showsrc abseil 2>/dev/null | grep -q "^Version: $version\$"; then
      # deb-src for bookworm main, in a sources file of its own.
      echo "sanitize.sh: adding Debian's bookworm source index (deb-src)" >&2
      cat > /etc/apt/sources.list.d/attnserve-debian-src.sources <<'SOURCES'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
      apt-get update -qq >&2
    fi
    (cd "$root/download" && apt-get source -qq --download-only "abseil=$version" >&2)
    rm -rf "$src"
    dpkg-source -x "$root/download/abseil_${version#*:}.dsc" "$src" >&2
  fi
  # The headers our code is compiled with (libabsl-dev's /usr/include/absl)
  # must be the ones these libraries are built from: every one is compared.
  local header count=0
  while IFS= read -r header; do
    cmp -s "/usr/include/$header" "$src/$header" \
      || { echo "sanitize.sh: $header differs between libabsl-dev and its source $version" >&2; return 1; }
    count=$((count + 1))
  done < <(cd /usr/include && find absl -type f)
  echo "sanitize.sh: the $count headers of libabsl-dev equal those of its source $version" >&2
  # Debian's flags (debian/rules: C++17, shared), plus TSan.
  cmake -S "$src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DABSL_PROPAGATE_CXX_STD=ON \
    -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$root/lib" > "$root/configure.log" 2>&1 \
    || { cat "$root/configure.log" >&2; return 1; }
  ninja -C "$root/build" "$@" >&2
  echo "$root/lib"
}

# The Abseil libraries the given programs load, as Abseil's CMake target
# names (libabsl_<name>.so: target <name>).
abseil_targets_of() {
  ldd "$@" | grep -o 'libabsl_[a-z0-9_]*\.so' | sort -u | sed 's/^libabsl_//; s/\.so$//'
}

run_tsan() {
  local dir="$BUILD_ROOT/build-tsan" start absl_lib targets bins
  start=$(date +%s)
  absl_lib="$BUILD_ROOT/build-tsan-absl/$(dpkg-query -W -f='${source:Version}' libabsl-dev)/lib"
  # Every test labelled `tsan` (the target tsan_tests depends on their
  # binaries). They are linked with an RPATH (DT_RPATH, which also applies to
  # the libraries they load, gRPC's among them) to the instrumented Abseil, so
  # every libabsl_*.so in the process is the TSan build.
  CMAKE_ARGS="-DATTNSERVE_SANITIZE=thread -DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags,-rpath,$absl_lib" \
    "$REPO/deploy/build.sh" "$dir" RelWithDebInfo tsan_tests
  mapfile -t bins < <(tr ';' '\n' < "$dir/tsan_tests.txt")
  mapfile -t targets < <(abseil_targets_of "${bins[@]}")
  local absl_start=$(date +%s)
  absl_lib="$(build_tsan_abseil "${targets[@]}")" || exit 1
  echo "sanitize.sh: instrumented Abseil (${#targets[@]} libraries) ready in $(( $(date +%s) - absl_start )) s"
  # Check that what the loader picks is the instrumented build.
  local loaded
  loaded="$(ldd "${bins[@]}" | grep -c "libabsl_.* => $absl_lib/" || true)"
  if ldd "${bins[@]}" | grep 'libabsl_' | grep -v -q " => $absl_lib/"; then
    echo "sanitize.sh: some Abseil libraries are not loaded from $absl_lib:" >&2
    ldd "${bins[@]}" | grep 'libabsl_' | grep -v " => $absl_lib/" | sort -u >&2
    exit 1
  fi
  echo "sanitize.sh: $loaded Abseil loads resolve to the instrumented build"
  # libgomp (oneDNN's OpenMP runtime) is not built with TSan: its barriers are
  # invisible, so the kernels' worker threads would look racy. One OpenMP
  # thread keeps the compute on the calling thread, which TSan sees;
  # tests/tsan.supp says what is suppressed and why.
  OMP_NUM_THREADS=1 TSAN_OPTIONS="suppressions=$REPO/tests/tsan.supp:halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0" \
    ctest --test-dir "$dir" --output-on-failure --no-tests=error --timeout 900 -j2 -L tsan
  echo "sanitize.sh: tsan built and tested in $(( $(date +%s) - start )) s"
}

case "$WHAT" in
  asan) run_asan ;;
  tsan) run_tsan ;;
  all) run_asan; run_tsan ;;
  *) echo "sanitize.sh: unknown part '$WHAT' (see --help)" >&2; exit 2 ;;
esac
