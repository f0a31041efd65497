// Multiply-add throughput of one core, per instruction the CPU kernels could build on: independent chains of one
// instruction in a tight loop (12 accumulators: more than latency x issue width on every CPU we meet), so the loop
// runs at the instruction's issue rate. Built and run by bench/isa_peak.py, which prints the rates beside the
// A16 GEMM's (bench/qgemm16_harness.cpp): how far the kernel is from the instruction it is made of, and what the
// 8-bit instructions (int8 activations) would allow.
//
// Output: one line per instruction (or AVX2 sequence) the CPU has, "name macs_per_step G_steps_per_s"; a step is
// one instruction, or for the AVX2 sequences the instructions that give one accumulator its 32-bit sums.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// 12 independent accumulators x0..x11 (op src1, src2, acc in AT&T order: acc is the last operand).
#define TWELVE(op, r)                                                                                        \
  op " %%" r "14, %%" r "15, %%" r "0\n\t" op " %%" r "14, %%" r "15, %%" r "1\n\t" op " %%" r "14, %%" r  \
     "15, %%" r "2\n\t" op " %%" r "14, %%" r "15, %%" r "3\n\t" op " %%" r "14, %%" r "15, %%" r "4\n\t" op  \
     " %%" r "14, %%" r "15, %%" r "5\n\t" op " %%" r "14, %%" r "15, %%" r "6\n\t" op " %%" r "14, %%" r    \
     "15, %%" r "7\n\t" op " %%" r "14, %%" r "15, %%" r "8\n\t" op " %%" r "14, %%" r "15, %%" r "9\n\t" op  \
     " %%" r "14, %%" r "15, %%" r "10\n\t" op " %%" r "14, %%" r "15, %%" r "11\n\t"
// The AVX2 integer paths need more than one instruction a step: 16-bit pairs are vpmaddwd then vpaddd into the
// 32-bit sums (the AVX2 A16 kernel's step); 8-bit quads are vpmaddubsw (16-bit pair sums), vpmaddwd by ones to
// widen them, then vpaddd (llama.cpp's and OpenVINO's AVX2 int8 step). ymm12/13 are scratch (renamed per step).
#define SEQ16(i) "vpmaddwd %%ymm14, %%ymm15, %%ymm12\n\tvpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"
#define SEQ8(i)                                                                                     \
  "vpmaddubsw %%ymm14, %%ymm15, %%ymm13\n\tvpmaddwd %%ymm15, %%ymm13, %%ymm13\n\tvpaddd %%ymm13, %%ymm" #i \
  ", %%ymm" #i "\n\t"
#define TWELVE_SEQ(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7) S(8) S(9) S(10) S(11)
#define CLOBBER \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"

#define BENCH(fn, isa, body)                                                          \
  __attribute__((target(isa))) static double fn(long n) {                            \
    double t = now();                                                                 \
    for (long k = 0; k < n; ++k) __asm__ volatile(body ::: CLOBBER);                  \
    return n * 12.0 / (now() - t) / 1e9;                                              \
  }

// AVX2 (every path's floor): the two integer sequences above, and fp32 FMA.
BENCH(seq16_ymm, "avx2", TWELVE_SEQ(SEQ16))
BENCH(seq8_ymm, "avx2", TWELVE_SEQ(SEQ8))
BENCH(fma_ymm, "avx2,fma", TWELVE("vfmadd231ps", "ymm"))
// AVX-512 VNNI: 16-bit pairs into 32-bit (vpdpwssd: the VNNI A16 kernel's instruction) and 8-bit quads
// (vpdpbusd: int8 activations).
BENCH(dpwssd_ymm, "avx512vnni,avx512vl", TWELVE("vpdpwssd", "ymm"))
BENCH(dpbusd_ymm, "avx512vnni,avx512vl", TWELVE("vpdpbusd", "ymm"))
BENCH(dpwssd_zmm, "avx512vnni,avx512f", TWELVE("vpdpwssd", "zmm"))
BENCH(dpbusd_zmm, "avx512vnni,avx512f", TWELVE("vpdpbusd", "zmm"))

// AMX: one tile product multiplies a 16 x 64-byte A tile by a 64-byte x 16 B tile into 16 x 16 int32 (or fp32)
// sums: 16 * 16 * 64 = 16,384 byte multiply-adds for tdpbusd (8-bit quads), 16 * 16 * 32 = 8,192 for tdpbf16ps.
// Six accumulator tiles (tmm0-5) and two source tiles (tmm6, tmm7); a 12-bit code of the A16 AMX kernel takes two
// bytes of a product's depth (hi and lo: qgemm_a16_amx.h), so that kernel's own peak is half of tdpbusd's. The
// tile state must be granted to the process first (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18), as the
// kernel does.
struct tilecfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
#define SIX(op) op " %%tmm7, %%tmm6, %%tmm0\n\t" op " %%tmm7, %%tmm6, %%tmm1\n\t" op " %%tmm7, %%tmm6, %%tmm2\n\t" \
  op " %%tmm7, %%tmm6, %%tmm3\n\t" op " %%tmm7, %%tmm6, %%tmm4\n\t" op " %%tmm7, %%tmm6, %%tmm5\n\t"
#define AMX_BENCH(fn, body)                                                                   \
  __attribute__((target("amx-tile,amx-int8,amx-bf16"))) static double fn(long n) {          \
    static const uint8_t zeros[1024] __attribute__((aligned(64)));  /* 16 rows x 64 bytes */ \
    struct tilecfg c;                                                                         \
    memset(&c, 0, sizeof c);                                                                  \
    c.palette = 1;                                                                            \
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;                              \
    _tile_loadconfig(&c);                                                                     \
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\t"            \
                     "tilezero %%tmm3\n\ttilezero %%tmm4\n\ttilezero %%tmm5\n\t"             \
                     "tileloadd (%0,%1,1), %%tmm6\n\ttileloadd (%0,%1,1), %%tmm7" ::"r"(zeros), \
                     "r"((long)64));                                                          \
    double t = now();                                                                         \
    for (long k = 0; k < n; ++k) __asm__ volatile(body ::: "memory");                        \
    t = now() - t;                                                                            \
    _tile_release();                                                                         \
    return n * 6.0 / t / 1e9;                                                                 \
  }
AMX_BENCH(amx_dpbusd, SIX("tdpbusd"))
AMX_BENCH(amx_dpbf16, SIX("tdpbf16ps"))

static int amx_granted(void) {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
         __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

int main(void) {
  const long n = 50000000;  // 600 M instructions a line: 0.1-0.5 s
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;  // no path to compare
  printf("vpmaddwd+vpaddd-ymm 16 %.3f\n", seq16_ymm(n));
  printf("vpmaddubsw+vpmaddwd+vpaddd-ymm 32 %.3f\n", seq8_ymm(n));
  printf("vfmadd231ps-ymm 8 %.3f\n", fma_ymm(n));
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) {
    printf("vpdpwssd-ymm 16 %.3f\n", dpwssd_ymm(n));
    printf("vpdpbusd-ymm 32 %.3f\n", dpbusd_ymm(n));
    printf("vpdpwssd-zmm 32 %.3f\n", dpwssd_zmm(n));
    printf("vpdpbusd-zmm 64 %.3f\n", dpbusd_zmm(n));
  }
  if (amx_granted()) {  // ~16 cycles a tile product: n / 32 keeps the line near the others' time
    printf("tdpbusd-amx 16384 %.4f\n", amx_dpbusd(n / 32));
    printf("tdpbf16ps-amx 8192 %.4f\n", amx_dpbf16(n / 32));
  }
  return 0;
}
