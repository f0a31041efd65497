// Does the AMX tile unit run beside 512-bit vector FP work on this CPU? The A16 AMX kernel (kernels_cupy/cpu/
// qgemm_a16_amx.h) issues a block's tile products and, between them, the fp32 epilogue of the block two before.
// This times the kernel's own pieces (block_tiles, epilogue_block; Q4, one tile of 16 rows x 32 columns, K = 576),
// one thread, in TSC ticks per block:
//   tiles      block_tiles: the B and A tile loads, 2 tilezero, 2 TDPBSUD, 2 C tiles stored to a ring slot
//   epilogue   epilogue_block for the tile's 16 rows x 2 halves: convert, scale, two FMAs into the L1 lanes
//   both       one then the other, per block, as gemm16_tiles interleaves them
// With full overlap "both" would be max(tiles, epilogue); with none, their sum. Results are garbage by design
// (random codes, no packing); times only.
//   g++ -O3 -ffp-contract=off -std=c++17 -Ikernels_cupy/cpu bench/amx_overlap.cpp -o /tmp/amx_overlap
//   taskset -c 1 /tmp/amx_overlap
#include <cstdio>
#include <vector>
#include <x86intrin.h>

#include "qgemm_core.h"

using namespace qgemm;

// main touches tiles and zmm registers itself: the target the kernel's AMX namespace is compiled for.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

int main() {
  if (!amx_on()) {
    std::printf("no AMX here (or Linux did not grant the tile state)\n");
    return 1;
  }
  constexpr int64_t M = 16, K = 576, nb = K / 32, N = 32;
  const int64_t qs = a16_code_stride(K), ss = a16_scale_stride(K);
  std::vector<int16_t> qa(a16_code_rows(M) * qs, 3);
  std::vector<float> sa(M * ss, 0.01f), xs(M * ss, 0.02f), out(M * N);
  const QArgs16 a{M, N, K, 4, qa.data(), qs, sa.data(), xs.data(), ss, nullptr, nullptr, nullptr, nullptr, out.data()};
  char* buf = static_cast<char*>(std::aligned_alloc(64, 1 << 20));  // B tiles, ring, scales: as gemm16_tiles lays them
  std::memset(buf, 1, 1 << 20);
  const auto* wt = reinterpret_cast<const uint8_t*>(buf);
  auto* ring = reinterpret_cast<int32_t*>(buf + nb * amx::kBlockW);
  auto* dv = reinterpret_cast<float*>(buf + nb * amx::kBlockW + amx::kRing * amx::kBlockTiles<true>);
  for (int64_t i = 0; i < 2 * 2 * nb * 16; ++i) dv[i] = 1e-3f;  // the scales, then the minimums: normal floats
  auto slot = [&](int64_t b) { return ring + (b % amx::kRing) * (amx::kBlockTiles<true> / 4); };
  alignas(64) __m512 acc[16 * 2 * 8];
  for (auto& v : acc) v = _mm512_setzero_ps();
  amx::configure_tiles<true>(16);
  const int64_t n = 100000;
  for (int rep = 0; rep < 3; ++rep) {
    const uint64_t t0 = __rdtsc();
    for (int64_t i = 0; i < n; ++i) amx::block_tiles<true>(a, 0, i % nb, wt, slot(i));
    const uint64_t t1 = __rdtsc();
    for (int64_t i = 0; i < n; ++i) amx::epilogue_block<true>(a, slot(i), dv, dv, 0, 16, 2, 8 + i % (nb - 8), acc);
    const uint64_t t2 = __rdtsc();
    for (int64_t i = 0; i < n; ++i) {
      amx::block_tiles<true>(a, 0, i % nb, wt, slot(i));
      amx::epilogue_block<true>(a, slot(i + 1), dv, dv, 0, 16, 2, 8 + i % (nb - 8), acc);  // the slot of i - 2
    }
    const uint64_t t3 = __rdtsc();
    std::printf("TSC ticks a block: tiles %.1f, epilogue %.1f, both %.1f\n", double(t1 - t0) / n,
                double(t2 - t1) / n, double(t3 - t2) / n);
  }
  _tile_release();
  std::printf("(checksum %g)\n", double(acc[3][0]));
  std::free(buf);
  return 0;
}
