// The A16 block-quantized GEMM (kernels_cupy/cpu/qgemm_core.h) alone, torch-free, one thread: for SmolLM2's
// linear shapes and a range of M, the run-time path's output against the scalar reference (bit for bit: "ok"
// or "MISMATCH") and the fastest of repeated calls (activation quantization included), in GMAC/s; on the AVX2 path
// also the same call on the codes packed as a model's are (pack_lanes_q4 / _q8, QArgs16::wlanes).
// Compiling it against two trees' headers times two versions of the kernel in one sitting:
//   g++ -O3 -ffp-contract=off -std=c++17 -Ikernels_cupy/cpu bench/qgemm16_harness.cpp -o /tmp/h16_new
//   mkdir -p /tmp/old && for f in $(git ls-tree --name-only <rev> kernels_cupy/cpu/ | grep '/qgemm.*\.h$'); do
//     git show <rev>:$f > /tmp/old/$(basename $f); done
//   g++ -O3 -ffp-contract=off -std=c++17 -I/tmp/old bench/qgemm16_harness.cpp -o /tmp/h16_old
//   for i in 1 2 3; do /tmp/h16_old; /tmp/h16_new; done   # alternate, keep each line's best
// Arguments: [bits 4|8] [shapes: 4 = the model's, 12 = also odd block counts (1-12 blocks)].
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "qgemm_core.h"

using namespace qgemm;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int bits = argc > 1 ? std::atoi(argv[1]) : 4;
  const int nsh = argc > 2 ? std::atoi(argv[2]) : 4;
  const int64_t shapes[][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {37, 32}, {37, 96},
                               {37, 128},  {37, 160},  {37, 224},   {37, 256},   {37, 288}, {37, 384}};  // (N, K)
  const int64_t ms[] = {1, 2, 3, 4, 8, 16, 20, 32, 64, 128, 512};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ud(0, 255);
  for (int si = 0; si < nsh && si < 12; ++si) {
    for (const int64_t M : ms) {
      const int64_t N = shapes[si][0], K = shapes[si][1], nb = K / 32;
      std::vector<uint8_t> wq(N * (bits == 4 ? K / 2 : K));
      for (auto& v : wq) v = static_cast<uint8_t>(bits == 8 && ud(rng) == 128 ? 0 : ud(rng));
      std::vector<uint16_t> wd(N * nb), wm(N * nb);  // fp16 bits: small positive scales, negative minimums
      for (auto& v : wd) v = static_cast<uint16_t>(0x2000 + ud(rng));
      for (auto& v : wm) v = static_cast<uint16_t>(0xA000 + ud(rng));
      std::vector<float> x(M * K);
      for (auto& v : x) v = nd(rng);
      const int64_t qs = a16_code_stride(K), ss = a16_scale_stride(K);
      std::vector<int16_t> q(a16_code_rows(M) * qs), q0(M * qs);  // whole AMX tiles of rows
      std::vector<float> sa(M * ss), xs(M * ss), sa0(M * ss), xs0(M * ss), out(M * N), ref(M * N);
      const uint16_t* wmp = bits == 4 ? wm.data() : nullptr;
      scalar::quantize_rows16(x.data(), M, K, q0.data(), qs, sa0.data(), xs0.data(), ss);
      scalar::gemm16(QArgs16{M, N, K, bits, q0.data(), qs, sa0.data(), xs0.data(), ss, wq.data(), wd.data(), wmp,
                             nullptr, ref.data()}, 0, N);
      const bool packable = packed_codes_ok();
      std::vector<uint8_t> wp(wq.size());
      if (packable && bits == 4) pack_lanes_q4(wq.data(), wp.data(), N, K);
      if (packable && bits == 8)
        pack_lanes_q8(reinterpret_cast<const int8_t*>(wq.data()), reinterpret_cast<int8_t*>(wp.data()), N, K);
      auto run = [&](bool packed) {
        quantize_rows16(x.data(), M, 0, M, K, bits, q.data(), qs, sa.data(), xs.data(), ss, packed);
        QArgs16 a{M, N, K, bits, q.data(), qs, sa.data(), xs.data(), ss, packed ? wp.data() : wq.data(), wd.data(),
                  wmp, nullptr, out.data()};
        a.wlanes = packed;
        gemm16(a, 0, N);
      };
      auto time_it = [&](bool packed, int64_t& bad) {
        run(packed);
        for (int64_t i = 0; i < M * N; ++i) bad += std::memcmp(&out[i], &ref[i], 4) != 0;
        double best = 1e9;
        const double t_end = now() + 0.25;
        for (int it = 0; now() < t_end || it < 3; ++it) {
          const double t = now();
          run(packed);
          best = std::min(best, now() - t);
        }
        return best;
      };
      int64_t bad = 0;
      const double best = time_it(false, bad);
      std::printf("N=%5ld K=%5ld M=%4ld  %8.3f ms  %6.1f GMAC/s", static_cast<long>(N), static_cast<long>(K),
                  static_cast<long>(M), best * 1e3, M * N * K / best / 1e9);
      if (packable) std::printf("  packed %6.1f GMAC/s", M * N * K / time_it(true, bad) / 1e9);
      std::printf("  %s\n", bad ? "MISMATCH" : "ok");
    }
  }
  return 0;
}
