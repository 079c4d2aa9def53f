// bf16-activation matmul on AMX-BF16 tiles (the `amx` library only; AMX-BF16 + AVX512-BF16).
//
//   qmmbf16_f32(x, ldx, n, k, qw, sc, bias, off, d, bs, is_signed, y, nthreads)
//     y (n, d) f32 = bf16(x) @ W.T for the packed unsigned weights (w = s * u + c per block of bs,
//     u < 128): bs 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K) and bs 16 (Q6_K).  Returns 0, -1 (a
//     weight form this kernel does not take: signed Q8_0, k % 32), -2 (no memory).
//
// Why: the int16 tiles (qmm16_amx.h) split each activation into two byte planes, so every
// 16 x 16 x bs block costs two tile products, two tile stores and an integer merge before its
// f32 scaling; here a block is one TDPBF16PS and one store.  Each activation is rounded to bf16
// (nearest even: 8 significant bits, its own exponent, so a row's small values keep their
// relative precision beside an outlier); the weights stay exact: a packed value u < 128 is the
// bf16 number 128 + u, whose bits are 0x4300 | u (exponent 2^7, mantissa u), so a byte widens to
// bf16 with a zero-extension and an or.  Per block and row, with P = sum bf16(x) * (128 + u)
// (exact products, f32 sums in the tile) and X = sum bf16(x) (f32, fixed order):
//   sum x_bf16 * (s * u + c) = s * P + (c - 128 s) * X          (c = off * s where no bias is stored)
// so y = sum over blocks of fma(P, s, .) then fma(c - 128 s, X, .), in block order.
//
// Every row goes through the tiles (the last tile zero-padded), whatever the batch: a row's
// result is the same alone or batched, with 1 or 2 threads.  There is no vector twin of this
// kernel (the avx512 and avx2 libraries run such weights at int16: worker/runtime/kernels/linear.py
// resolves the 'bf16' precision to 'i16' off the amx path).
//
// Weights: the packed block (bs/4 lines of 64 bytes: line l = 16 output rows x k 4l..4l+3) is
// converted once per call and weight group into bf16 "B" rows (row r = the 16 outputs' pair
// k 2r, 2r+1): one byte permutation and two widenings per line.  A bs-16 block fills half a
// tile's depth (16 of 32 bf16): Q6_K's sub-blocks still get one product each.  The converted
// group is kept in a per-thread buffer while every tile of 16 activation rows passes over it.
#include "api.h"

#if defined(LP_AMX)
// Only this file needs AMX-BF16, AVX512-BF16 and AVX512-VBMI (vpermb) beyond the amx library's
// flags; linear.py calls it only on CPUs that report all three (cpu.BF16_TILE_FLAGS).
#pragma GCC target("amx-bf16,avx512bf16,avx512vbmi")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "parallel.h"
#include "qmm_common.h"
using lp::R;
#include "qmm_amx.h"

namespace {

// One 64-byte line of packed values (u < 128) -> its two bf16 B rows at dst (2 x 32 values).
inline void convert_line(const uint8_t* src, uint16_t* dst) {
  // bytes of row 2l (k 4l, 4l+1 of outputs 0..15) first, then row 2l+1 (k 4l+2, 4l+3)
  const __m512i idx =
      _mm512_set_epi8(63, 62, 59, 58, 55, 54, 51, 50, 47, 46, 43, 42, 39, 38, 35, 34, 31, 30, 27, 26, 23, 22, 19, 18,
                      15, 14, 11, 10, 7, 6, 3, 2, 61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32, 29,
                      28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(src));
  const __m512i exp128 = _mm512_set1_epi16(0x4300);
  _mm512_store_si512(dst, _mm512_or_si512(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)), exp128));
  _mm512_store_si512(dst + 32, _mm512_or_si512(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1)), exp128));
}

// A weight group's nb packed blocks of BS -> nb converted blocks (16 * BS values each) at dst.
template <int BS>
inline void convert_group(const uint8_t* W, int nb, uint16_t* dst) {
  for (int b = 0; b < nb; ++b)
    for (int l = 0; l < BS / 4; ++l) convert_line(W + (int64_t)b * BS * R + l * 64, dst + b * 16 * BS + l * 64);
}

// Rows of x (f32, stride ldx) -> the tiles' A operand: per tile of 16 rows and block b of BS,
// 16 rows x BS bf16 (zero rows past n), and X = the f32 sum of each row's BS bf16 values in a
// fixed order (BS 32: the two halves' 16 lanes added, then _mm512_reduce_add_ps; BS 16: one
// half's lanes).  xs: (ntiles, nb, 16).
template <int BS>
void stage_rows(const float* x, int64_t ldx, int n, int k, uint16_t* a, float* xs, int nthreads) {
  const int nb = k / BS;
  lp::parallel_for(n, nthreads > 1 && (int64_t)n * k >= (1 << 16) ? nthreads : 1, [&](int i) {
    const int tile = i / 16, t = i % 16;
    const float* xr = x + (int64_t)i * ldx;
    for (int j = 0; j < k; j += 32) {
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + j + 16), _mm512_loadu_ps(xr + j));
      // the bf16 values back to f32 (a bf16 is the top half of its f32)
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
      const __m512 hi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
      if (BS == 32) {
        const int b = j / 32;
        _mm512_store_si512(a + ((int64_t)(tile * nb + b) * 16 + t) * BS, h);
        xs[(int64_t)(tile * nb + b) * 16 + t] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      } else {
        const int b = j / 16;
        _mm256_store_si256((__m256i*)(a + ((int64_t)(tile * nb + b) * 16 + t) * BS), _mm512_castsi512_si256(h));
        _mm256_store_si256((__m256i*)(a + ((int64_t)(tile * nb + b + 1) * 16 + t) * BS),
                           _mm512_extracti64x4_epi64(h, 1));
        xs[(int64_t)(tile * nb + b) * 16 + t] = _mm512_reduce_add_ps(lo);
        xs[(int64_t)(tile * nb + b + 1) * 16 + t] = _mm512_reduce_add_ps(hi);
      }
    }
  });
}

// One block's stored f32 C tile (16 rows x 16 outputs) into acc: acc[t] = fma(P, s, acc[t]),
// then fma(c - 128 s, X[t], acc[t]).
template <int MODE>
inline void scale_block(const float* cb, const float* S, const float* C, float off, int b, const float* xs,
                        __m512* acc) {
  const __m512 s = _mm512_loadu_ps(S + b * R);
  const __m512 c = MODE == 0 ? _mm512_loadu_ps(C + b * R) : _mm512_mul_ps(s, _mm512_set1_ps(off));
  const __m512 c128 = _mm512_fnmadd_ps(s, _mm512_set1_ps(128.0f), c);
  const float* xb = xs + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_fmadd_ps(_mm512_load_ps(cb + 16 * t), s, acc[t]);
    acc[t] = _mm512_fmadd_ps(c128, _mm512_set1_ps(xb[t]), acc[t]);
  }
}

#define LP_BF16_BLOCK(ct, at, bt, ab, bb) \
  do {                                    \
    _tile_loadd(bt, bb, 64);              \
    _tile_loadd(at, ab, 2 * BS);          \
    _tile_zero(ct);                       \
    _tile_dpbf16ps(ct, at, bt);           \
  } while (0)

// y rows 0 .. mrows-1 of one tile of 16 activation rows (A: nb blocks of 16 x BS bf16, xs their
// sums) x one converted weight group (Wb: nb blocks), nvalid outputs.  Blocks in pairs, software
// pipelined as in qmm8_amx.h: pair p's products are issued, pair p-1 (stored an iteration
// earlier) is scaled, then pair p is stored.  Blocks are scaled in order 0, 1, 2, ...
template <int BS, int MODE>
void rows16(const uint16_t* Wb, const float* S, const float* C, float off, int nb, const uint16_t* A, const float* xs,
            int mrows, float* y, int64_t ldy, int nvalid, float* cbuf /* 2 x 512 */, const uint8_t* next,
            const float* next_s, const float* next_c) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const int npairs = nb / 2;
  for (int p = 0; p < npairs; ++p) {
    const int b = 2 * p;
    if (next) {  // the next group's blocks b, b+1 (values, scales, biases) into L2 while the tiles work
      for (int l = 0; l < 2 * BS * R; l += 64) _mm_prefetch((const char*)next + (int64_t)b * BS * R + l, _MM_HINT_T1);
      _mm_prefetch((const char*)(next_s + b * R), _MM_HINT_T1);
      _mm_prefetch((const char*)(next_s + (b + 1) * R), _MM_HINT_T1);
      if (MODE == 0) {
        _mm_prefetch((const char*)(next_c + b * R), _MM_HINT_T1);
        _mm_prefetch((const char*)(next_c + (b + 1) * R), _MM_HINT_T1);
      }
    }
    LP_BF16_BLOCK(0, 4, 6, A + (int64_t)b * 16 * BS, Wb + (int64_t)b * 16 * BS);
    LP_BF16_BLOCK(1, 5, 7, A + (int64_t)(b + 1) * 16 * BS, Wb + (int64_t)(b + 1) * 16 * BS);
    if (p > 0) {
      const float* cq = cbuf + ((p - 1) & 1) * 512;
      scale_block<MODE>(cq, S, C, off, b - 2, xs, acc);
      scale_block<MODE>(cq + 256, S, C, off, b - 1, xs, acc);
    }
    float* cp = cbuf + (p & 1) * 512;
    LP_TILE_STORED(0, cp);
    LP_TILE_STORED(1, cp + 256);
  }
  if (nb & 1) LP_BF16_BLOCK(0, 4, 6, A + (int64_t)(nb - 1) * 16 * BS, Wb + (int64_t)(nb - 1) * 16 * BS);
  if (npairs > 0) {
    const float* cq = cbuf + ((npairs - 1) & 1) * 512;
    scale_block<MODE>(cq, S, C, off, 2 * npairs - 2, xs, acc);
    scale_block<MODE>(cq + 256, S, C, off, 2 * npairs - 1, xs, acc);
  }
  if (nb & 1) {
    LP_TILE_STORED(0, cbuf);
    scale_block<MODE>(cbuf, S, C, off, nb - 1, xs, acc);
  }
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < 16; ++t)
    if (t < mrows) _mm512_mask_storeu_ps(y + t * ldy, m, acc[t]);
}
#undef LP_BF16_BLOCK

template <int BS, int MODE>
int gemm_bf16(const uint16_t* A, const float* xs, int ntiles, int n, const uint8_t* qw, const float* sc,
              const float* bias, float off, int d, int k, float* y, int nthreads) {
  const int nb = k / BS, G = (d + R - 1) / R;
  const int64_t wstride = (int64_t)nb * BS * R, sstride = (int64_t)nb * R;
  const int nt = nthreads > 1 && G > 1 ? (nthreads < G ? nthreads : G) : 1;
  std::atomic<bool> failed{false};
  lp::parallel_for(nt, nt, [&](int th) {
    uint16_t* wb = (uint16_t*)aligned_alloc(64, (size_t)nb * 16 * BS * sizeof(uint16_t));
    if (!wb) {
      failed.store(true, std::memory_order_relaxed);
      return;
    }
    alignas(64) float cbuf[1024];
    // C: tmm0, 1; A: tmm4, 5 (16 rows x BS bf16 = 2 BS bytes); B: tmm6, 7 (BS / 2 rows x 64 bytes)
    load_tile_config(0x3, 0x30, 0xC0, 2 * BS);
    const int g0 = (int)((int64_t)G * th / nt), g1 = (int)((int64_t)G * (th + 1) / nt);
    for (int g = g0; g < g1; ++g) {
      convert_group<BS>(qw + g * wstride, nb, wb);
      const float* C = bias ? bias + g * sstride : nullptr;
      const int nvalid = d - g * R < R ? d - g * R : R;
      for (int it = 0; it < ntiles; ++it) {
        const int mrows = n - it * 16 < 16 ? n - it * 16 : 16;
        // the first row tile streams this thread's next group in (none after its last)
        const uint8_t* next = it == 0 && g + 1 < g1 ? qw + (g + 1) * wstride : nullptr;
        rows16<BS, MODE>(wb, sc + g * sstride, C, off, nb, A + (int64_t)it * nb * 16 * BS, xs + (int64_t)it * nb * 16,
                         mrows, y + (int64_t)it * 16 * d + (int64_t)g * R, d, nvalid, cbuf, next,
                         sc + (g + 1) * sstride, bias ? bias + (g + 1) * sstride : nullptr);
      }
    }
    _tile_release();
    free(wb);
  });
  return failed.load(std::memory_order_relaxed) ? -2 : 0;
}

}  // namespace

LP_EXPORT int LP_FN(qmmbf16_f32)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw, const float* sc,
                                 const float* bias, float off, int d, int bs, int is_signed, float* y, int nthreads) {
  if ((bs != 32 && bs != 16) || is_signed || k % 32 || n < 0 || d < 1) return -1;
  if (n == 0) return 0;
  const int nb = k / bs, ntiles = (n + 15) / 16;
  const size_t a_bytes = (size_t)ntiles * nb * 16 * bs * sizeof(uint16_t);
  const size_t bytes = a_bytes + (size_t)ntiles * nb * 16 * sizeof(float);
  char* buf = (char*)aligned_alloc(64, bytes);
  if (!buf) return -2;
  uint16_t* a = (uint16_t*)buf;
  float* xs = (float*)(buf + a_bytes);
  if (n % 16) {  // the last tile's pad rows (and their sums) are zeros; stage_rows writes the rest
    const size_t tile_a = (size_t)nb * 16 * bs, tile_x = (size_t)nb * 16;
    memset(a + (ntiles - 1) * tile_a, 0, tile_a * sizeof(uint16_t));
    memset(xs + (ntiles - 1) * tile_x, 0, tile_x * sizeof(float));
  }
  if (bs == 32)
    stage_rows<32>(x, ldx, n, k, a, xs, nthreads);
  else
    stage_rows<16>(x, ldx, n, k, a, xs, nthreads);
  asm volatile("" ::: "memory");  // the staged rows are written before any tile load reads them
  int rc;
  if (bs == 32)
    rc = bias ? gemm_bf16<32, 0>(a, xs, ntiles, n, qw, sc, bias, off, d, k, y, nthreads)
              : gemm_bf16<32, 2>(a, xs, ntiles, n, qw, sc, nullptr, off, d, k, y, nthreads);
  else
    rc = bias ? gemm_bf16<16, 0>(a, xs, ntiles, n, qw, sc, bias, off, d, k, y, nthreads)
              : gemm_bf16<16, 2>(a, xs, ntiles, n, qw, sc, nullptr, off, d, k, y, nthreads);
  free(buf);
  return rc;
}
#endif
