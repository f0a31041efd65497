// Paged attention for the CPU, one query row at a time ("decode rows": a decode, or row j of a prefill chunk
// seeing the context up to itself), K/V read straight from the paged cache through the block table (the torch
// path gathers the blocks into a padded copy first, which triples the memory traffic).
//
// Determinism: a row's context is cut into chunks at fixed absolute positions (multiples of kChunk); each
// chunk gives a partial softmax (max, sum, weighted V sum) and a row's partials are merged in chunk order by
// one function (fold), so a row's bits depend on its query, its context and the chunk length only: not on the
// other rows of the call, how they are grouped into work items, or the threads.
//
// Work: the G = Hq / Hkv query heads that share a KV head are handled together, and up to kGroupRows
// consecutive rows of one sequence (a prefill chunk) too, so every K/V row loaded serves all of them. Items
// are (row group, KV head), or (row group, KV head, chunk) where there are too few groups to keep the threads
// busy, handed out dynamically. Two passes per chunk: scores, then softmax-weighted V sum.
#include "kernel_api.h"
#include "torch_api.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

static inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float* acc, const float* x, float p, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * x[i];
}

// A K/V row as fp32 times a row scale (*scale): fp32 rows are used in place (scale 1); bf16 and fp16 rows (a
// cache stored at half the bytes, which is what decode on a CPU is bound by) are widened into `tmp` (bf16 -> fp32
// is a 16-bit shift; fp16 -> fp32 exact); int8 rows (kernels_cupy/kv_quant.py: D codes, then the row's fp32 scale) have their
// codes widened into `tmp` and their scale returned, which the caller folds into the score or the softmax
// weight, so a row is de-quantized on the fly in L1 and no de-quantized copy of the context is ever made.
static inline const float* row_f32(const float* src, float*, int64_t, float* scale) {
  *scale = 1.f;
  return src;
}
static inline const float* row_f32(const at::BFloat16* src, float* tmp, int64_t d, float* scale) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(u[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    tmp[i] = f;
  }
  *scale = 1.f;
  return tmp;
}

static inline const float* row_f32(const at::Half* src, float* tmp, int64_t d, float* scale) {
  for (int64_t i = 0; i < d; ++i) tmp[i] = static_cast<float>(src[i]);  // exact: every fp16 is an fp32
  *scale = 1.f;
  return tmp;
}

// int8 codes -> fp32, two paths picked at run time (set_kv_isa; "auto": AVX2 where the CPU has it).
static void codes_scalar(const int8_t* c, float* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(c[i]);
}

__attribute__((target("avx2"))) static void codes_avx2(const int8_t* c, float* out, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {  // 8 codes: sign-extend to int32, convert, store
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
  for (; i < d; ++i) out[i] = static_cast<float>(c[i]);
}

using CodesFn = void (*)(const int8_t*, float*, int64_t);
static std::atomic<CodesFn> g_codes{nullptr};

// The AVX-512 attention body (paged_decode_avx512.h) instead of the AVX2 one: the same bits, fewer instructions.
// Stored before g_codes, so whoever reads a set g_codes reads the flag that goes with it.
static std::atomic<bool> g_wide{false};

static CodesFn pick_codes(const std::string& isa, bool* wide) {
  const bool avx2 = __builtin_cpu_supports("avx2");
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__)
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  const bool avx512 = false;  // not compiled in (the build is -march=native: this CPU has no AVX-512)
#endif
  *wide = false;
  if (isa == "scalar" || (isa == "auto" && !avx2)) return codes_scalar;
  if (isa == "avx512" || (isa == "auto" && avx512)) {
    TORCH_CHECK(avx512, "this CPU (or this build) has no AVX-512 attention body");
    *wide = true;
    return codes_avx2;
  }
  if (isa == "avx2" || isa == "auto") {
    TORCH_CHECK(avx2, "this CPU has no AVX2");
    return codes_avx2;
  }
  TORCH_CHECK(false, "kv isa must be auto, avx512, avx2 or scalar, got ", isa);
}

// Selects the attention body and int8 path; returns its name. KVGATE_KV_ISA (auto|avx512|avx2|scalar) sets the
// first choice.
std::string set_kv_isa(const std::string& isa) {
  bool wide = false;
  CodesFn f = pick_codes(isa, &wide);
  g_wide.store(wide);
  g_codes.store(f);
  return wide ? "avx512" : f == codes_avx2 ? "avx2" : "scalar";
}

static CodesFn codes_fn() {
  CodesFn f = g_codes.load();
  if (f == nullptr) {
    const char* env = std::getenv("KVGATE_KV_ISA");
    bool wide = false;
    f = pick_codes(env != nullptr && *env ? env : "auto", &wide);
    g_wide.store(wide);
    g_codes.store(f);
  }
  return f;
}

static inline const float* row_f32(const int8_t* src, float* tmp, int64_t d, float* scale) {
  std::memcpy(scale, src + d, sizeof(float));  // the row's scale follows its d codes (unaligned)
  codes_fn()(src, tmp, d);
  return tmp;
}

// exp(x) for x <= 0 (softmax after the max is subtracted), in plain C so `omp simd` vectorises it for the
// build's instruction set (the build is -march=native): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p
// Cephes' degree-5 polynomial (relative error ~2e-7, as std::exp's float rounding). Below -87.3 -> 0.
#pragma omp declare simd notinbranch
static inline float exp_neg(float x) {
  x = std::fmax(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: exact n * hi
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#include "paged_decode_avx2.h"
#include "paged_decode_avx512.h"

// Positions per context chunk. A row's context is cut at multiples of kChunk (absolute positions), each chunk
// gives a partial softmax, and the partials are merged in chunk order: what a row computes depends on its
// query, its context and kChunk only, never on the batch around it or the thread count. 64 by measurement
// (bench/prefill_attention.py, Zen 3, SmolLM2 shapes, thread CPU time): a 512-row prompt took 7.1-7.5 ms at 64,
// 7.8-8.7 at 128, 9.1 at 256 (a chunk's K/V, 2 x 16 KiB in fp32, and its scores stay in L1); decodes did not
// tell 64 from 128 or 256 apart; the merge costs ~1/128 of a chunk's arithmetic.
constexpr int64_t kChunk = 64;
// At most this many consecutive query rows of one sequence share each K/V row loaded (a prefill chunk's rows):
// 16 rows took 28.7-30.5 ms for a 1024-row prompt, 8 rows 32-33; 1 row (nothing shared) was ~1.5x slower.
constexpr int64_t kGroupRows = 16;

// One row's share of a softmax: the G query heads of one KV head over context rows [t0, t1). Leaves
// acc (G, D) = sum_t exp(s_t - m) v_t, and m, l (G) = the rows' max score and sum_t exp(s_t - m).
template <typename KV>
static void attend_rows(const float* qn, const KV* kp, const KV* vp, const int32_t* bt, int64_t t0, int64_t t1,
                        int64_t BS, int64_t Hkv, int64_t h, int64_t W, int64_t D, int64_t G, float sc,
                        float* scores, float* tmp, float* acc, float* m, float* l) {
  const int64_t L = t1 - t0;
  // Rows walk the block table incrementally: a division by the (run-time) block size per row cost more than
  // the row's arithmetic.
  int64_t blk = t0 / BS, off = t0 % BS;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = static_cast<int64_t>(bt[blk]) * BS + off;
    if (++off == BS) { off = 0; ++blk; }
    float rs;
    const float* kr = row_f32(kp + (row * Hkv + h) * W, tmp, D, &rs);
    const float s = rs * sc;
    for (int64_t g = 0; g < G; ++g) scores[g * L + (t - t0)] = dot(qn + g * D, kr, D) * s;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < L; ++t) mx = sg[t] > mx ? sg[t] : mx;  // not std::fmax: a libm call per element
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) { sg[t] = exp_neg(sg[t] - mx); sum += sg[t]; }
    m[g] = mx;
    l[g] = sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  blk = t0 / BS, off = t0 % BS;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = static_cast<int64_t>(bt[blk]) * BS + off;
    if (++off == BS) { off = 0; ++blk; }
    float rs;
    const float* vr = row_f32(vp + (row * Hkv + h) * W, tmp, D, &rs);
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, vr, scores[g * L + (t - t0)] * rs, D);
  }
}

// One context chunk [t0, t1) of KV head h for nr consecutive query rows of one sequence: row r (queries at
// q + r * qs, (G, D)) sees positions [t0, min(t1, lens[r])); lens nondecreasing, lens[0] > t0; bt a block table
// valid for every row. Leaves slots (nr, G * (D + 2)): per row acc (G, D), m (G), l (G) as attend_rows.
// scores: (nr, G, CH) scratch, tmp: (D) scratch.
template <typename KV>
static void attend_group(const float* q, int64_t qs, const int32_t* lens, int64_t nr, const KV* kp, const KV* vp,
                         const int32_t* bt, int64_t t0, int64_t t1, int64_t BS, int64_t Hkv, int64_t h, int64_t W,
                         int64_t D, int64_t G, float sc, float* scores, float* tmp, float* slots, int64_t pfw,
                         float* red, float* vrows) {
  const int64_t CH = kChunk;
#ifdef KVGATE_DECODE_AVX2
  if (codes_fn() == codes_avx2) {  // set_kv_isa("scalar") keeps the portable loops (tests compare the two)
#ifdef KVGATE_DECODE_AVX512
    if (g_wide.load()) {
#define KVGATE_WIDE(Z) \
  return avx512dec::attend_group<KV, Z>(q, qs, lens, nr, kp, vp, bt, t0, t1, BS, Hkv, h, W, G, CH, sc, scores, slots, \
                                        pfw, red)
      switch (D) {
        case 16: KVGATE_WIDE(1);
        case 32: KVGATE_WIDE(2);
        case 64: KVGATE_WIDE(4);
        case 128: KVGATE_WIDE(8);
        default: break;
      }
#undef KVGATE_WIDE
    }
#endif
#define KVGATE_GROUP(V) \
  return avx2dec::attend_group<KV, V>(q, qs, lens, nr, kp, vp, bt, t0, t1, BS, Hkv, h, W, G, CH, sc, scores, slots, \
                                      pfw, vrows)
    switch (D) {
      case 16: KVGATE_GROUP(2);
      case 32: KVGATE_GROUP(4);
      case 64: KVGATE_GROUP(8);
      case 128: KVGATE_GROUP(16);
      default: break;
    }
#undef KVGATE_GROUP
  }
#endif
  const int64_t S = G * (D + 2);
  for (int64_t r = 0; r < nr; ++r) {  // the portable loops share nothing between rows
    float* slot = slots + r * S;
    attend_rows<KV>(q + r * qs, kp, vp, bt, t0, std::min<int64_t>(t1, lens[r]), BS, Hkv, h, W, D, G, sc, scores,
                    tmp, slot, slot + G * D, slot + G * D + G);
  }
}

// The merge of one row's chunk partials, always folded in chunk order from chunk 0's (copied) state:
// st (G * (D + 2)) = (acc, m, l) so far; part the next chunk's. With one chunk nothing is folded and
// finish() divides acc by its own sum, bit for bit what a kernel without chunks gives.
static void fold(float* st, const float* part, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    float* m = st + G * D + g;
    float* l = st + G * D + G + g;
    const float mc = part[G * D + g], mn = *m > mc ? *m : mc;
    const float a = exp_neg(*m - mn), b = exp_neg(mc - mn);  // one of them is exp(0) = 1 exactly
    *l = *l * a + part[G * D + G + g] * b;
    *m = mn;
    float* o = st + g * D;
    const float* acc = part + g * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] = o[i] * a + acc[i] * b;
  }
}

// out (G, D) = acc / l per query head.
static void finish(const float* st, float* out, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / st[G * D + G + g];
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = st[g * D + i] * inv;
  }
}

static int64_t num_chunks(int64_t L) { return (L + kChunk - 1) / kChunk; }

// One call's tensors and shapes, shared by its work items.
template <typename KV>
struct Call {
  const float* q;  // (N, Hq, D)
  const KV* k;     // (NB, BS, Hkv, W)
  const KV* v;
  const int32_t* bt;  // (N, MAXB)
  const int32_t* sl;  // (N,)
  float* out;         // (N, Hq, D)
  int64_t N, Hq, D, BS, Hkv, W, MAXB, G;
  float sc;
  std::vector<int64_t> gstart;  // (groups + 1,) first row of each group of rows that share K/V loads
  int64_t S() const { return G * (D + 2); }  // one row's partial: acc (G, D), m (G), l (G)
};

// A thread's scratch: scores (kGroupRows, G, CH), tmp (D), slots (kGroupRows, G * (D + 2)) for one KV head's
// chunk, state (Hkv, kGroupRows, G * (D + 2)) for every head's running merge, red (kGroupRows, G, 8, 8) the
// AVX-512 body's eight positions of unreduced dot products, vrows (CH, D) + (CH) the AVX2 body's widened V rows
// and their scales.
struct Scratch {
  std::vector<float> scores, tmp, slots, state, red, vrows;
  Scratch(int64_t G, int64_t D, int64_t Hkv)
      : scores(kGroupRows * G * kChunk), tmp(D), slots(kGroupRows * G * (D + 2)), state(Hkv * slots.size()),
        red(kGroupRows * G * 64), vrows(kChunk * (D + 1)) {}
};

// Groups of up to kGroupRows consecutive rows whose lengths do not shrink and whose block tables agree over
// the later row's context (the rows of one prefill chunk): every row's blocks are then the group's last
// row's. Grouping changes which loads are shared, never a row's arithmetic.
template <typename KV>
static void row_groups(Call<KV>& c) {
  c.gstart.clear();
  for (int64_t n = 0; n < c.N; ++n) {
    const int64_t L = c.sl[n];
    TORCH_CHECK(L >= 1 && L <= c.MAXB * c.BS, "row ", n, ": context length ", L, " outside its block table");
    const bool joins = n > 0 && n - c.gstart.back() < kGroupRows && L >= c.sl[n - 1] &&
                       std::memcmp(c.bt + n * c.MAXB, c.bt + (n - 1) * c.MAXB,
                                   sizeof(int32_t) * ((L + c.BS - 1) / c.BS)) == 0;
    if (!joins) c.gstart.push_back(n);
  }
  c.gstart.push_back(c.N);
}

// Chunk ch of group gi, KV head h: the partials of the group's rows that reach it, rows [rf, nr) of the group,
// into s.slots (row r at r * S). Returns rf. A chunk's KV heads run back to back, head 0 first: a position's
// rows of every head are contiguous (Hkv * W elements), so head 0 prefetches them all and the cache lines are
// read in address order (the hardware prefetchers follow them), where one head's rows alone are W of every
// Hkv * W elements (at Hkv = 3, fp16, D = 64: 128 bytes of every 384).
template <typename KV>
static int64_t run_chunk(const Call<KV>& c, int64_t gi, int64_t h, int64_t ch, Scratch& s) {
  const int64_t r0 = c.gstart[gi], nr = c.gstart[gi + 1] - r0, t0 = ch * kChunk;
  const int32_t* lens = c.sl + r0;
  int64_t rf = 0;
  while (lens[rf] <= t0) ++rf;  // lengths do not shrink within a group: the rows that reach t0 are a suffix
  const int64_t t1 = std::min<int64_t>(t0 + kChunk, lens[nr - 1]);
  attend_group<KV>(c.q + ((r0 + rf) * c.Hq + h * c.G) * c.D, c.Hq * c.D, lens + rf, nr - rf, c.k, c.v,
                   c.bt + (r0 + nr - 1) * c.MAXB, t0, t1, c.BS, c.Hkv, h, c.W, c.D, c.G, c.sc, s.scores.data(),
                   s.tmp.data(), s.slots.data() + rf * c.S(), h == 0 ? c.Hkv * c.W : 0, s.red.data(),
                   s.vrows.data());
  return rf;
}

// Work item: group gi, every KV head, every chunk: partials folded into each (head, row)'s state in chunk order.
template <typename KV>
static void run_group(const Call<KV>& c, int64_t gi, Scratch& s) {
  const int64_t r0 = c.gstart[gi], nr = c.gstart[gi + 1] - r0, S = c.S();
  for (int64_t ch = 0; ch < num_chunks(c.sl[r0 + nr - 1]); ++ch) {
    for (int64_t h = 0; h < c.Hkv; ++h) {
      const int64_t rf = run_chunk(c, gi, h, ch, s);
      for (int64_t r = rf; r < nr; ++r) {
        float* st = s.state.data() + (h * kGroupRows + r) * S;
        const float* part = s.slots.data() + r * S;
        if (ch == 0) std::copy(part, part + S, st);
        else fold(st, part, c.G, c.D);
      }
    }
  }
  for (int64_t h = 0; h < c.Hkv; ++h)
    for (int64_t r = 0; r < nr; ++r)
      finish(s.state.data() + (h * kGroupRows + r) * S, c.out + ((r0 + r) * c.Hq + h * c.G) * c.D, c.G, c.D);
}

// Items [0, n) handed to the threads one at a time: a prefill's later rows see longer contexts, so equal
// static shares would leave a thread idle. f(item, scratch).
template <typename F>
static void for_items(int64_t n, int64_t G, int64_t D, int64_t Hkv, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch s(G, D, Hkv);
    for (int64_t w; (w = next.fetch_add(1)) < n;) f(w, s);
  });
}

// One item per group, largest first.
template <typename KV>
static void run_whole(const Call<KV>& c) {
  const int64_t ng = static_cast<int64_t>(c.gstart.size()) - 1;
  std::vector<int64_t> order(ng), work(ng, 0);  // (groups,): K/V positions read by each group's rows
  for (int64_t gi = 0; gi < ng; ++gi) {
    order[gi] = gi;
    for (int64_t n = c.gstart[gi]; n < c.gstart[gi + 1]; ++n) work[gi] += c.sl[n];
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  for_items(ng, c.G, c.D, c.Hkv, [&](int64_t w, Scratch& s) { run_group(c, order[w], s); });
}

// One item per (group, chunk) when there are too few groups to keep the threads busy (a single stream has one):
// partials into a buffer, then each row's merged in chunk order as run_group does.
template <typename KV>
static void run_split(const Call<KV>& c) {
  const int64_t S = c.S();
  std::vector<int64_t> base(c.N + 1, 0);  // (N + 1,): first partial of each row
  for (int64_t n = 0; n < c.N; ++n) base[n + 1] = base[n] + num_chunks(c.sl[n]);
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (group, chunk) pairs
  for (int64_t gi = 0; gi + 1 < static_cast<int64_t>(c.gstart.size()); ++gi)
    for (int64_t ch = 0; ch < num_chunks(c.sl[c.gstart[gi + 1] - 1]); ++ch) chunks.emplace_back(gi, ch);
  std::vector<float> part(base[c.N] * c.Hkv * S);  // (partials, Hkv, S)
  for_items(static_cast<int64_t>(chunks.size()), c.G, c.D, c.Hkv, [&](int64_t w, Scratch& s) {
    const int64_t gi = chunks[w].first, ch = chunks[w].second;
    const int64_t r0 = c.gstart[gi], nr = c.gstart[gi + 1] - r0;
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t r = run_chunk(c, gi, h, ch, s); r < nr; ++r)
        std::copy_n(s.slots.data() + r * S, S, part.data() + ((base[r0 + r] + ch) * c.Hkv + h) * S);
  });
  at::parallel_for(0, c.N * c.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> st(S);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t n = w / c.Hkv, h = w % c.Hkv;
      const float* p0 = part.data() + (base[n] * c.Hkv + h) * S;
      std::copy(p0, p0 + S, st.data());
      for (int64_t ch = 1; ch < base[n + 1] - base[n]; ++ch) fold(st.data(), p0 + ch * c.Hkv * S, c.G, c.D);
      finish(st.data(), c.out + (n * c.Hq + h * c.G) * c.D, c.G, c.D);
    }
  });
}

// q:            (N, Hq, D)        fp32, contiguous
// k_cache:      (NB, BS, Hkv, W)  fp32, bf16 or fp16 (W = D), or int8 (W = D + 4: codes, then the fp32 scale)
// v_cache:      (NB, BS, Hkv, W)  same dtype and shape as k_cache
// block_tables: (N, MAXB)         int32, physical block ids
// seq_lens:     (N,)              int32, context length of each row (1 <= L <= MAXB * BS)
// returns       (N, Hq, D)        fp32
template <typename KV>
static void paged_decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2, "q (N, Hq, D), caches 4-D, tables 2-D");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0), "one table and length a row");
  auto bt_c = block_tables.contiguous();
  auto sl_c = seq_lens.contiguous();
  Call<KV> c{q.data_ptr<float>(), k_cache.data_ptr<KV>(), v_cache.data_ptr<KV>(), bt_c.data_ptr<int32_t>(),
             sl_c.data_ptr<int32_t>(), out.data_ptr<float>(), q.size(0), q.size(1), q.size(2), k_cache.size(1),
             k_cache.size(2), k_cache.size(3), block_tables.size(1), 0, static_cast<float>(scale), {}};
  TORCH_CHECK(c.W == (std::is_same<KV, int8_t>::value ? c.D + 4 : c.D), "cache rows do not match the head size");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && c.Hq % c.Hkv == 0, "cache shapes or head counts disagree");
  c.G = c.Hq / c.Hkv;
  row_groups(c);
  // Which items run where changes no row's arithmetic: split only where whole groups would leave threads idle.
  const int64_t ng = static_cast<int64_t>(c.gstart.size()) - 1;
  int64_t total = 0, largest = 0, most_chunks = 0;
  for (int64_t gi = 0; gi < ng; ++gi) {
    int64_t w = 0;
    for (int64_t n = c.gstart[gi]; n < c.gstart[gi + 1]; ++n) w += c.sl[n];
    total += w, largest = std::max(largest, w);
    most_chunks = std::max(most_chunks, num_chunks(c.sl[c.gstart[gi + 1] - 1]));
  }
  if (most_chunks > 1 && largest * 8 * at::get_num_threads() > total) run_split(c);
  else run_whole(c);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "queries must be fp32");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V caches must share a dtype");
  auto out = torch::empty_like(q);
  if (k_cache.dtype() == torch::kFloat32) {
    paged_decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (k_cache.dtype() == torch::kBFloat16) {
    paged_decode_impl<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (k_cache.dtype() == torch::kHalf) {
    paged_decode_impl<at::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (k_cache.dtype() == torch::kInt8) {
    paged_decode_impl<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "KV cache must be fp32, bf16, fp16 or int8");
  }
  return out;
}

#include "kv_write.h"  // write_kv: the step's K/V rows into their cache slots, every cache dtype

// The decode stack's way in (write_kv and paged_decode as this module built them): kernel_api.h.
static const kernel_api::Attention kApiTable{&write_kv, &paged_decode};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("api", [] { return kernel_api::export_api(&kApiTable, kernel_api::kAttentionApi); },
        "this module's kernels for the decode stack (kernel_api.h)");
  m.def("write_kv", &write_kv, "the step's K/V rows into their cache slots: fp32, bf16 or int8 (CPU)");
  m.def("paged_decode", &paged_decode, "paged decode attention over block tables (CPU, fp32 queries)");
  m.def("set_kv_isa", &set_kv_isa, "attention body and int8 KV path: auto, avx512, avx2 or scalar; returns the one chosen");
}
