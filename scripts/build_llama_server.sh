#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from the tree vendored in the llama-cpp-python sdist,
# the peer that `make compat` checks the remote side against. PyPI is the one source that
# every development machine reaches, so the sdist stands in for a git clone.
#
#   scripts/build_llama_server.sh          build once (~8 min on 2 cores), then a no-op
#   scripts/build_llama_server.sh --path   print the binary's path (after a build)
#
# Cached in ~/.cache/batchlens/llama.cpp-$VERSION/ (override with BATCHLENS_LLAMA_CACHE);
# the binary there is the stamp: when it exists, nothing is downloaded or built.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${BATCHLENS_LLAMA_CACHE:-$HOME/.cache/batchlens/llama.cpp-$VERSION}
BIN=$CACHE/build/bin/llama-server
PY=${PY:-python3}
JOBS=${JOBS:-2}

if [[ "${1:-}" == "--path" ]]; then
  echo "$BIN"
  exit 0
fi
if [[ -x "$BIN" ]]; then
  echo "llama-server: cached at $BIN"
  exit 0
fi

step() { echo "[build_llama_server $(date +%H:%M:%S)] $*"; }

need_tools() {
  # the build needs a C++ compiler and cmake; install them where apt is ours to use
  command -v cmake >/dev/null && command -v g++ >/dev/null && return 0
  step "installing cmake and g++ with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends cmake g++ make
}

fetch_source() {
  # the sdist carries llama.cpp as vendor/llama.cpp; unpack it once into $CACHE/src
  [[ -f "$CACHE/src/CMakeLists.txt" ]] && return 0
  step "downloading llama-cpp-python==$VERSION (sdist) from PyPI"
  local dl=$CACHE/download
  mkdir -p "$dl"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$dl"
  step "unpacking vendor/llama.cpp"
  local tmp=$CACHE/unpack
  rm -rf "$tmp" && mkdir -p "$tmp"
  tar -xzf "$dl"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$CACHE/src"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$CACHE/src"
  # its .git names the sdist's submodule, which is not there: without it cmake stays quiet
  rm -f "$CACHE/src/.git"
  rm -rf "$tmp"
}

build() {
  step "configuring (cmake)"
  cmake -S "$CACHE/src" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$CACHE/cmake.log"
  step "building llama-server with $JOBS jobs (~8 min on 2 cores; log: $CACHE/build.log)"
  # the build's own [NN%] lines are the progress; show one in ten so the log stays short
  cmake --build "$CACHE/build" --target llama-server -j"$JOBS" 2>&1 | tee "$CACHE/build.log" \
    | awk '/^\[ *[0-9]+%\]/ { if (++n % 10 == 1) print; fflush() } /error/ { print; fflush() }'
  [[ -x "$BIN" ]] || { echo "llama-server was not built; see $CACHE/build.log" >&2; exit 1; }
}

need_tools
fetch_source
build
step "done: $BIN"
