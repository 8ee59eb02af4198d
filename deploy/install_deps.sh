#!/usr/bin/env bash
# Installs the Debian 12 packages attnserve needs. Idempotent: when everything is
# present it only checks (a second or two) and installs nothing.
#
#   deploy/install_deps.sh            build + test dependencies (default; deploy/test.sh)
#   deploy/install_deps.sh --build    only what building the server and attnctl needs
#                                     (deploy/serve.sh, the Dockerfile's build stage)
#   deploy/install_deps.sh --runtime  only what the built binaries need at run time
#   deploy/install_deps.sh --print-runtime  print that list
#   deploy/install_deps.sh --fuzz     clang and its sanitizer/libFuzzer runtimes (deploy/fuzz.sh; not CI)
set -euo pipefail

BUILD_PKGS=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libdnnl-dev ocl-icd-opencl-dev libabsl-dev prometheus-cpp-dev
  zlib1g-dev libssl-dev nlohmann-json3-dev libjemalloc-dev libcivetweb-dev
)
# Libraries only the tests and benchmarks link (ATTNSERVE_BUILD_TESTS=ON), and
# ccache, through which deploy/test.sh's builds share objects.
TEST_BUILD_PKGS=(libgtest-dev libgmock-dev libbenchmark-dev ccache)
# Real peers the tests talk to: Python's gRPC client, NumPy and PyTorch as
# references (torch with OpenBLAS: without it torch falls back to the
# reference BLAS, 20x slower).
# Prometheus' own server and promtool check the metrics, the scrape config and
# the alert rules (python3-yaml derives the test's scrape config).
# The deployment checks: yamllint and docker-compose (`config` validates the
# compose file offline) lint deploy/, HAProxy (the front proxy the deployment
# ships) balances gRPC over local replicas, kubectl renders the Kubernetes
# manifests offline. stress-ng keeps every core busy while deploy/test.sh runs
# the server tests once more. python3-h2 and nghttp2-client (h2load) are the
# hostile-client suite's tools. python3-venv and python3-wheel install the Python
# package (client/python) offline into a virtual environment, as the README
# says (the venv's own pip and setuptools come with python3-venv; wheel, which
# Debian's setuptools 66 builds wheels with, from python3-wheel). curl calls
# the HTTP port's REST routes as a user would. Chromium, its WebDriver and
# python3-selenium drive the attention explorer's page in a headless browser.
TEST_PKGS=(python3 python3-grpcio python3-numpy python3-protobuf python3-venv python3-wheel curl
  python3-torch libopenblas0
  prometheus python3-yaml yamllint docker-compose openssl stress-ng
  haproxy python3-h2 nghttp2-client
  chromium chromium-driver python3-selenium)
# Debian's kubectl, unless a kubectl is installed already: another package's
# /usr/bin/kubectl (e.g. the Google Cloud SDK's) conflicts with it.
if ! command -v kubectl > /dev/null; then TEST_PKGS+=(kubernetes-client); fi
# What the built binaries load (deploy/check_runtime_deps.sh proves the list
# complete against ldd; libcivetweb1, the HTTP port's, comes with
# libprometheus-cpp-pull1.0).
RUNTIME_PKGS=(libgrpc++1.51 libgrpc29 libprotobuf32 libdnnl2 libabsl20220623 libgomp1
  libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libjemalloc2)
# Fuzzing (deploy/fuzz.sh) needs clang: libclang-rt-14-dev holds libFuzzer
# (libclang_rt.fuzzer) and clang's ASan/UBSan runtimes; libomp-14-dev is what
# clang -fopenmp links (FindOpenMP fails without it). CI does not fuzz.
FUZZ_PKGS=(clang-14 libclang-rt-14-dev libomp-14-dev)

case "${1:-}" in
  --build) PKGS=("${BUILD_PKGS[@]}") ;;
  --runtime) PKGS=("${RUNTIME_PKGS[@]}") ;;
  --print-runtime) echo "${RUNTIME_PKGS[@]}"; exit 0 ;;
  --fuzz) PKGS=("${BUILD_PKGS[@]}" "${TEST_BUILD_PKGS[@]}" "${FUZZ_PKGS[@]}") ;;
  "" | --all) PKGS=("${BUILD_PKGS[@]}" "${TEST_BUILD_PKGS[@]}" "${TEST_PKGS[@]}") ;;
  -h | --help) sed -n '2,11p' "$0"; exit 0 ;;
  *) echo "install_deps.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps.sh: all ${#PKGS[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Test peers (HAProxy, Prometheus) are started by the tests themselves: keep
# their packages from starting system services (HAProxy would take its ports), as
# container images do, unless the machine already has a policy of its own.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" > /dev/null
  $SUDO chmod 755 "$POLICY"
  trap '$SUDO rm -f "$POLICY"' EXIT
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
