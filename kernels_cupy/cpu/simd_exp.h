// exp on 8 fp32 lanes (AVX2 + FMA), one copy for the decode attention's softmax (paged_decode_avx2.h) and the
// fused SiLU (fused_ops.cpp). libm's expf is a call per element that gcc cannot vectorise without -ffast-math.
#pragma once

#include <immintrin.h>

namespace kvgate_simd {

// x clamped to [-87.3, 88.3], where 2^n stays a normal float (exp(-87.3) ~ 1e-38 stands for 0 after a
// softmax's max is subtracted): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p Cephes' degree-5 polynomial
// (relative error ~2e-7, as std::exp's float rounding). The scalar twin is paged_decode.cpp's exp_neg.
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * hi
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace kvgate_simd
