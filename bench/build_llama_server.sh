#!/usr/bin/env bash
# Builds llama.cpp's llama-server once, for bench/latency_bench.py, from the llama.cpp sources vendored in
# the pinned llama-cpp-python sdist (PyPI), into a cache folder outside the repository (never committed).
# GGML_NATIVE=OFF with explicit AVX2/FMA/F16C, plus AVX-512/VNNI/BF16 where this CPU lists them: on some of
# these VMs the CPU flags list AMX but AMX instructions die with SIGILL, so -march=native is not safe (AMX
# below, where it runs), and
# some (AMD EPYC Zen 3) have no AVX-512 at all, where an AVX-512 build dies with SIGILL on its first matmul.
# Builds with and without AVX-512 (and with AMX) live in separate folders, so a shared cache holds one of each.
# Prints the binary's path on the last line; exits 2 with a reason when the build is impossible.
# Usage: bench/build_llama_server.sh [JOBS]   (env: LLAMA_CPP_PYTHON_VERSION, TOKENMILL_BENCH_CACHE)
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${1:-2}"
CACHE="${TOKENMILL_BENCH_CACHE:-$HOME/.cache/tokenmill-bench}"
ROOT="$CACHE/llama.cpp-$VERSION"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
AVX512=OFF; AVX512_VNNI=OFF; AVX512_BF16=OFF
if has avx512f && has avx512bw && has avx512vl; then AVX512=ON; fi
if [[ $AVX512 == ON ]] && has avx512_vnni; then AVX512_VNNI=ON; fi
if [[ $AVX512 == ON ]] && has avx512_bf16; then AVX512_BF16=ON; fi
BUILD="$ROOT/build"
[[ $AVX512 == ON ]] || BUILD="$ROOT/build-avx2"
# AMX (Intel from Sapphire Rapids): llama.cpp's AMX kernels for its quantized types, as its own build for such a
# CPU runs them (and as tokenmill's K-quant kernels use the tiles there), where a probe shows a tile instruction
# runs here (the kernel grants the tile state). -fno-dse: GCC 12's _tile_loadconfig declares that it reads 8 of
# the config's 64 bytes, so the stores of the tile shapes were dropped and llama.cpp died with SIGILL at its first
# tilezero (tokenmill's kernels keep the stores with a compiler barrier).
amx_runs() {
  local probe
  probe=$(mktemp -d)
  cat > "$probe/amx.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64];
    memset(config, 0, sizeof config);
    config[0] = 1;                     /* palette 1 */
    config[16] = 64; config[48] = 16;  /* tile 0: 16 rows of 64 bytes */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    __asm__ volatile("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
  local ok=1
  if cc -O1 -mamx-tile "$probe/amx.c" -o "$probe/amx" 2>/dev/null && "$probe/amx" 2>/dev/null; then ok=0; fi
  rm -rf "$probe"
  return $ok
}
AMX=OFF; EXTRA_FLAGS=""
if [[ $AVX512_VNNI == ON ]] && has amx_tile && has amx_int8 && amx_runs; then
  AMX=ON; EXTRA_FLAGS="-fno-dse"; BUILD="$ROOT/build-amx"
fi
BINARY="$BUILD/bin/llama-server"
PYTHON="${PYTHON:-python3}"

if [[ -x "$BINARY" && -x "$BUILD/bin/llama-quantize" ]]; then echo "$BINARY"; exit 0; fi
for tool in cmake c++ "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "cannot build llama-server: $tool not found" >&2; exit 2; }
done
mkdir -p "$ROOT"
if [[ ! -f "$ROOT/src/CMakeLists.txt" ]]; then
  download="$ROOT/download"
  rm -rf "$download"; mkdir -p "$download"
  # The sdist's link from the simple index (what pip reads): `pip download` of an sdist builds its
  # metadata first, which needs the build backend.
  "$PYTHON" - "$VERSION" "$download" >&2 <<'PY' \
    || { echo "cannot build llama-server: the llama-cpp-python==$VERSION sdist did not download" >&2; exit 2; }
import hashlib, re, sys, urllib.request
version, folder = sys.argv[1], sys.argv[2]
with urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/", timeout=60) as reply:
    page = reply.read().decode()
url = next(u for u in re.findall(r'href="([^"]+)"', page) if u.split("#")[0].endswith(f"-{version}.tar.gz"))
target = f"{folder}/llama_cpp_python-{version}.tar.gz"
urllib.request.urlretrieve(url.split("#")[0], target)
expected = url.partition("#sha256=")[2]  # the index's own digest of the file
with open(target, "rb") as archive:
    if expected and hashlib.sha256(archive.read()).hexdigest() != expected:
        sys.exit("the sdist's sha256 does not match the index")
PY
  archive=$(ls "$download"/llama_cpp_python-*.tar.gz | head -1)
  tar -xzf "$archive" -C "$download"
  rm -rf "$ROOT/src"
  mv "$download"/llama_cpp_python-"$VERSION"/vendor/llama.cpp "$ROOT/src"
  rm -rf "$download"
fi
cmake -S "$ROOT/src" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=$AVX512 -DGGML_AVX512_VNNI=$AVX512_VNNI -DGGML_AVX512_BF16=$AVX512_BF16 -DGGML_AMX_TILE=$AMX -DGGML_AMX_INT8=$AMX \
  -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
  -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON >&2 \
  || { echo "cannot build llama-server: cmake configure failed" >&2; exit 2; }
cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS" >&2 \
  || { echo "cannot build llama-server: compile failed" >&2; exit 2; }
echo "$BINARY"
