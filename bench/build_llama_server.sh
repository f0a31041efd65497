#!/usr/bin/env bash
# Builds llama.cpp's own C++ `llama-server` (the peer of bench/serve_peer.py) from the llama.cpp source that
# llama-cpp-python's sdist on PyPI vendors (vendor/llama.cpp), outside the repo: a benchmark dependency, never a
# runtime or CI one. PyPI is the only registry reachable here, hence the sdist rather than a git clone.
#   bash bench/build_llama_server.sh [VERSION] [DEST]     (defaults: 0.3.36, /tmp/llama-server-build)
# Result: $DEST/bin/llama-server. On 2 cores busy with other work (load ~15) it was at 42% after 30 minutes (-j2).
# Shortcut: LINK_LIBS=/tmp/llamacpp-venv/lib/python3.11/site-packages/lib (llama-cpp-python of the same VERSION,
# built with CMAKE_ARGS="-DGGML_NATIVE=ON", installs libllama, libllama-common, libmtmd and libggml* there) compiles
# only the server's own sources (15 files, 12 minutes on 2 busy cores) and links them to those libraries.
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
mkdir -p "$DEST/bin"
if [ -n "${LINK_LIBS:-}" ]; then
  cmake --build "$DEST/build" --target llama-ui -j"${JOBS:-2}"  # generates ui.cpp (a stub without the web UI)
  OBJ=$DEST/server-obj; mkdir -p "$OBJ"
  export LLAMA OBJ UI=$DEST/build/tools/ui
  # The flags tools/server/CMakeLists.txt gives these files (defines of the server and of cpp-httplib); an object
  # already there is kept (delete $OBJ to rebuild).
  ls "$LLAMA"/tools/server/*.cpp "$LLAMA/vendor/cpp-httplib/httplib.cpp" "$UI/ui.cpp" | xargs -P"${JOBS:-2}" -n1 \
    sh -c 'o="$OBJ/$(basename "$1").o"; [ -f "$o" ] || c++ -std=c++17 -O3 -DNDEBUG -DGGML_USE_CPU -DLLAMA_SUBPROCESS -DCPPHTTPLIB_TCP_NODELAY=1 \
      -DCPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH=1048576 -DCPPHTTPLIB_LISTEN_BACKLOG=512 \
      -DCPPHTTPLIB_REQUEST_URI_MAX_LENGTH=32768 -w -I"$LLAMA/tools/server" -I"$LLAMA/tools/mtmd" -I"$LLAMA" \
      -I"$LLAMA/common" -I"$LLAMA/vendor" -I"$LLAMA/include" -I"$LLAMA/ggml/include" -I"$UI" \
      -I"$LLAMA/vendor/cpp-httplib" -c "$1" -o "$o"' _
  c++ "$OBJ"/*.o -o "$DEST/bin/llama-server" -L"$LINK_LIBS" -lllama-common -lmtmd -lllama -lggml -lggml-base \
    -lggml-cpu -Wl,-rpath,"$LINK_LIBS" -lpthread -lssl -lcrypto
else
  cmake --build "$DEST/build" --target llama-server -j"${JOBS:-2}"
  cp "$DEST/build/bin/llama-server" "$DEST/bin/llama-server"
fi
"$DEST/bin/llama-server" --version 2>&1 | tail -2
echo "built $DEST/bin/llama-server"
