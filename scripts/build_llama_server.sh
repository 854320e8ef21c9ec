#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-bench` and `llama-batched-bench` from the tree
# vendored in the llama-cpp-python sdist, and converts the bundled model's cached
# safetensors folder into a GGUF with that tree's own `convert_hf_to_gguf.py`: the peer that
# `make compat` checks the remote side against and `batchlens bench --llamacpp` measures
# beside the engine on the same weights. PyPI is the one source that every development
# machine reaches, so the sdist stands in for a git clone.
#
#   scripts/build_llama_server.sh               build and convert once (~8 min on 2 cores)
#   scripts/build_llama_server.sh --path        print llama-server's path (after a build)
#   scripts/build_llama_server.sh --bin-dir     print the folder of the three binaries
#   scripts/build_llama_server.sh --convert FOLDER [OUTTYPE]
#                                               convert another HF folder (OUTTYPE bf16,
#                                               f16 or f32; default bf16)
#
# Cached in ~/.cache/batchlens/llama.cpp-$VERSION/ (override with BATCHLENS_LLAMA_CACHE);
# the binaries there are the build's stamp and each GGUF under gguf/ its own: what exists is
# neither downloaded, built nor converted again. A GGUF is named after the safetensors
# folder it comes from and its type: gguf/<folder name>.<outtype>.gguf.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${BATCHLENS_LLAMA_CACHE:-$HOME/.cache/batchlens/llama.cpp-$VERSION}
BIN_DIR=$CACHE/build/bin
TARGETS=(llama-server llama-bench llama-batched-bench)
PY=${PY:-python3}
JOBS=${JOBS:-2}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case "${1:-}" in
  --path) echo "$BIN_DIR/llama-server"; exit 0 ;;
  --bin-dir) echo "$BIN_DIR"; exit 0 ;;
esac

step() { echo "[build_llama_server $(date +%H:%M:%S)] $*"; }

built() {
  local t
  for t in "${TARGETS[@]}"; do [[ -x "$BIN_DIR/$t" ]] || return 1; done
}

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
  step "building ${TARGETS[*]} with $JOBS jobs (~8 min on 2 cores; log: $CACHE/build.log)"
  # the build's own [NN%] lines are the progress; show one in ten so the log stays short
  cmake --build "$CACHE/build" --target "${TARGETS[@]}" -j"$JOBS" 2>&1 \
    | tee "$CACHE/build.log" \
    | awk '/^\[ *[0-9]+%\]/ { if (++n % 10 == 1) print; fflush() } /error/ { print; fflush() }'
  built || { echo "${TARGETS[*]} were not all built; see $CACHE/build.log" >&2; exit 1; }
}

bundled_folder() {
  # the safetensors folder the engine loads the bundled model from (made on first use)
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    "from engine.models.loader import bundled_gguf_path, convert_gguf; print(convert_gguf(bundled_gguf_path()))"
}

convert() {
  # $1: an HF folder, $2: bf16, f16 or f32. The converter reads a Llama tokenizer through
  # sentencepiece's import even when it then takes tokenizer.json: install it for the
  # conversion only (it is no dependency of batchlens)
  local folder=$1 outtype=${2:-bf16}
  local out=$CACHE/gguf/$(basename "$folder").$outtype.gguf
  if [[ -f "$out" ]]; then
    echo "gguf: cached at $out"
    return 0
  fi
  "$PY" -c "import sentencepiece" 2>/dev/null || {
    step "installing sentencepiece (for convert_hf_to_gguf.py only)"
    "$PY" -m pip install -q "sentencepiece==0.2.3"
  }
  mkdir -p "$CACHE/gguf"
  step "converting $folder to $outtype with the tree's convert_hf_to_gguf.py"
  PYTHONPATH="$CACHE/src/gguf-py" "$PY" "$CACHE/src/convert_hf_to_gguf.py" "$folder" \
    --outtype "$outtype" --outfile "$out.part" >"$CACHE/convert.log" 2>&1 \
    || { echo "conversion failed; see $CACHE/convert.log" >&2; exit 1; }
  mv "$out.part" "$out"
  step "gguf: $out"
}

if [[ "${1:-}" == "--convert" ]]; then
  [[ -d "${2:-}" ]] || { echo "--convert FOLDER: ${2:-(none)} is not a folder" >&2; exit 2; }
  fetch_source
  convert "$2" "${3:-bf16}"
  exit 0
fi
if built; then
  echo "llama.cpp: ${TARGETS[*]} cached in $BIN_DIR"
else
  need_tools
  fetch_source
  build
  step "done: ${TARGETS[*]} in $BIN_DIR"
fi
folder=$(bundled_folder) || { echo "could not find the bundled model's folder (PY=$PY)" >&2; exit 1; }
convert "$folder" bf16
