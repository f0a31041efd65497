// Does the AMX tile unit run beside 512-bit vector FP work on this CPU? The A16 AMX kernel (kernels_cupy/cpu/
// qgemm_a16_amx.h) issues a block's tile products between slices of an fp32 epilogue, on the assumption that the two
// overlap. This times, in TSC ticks per block of 16 rows x 32 columns, one thread:
//   tiles          B and A tile loads, 2 tilezero, 2 TDPBSUD (the kernel's Q4 block), no store
//   tiles+store    the same and the 2 C tiles stored to a ring of three L1 slots (the kernel's block_tiles)
//   epilogue       the kernel's per-block epilogue for 32 (row, half) units: load the int32 sums, convert, scale
//                  (d x sa), two FMAs into the lane accumulator (L1)
//   both           tiles+store then epilogue, per block, as the kernel interleaves them
//   tiles+epilogue tiles (no store) then epilogue
// With full overlap "both" would be max(tiles+store, epilogue); with none, their sum.
//   gcc -O2 -march=native -mamx-tile -mamx-int8 bench/amx_overlap.c -o /tmp/amx_overlap && taskset -c 1 /tmp/amx_overlap
// Linux only (arch_prctl grants the tile state); exits 1 without AMX.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((aligned(64))) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static uint8_t A[4][1024] __attribute__((aligned(64))), B[2][1024] __attribute__((aligned(64)));
static int32_t ring[3][1024] __attribute__((aligned(64)));  // C slots: 2 halves x 16 x 16 int32 (+ room)
static __m512 acc[256] __attribute__((aligned(64)));        // (row, half, lane) x 16 fp32
static float dv[64] __attribute__((aligned(64))), sa[64];

static inline void tiles(int b, int store) {
  _tile_loadd(6, B[0], 64);
  _tile_loadd(7, B[1], 64);
  _tile_zero(0);
  _tile_zero(2);
  _tile_loadd(4, A[b & 3], 64);
  _tile_dpbsud(0, 4, 6);
  _tile_dpbsud(2, 4, 7);
  if (store) {
    _tile_stored(0, ring[b % 3], 64);
    _tile_stored(2, ring[b % 3] + 256, 64);
  }
}

static inline void epilogue(int b) {
  const int32_t* c = ring[(b + 1) % 3];  // the slot stored two blocks before
  const __m512 d = _mm512_load_ps(dv), mn = _mm512_load_ps(dv + 16);
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 16; ++r) {
      __m512* p = acc + (r * 2 + h) * 8 + (b & 7);
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(sa[r]));
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + h * 256 + r * 16)), ds, *p);
      *p = _mm512_fmadd_ps(mn, _mm512_set1_ps(sa[r + 16]), v);
    }
}

int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
    printf("no AMX tile state granted\n");
    return 1;
  }
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  for (int i = 0; i < 64; ++i) dv[i] = 1e-3f * (float)i, sa[i] = 1e-2f * (float)i;
  const int n = 200000;
  for (int rep = 0; rep < 3; ++rep) {
    uint64_t t[6];
    t[0] = __rdtsc();
    for (int b = 0; b < n; ++b) tiles(b, 0);
    t[1] = __rdtsc();
    for (int b = 0; b < n; ++b) tiles(b, 1);
    t[2] = __rdtsc();
    for (int b = 0; b < n; ++b) epilogue(b);
    t[3] = __rdtsc();
    for (int b = 0; b < n; ++b) tiles(b, 1), epilogue(b);
    t[4] = __rdtsc();
    for (int b = 0; b < n; ++b) tiles(b, 0), epilogue(b);
    t[5] = __rdtsc();
    printf("TSC ticks a block: tiles %.1f, tiles+store %.1f, epilogue %.1f, both %.1f, tiles+epilogue %.1f\n",
           (double)(t[1] - t[0]) / n, (double)(t[2] - t[1]) / n, (double)(t[3] - t[2]) / n,
           (double)(t[4] - t[3]) / n, (double)(t[5] - t[4]) / n);
  }
  float s = 0;  // keep the accumulators alive
  for (int i = 0; i < 256; ++i) s += acc[i][0];
  printf("(checksum %g)\n", s);
  _tile_release();
  return 0;
}
