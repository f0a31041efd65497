#!/usr/bin/env bash
# Builds llama.cpp's own C++ `llama-server` (the peer of bench/serve_peer.py) from the llama.cpp source that
# llama-cpp-python's sdist on PyPI vendors (vendor/llama.cpp), outside the repo: a benchmark dependency, never a
# runtime or CI one. PyPI is the only registry reachable here, hence the sdist rather than a git clone.
#   bash bench/build_llama_server.sh [VERSION] [DEST]     (defaults: 0.3.36, /tmp/llama-server-build)
# Result: $DEST/bin/llama-server. About 15-25 minutes on 2 shared cores (-j2).
set -euo pipefail
VERSION=${1:-0.3.36}
DEST=${2:-/tmp/llama-server-build}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PIP=${PIP:-$REPO/.venv/bin/pip}
case "$DEST" in "$REPO"*) echo "DEST must be outside the repo" >&2; exit 2;; esac
SRC=$DEST/src
mkdir -p "$SRC"
if [ ! -d "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp" ]; then
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
  tar xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
LLAMA=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp
command -v cmake >/dev/null || "$PIP" install cmake
# GGML_NATIVE: -march=native, as llama.cpp's users build it (AVX2/AVX-512 as this CPU has them).
# No curl/OpenSSL (no downloads), no web UI (its prebuilt assets come from Hugging Face, unreachable here).
cmake -S "$LLAMA" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$DEST/build" --target llama-server -j"${JOBS:-2}"
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$DEST/bin/llama-server"
"$DEST/bin/llama-server" --version 2>&1 | tail -2
echo "built $DEST/bin/llama-server"
