// Per-block cost of two AMX designs for one 16 x 16 x 32 block of a B=16 decode matmul (Gemma 3's
// Q5_0-like unsigned weights, stored bias), one thread, weights hot in L2:
//   i16  - the int16 tiles of worker/runtime/kernels/csrc/qmm16_amx.h (MODE 0): byte planes hi/lo,
//          two TDPB*D, two tile stores, the integer merge and the f32 scaling per block;
//   bf16 - the bf16 tiles of worker/runtime/kernels/csrc/qmmbf16.cpp: packed bytes widened to bf16
//          (128 + u) per pair of blocks, one TDPBF16PS and one tile store per block.
// The two are alternated round by round; printed: ns per block, median [min-max] of 9 rounds.
//
//   g++ -O2 -march=sapphirerapids bench/csrc/amx_bf16_block.cpp -o /tmp/amx_bf16_block
//   /tmp/amx_bf16_block [G=128 k=640 reps=200 mode=0]
//     G weight groups of 16 outputs, k inputs; mode 1: bf16 without the weight conversion (the
//     weights as if stored in bf16), mode 2: bf16 without the f32 scaling.
// Not part of the build or the tests; results and their reading: worker/runtime/kernels/README.md
// ("bf16 tiles"). AMX needs the process's permission for XTILEDATA (arch_prctl, asked in main).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
constexpr int R = 16, BS = 32;
struct alignas(64) Cfg {
  uint8_t palette, start;
  uint8_t res[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static void cfg_i16() {
  Cfg c;
  memset(&c, 0, 64);
  c.palette = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[4] = c.rows[5] = 16;
  c.colsb[4] = c.colsb[5] = BS;
  c.rows[6] = BS / 4;
  c.colsb[6] = 64;
  _tile_loadconfig(&c);
}
static void cfg_bf() {
  Cfg c;
  memset(&c, 0, 64);
  c.palette = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;  // C
  c.rows[4] = c.rows[5] = 16;
  c.colsb[4] = c.colsb[5] = 64;  // A: 16 rows x 32 bf16
  c.rows[6] = c.rows[7] = 16;
  c.colsb[6] = c.colsb[7] = 64;  // B: 16 k-pairs x 16 cols x 2
  _tile_loadconfig(&c);
}
using CT = int32_t[256];
#define ST(ct, cb) asm volatile("tilestored %%tmm" #ct ", (%1,%2,1)" : "=m"(*(CT*)(cb)) : "r"((void*)(cb)), "r"(64L))

// ---- the int16 tiles (qmm16_amx.h, MODE 0: unsigned weights, stored bias C) ----
static inline void scale16(const int32_t* cb, const float* S, const float* C, int b, const float* dT, const float* hT,
                           __m512* acc) {
  const __m512 s = _mm512_loadu_ps(S + b * R), c = _mm512_loadu_ps(C + b * R);
  const float* da = dT + b * 16;
  const float* ha = hT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i dot =
        _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb + 16 * t), 8), _mm512_load_si512(cb + 256 + 16 * t));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(da[t])), acc[t]);
    acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(ha[t]), acc[t]);
  }
}
#define BLK16(ch, cl, ab, wb)           \
  do {                                  \
    _tile_loadd(6, wb, 64);             \
    _tile_loadd(4, ab, BS);             \
    _tile_loadd(5, (ab) + 16 * BS, BS); \
    _tile_zero(ch);                     \
    _tile_zero(cl);                     \
    _tile_dpbsud(ch, 4, 6);             \
    _tile_dpbuud(cl, 5, 6);             \
  } while (0)
static void rows_i16(const uint8_t* W, const float* S, const float* C, int nb, const int8_t* planes, const float* dT,
                     const float* hT, float* y, int ldy, int32_t* cbuf) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const int np = nb / 2;
  for (int p = 0; p < np; ++p) {
    const int b = 2 * p;
    const int8_t* ab = planes + (int64_t)b * 32 * BS;
    BLK16(0, 1, ab, W + (int64_t)b * BS * R);
    BLK16(2, 3, ab + 32 * BS, W + (int64_t)(b + 1) * BS * R);
    if (p > 0) {
      const int32_t* pr = cbuf + ((p - 1) & 1) * 1024;
      scale16(pr, S, C, b - 2, dT, hT, acc);
      scale16(pr + 512, S, C, b - 1, dT, hT, acc);
    }
    int32_t* cp = cbuf + (p & 1) * 1024;
    ST(0, cp);
    ST(1, cp + 256);
    ST(2, cp + 512);
    ST(3, cp + 768);
  }
  const int32_t* l = cbuf + ((np - 1) & 1) * 1024;
  scale16(l, S, C, nb - 2, dT, hT, acc);
  scale16(l + 512, S, C, nb - 1, dT, hT, acc);
  for (int t = 0; t < 16; ++t) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

// ---- the bf16 tiles (qmmbf16.cpp) ----
// one 64-byte weight line (16 cols x 4 k, u < 128) -> two B rows (k pairs 01, 23) of bf16(128+u)
static inline void conv_line(const uint8_t* src, uint16_t* dst /* 2 rows x 32 */) {
  const __m512i idx =
      _mm512_set_epi8(63, 62, 59, 58, 55, 54, 51, 50, 47, 46, 43, 42, 39, 38, 35, 34, 31, 30, 27, 26, 23, 22, 19, 18,
                      15, 14, 11, 10, 7, 6, 3, 2, 61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32, 29,
                      28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(src));
  const __m512i mag = _mm512_set1_epi16(0x4300);
  _mm512_store_si512(dst, _mm512_or_si512(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)), mag));
  _mm512_store_si512(dst + 32, _mm512_or_si512(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1)), mag));
}
static inline void scalebf(const float* cb, const float* S, const float* C2, int b, const float* hT, __m512* acc) {
  const __m512 s = _mm512_loadu_ps(S + b * R), c = _mm512_loadu_ps(C2 + b * R);
  const float* ha = hT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_fmadd_ps(_mm512_load_ps(cb + 16 * t), s, acc[t]);
    acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(ha[t]), acc[t]);
  }
}
static int g_mode = 0;
static void rows_bf(const uint8_t* W, const float* S, const float* C2, int nb, const uint16_t* A, const float* hT,
                    float* y, int ldy, float* cbuf, uint16_t* bst) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const int np = nb / 2;
  for (int p = 0; p < np; ++p) {
    const int b = 2 * p;
    uint16_t* b0 = bst + (p & 1) * 1024;
    uint16_t* b1 = b0 + 512;
    if (g_mode != 1) {
      for (int l = 0; l < 8; ++l) conv_line(W + (int64_t)b * BS * R + l * 64, b0 + l * 64);
      for (int l = 0; l < 8; ++l) conv_line(W + (int64_t)(b + 1) * BS * R + l * 64, b1 + l * 64);
    }
    _tile_loadd(6, b0, 64);
    _tile_loadd(4, A + (int64_t)b * 16 * 32, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1, 64);
    _tile_loadd(5, A + (int64_t)(b + 1) * 16 * 32, 64);
    _tile_zero(1);
    _tile_dpbf16ps(1, 5, 7);
    if (p > 0 && g_mode != 2) {
      const float* pr = cbuf + ((p - 1) & 1) * 512;
      scalebf(pr, S, C2, b - 2, hT, acc);
      scalebf(pr + 256, S, C2, b - 1, hT, acc);
    }
    float* cp = cbuf + (p & 1) * 512;
    ST(0, cp);
    ST(1, cp + 256);
  }
  const float* l = cbuf + ((np - 1) & 1) * 512;
  scalebf(l, S, C2, nb - 2, hT, acc);
  scalebf(l + 256, S, C2, nb - 1, hT, acc);
  for (int t = 0; t < 16; ++t) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  g_mode = argc > 4 ? atoi(argv[4]) : 0;
  const int G = argc > 1 ? atoi(argv[1]) : 128, k = argc > 2 ? atoi(argv[2]) : 640,
            reps = argc > 3 ? atoi(argv[3]) : 400;
  const int nb = k / BS, d = G * R;
  uint8_t* W = (uint8_t*)aligned_alloc(64, (size_t)G * nb * BS * R);
  for (size_t i = 0; i < (size_t)G * nb * BS * R; ++i) W[i] = rand() & 31;
  float* S = (float*)aligned_alloc(64, (size_t)G * nb * R * 4);
  float* C = (float*)aligned_alloc(64, (size_t)G * nb * R * 4);
  for (int i = 0; i < G * nb * R; ++i) S[i] = 0.01f * (1 + rand() % 7), C[i] = -0.1f * (rand() % 5);
  int8_t* planes = (int8_t*)aligned_alloc(64, nb * 32 * BS);
  for (int i = 0; i < nb * 32 * BS; ++i) planes[i] = rand();
  uint16_t* A = (uint16_t*)aligned_alloc(64, nb * 16 * 32 * 2);
  for (int i = 0; i < nb * 16 * 32; ++i) A[i] = 0x3f80 + (rand() & 127);
  float *dT = (float*)aligned_alloc(64, nb * 16 * 4), *hT = (float*)aligned_alloc(64, nb * 16 * 4);
  for (int i = 0; i < nb * 16; ++i) dT[i] = 1e-3f, hT[i] = 0.5f;
  float* y = (float*)aligned_alloc(64, (size_t)16 * d * 4);
  alignas(64) int32_t cb16[2048];
  alignas(64) float cbf[1024];
  alignas(64) uint16_t bst[2048];
  const int rounds = 9;
  double ns[2][rounds];
  for (int round = 0; round < rounds; ++round)
    for (int w = 0; w < 2; ++w) {
      const int which = round % 2 ? 1 - w : w;  // alternate which design runs first
      if (which == 0)
        cfg_i16();
      else
        cfg_bf();
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        for (int g = 0; g < G; ++g) {
          const uint8_t* Wg = W + (int64_t)g * nb * BS * R;
          if (which == 0)
            rows_i16(Wg, S + g * nb * R, C + g * nb * R, nb, planes, dT, hT, y + g * R, d, cb16);
          else
            rows_bf(Wg, S + g * nb * R, C + g * nb * R, nb, A, hT, y + g * R, d, cbf, bst);
        }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      _tile_release();
      ns[which][round] = s / ((double)reps * G * nb) * 1e9;
    }
  for (int w = 0; w < 2; ++w) {
    std::sort(ns[w], ns[w] + rounds);
    printf("%s G=%d k=%d mode=%d: %.1f [%.1f-%.1f] ns per 16x16x32 block (median [min-max] of %d)\n",
           w ? "bf16" : "i16 ", G, k, g_mode, ns[w][rounds / 2], ns[w][0], ns[w][rounds - 1], rounds);
  }
  printf("checksum %g\n", y[5]);
}
