// int8-activation matmul on AMX tiles (Intel AMX-TILE + AMX-INT8: Sapphire Rapids and later),
// built only into the `amx` library (-DLP_AMX -DLP_AVX512 + the avx512 flags + -mamx-tile
// -mamx-int8).  Same inputs, outputs and activation quantization as the int8 kernel of
// qmm.cpp (qmm8.h, llama.cpp's quantize_row_q8_0 per row and per 32), and the same float
// results bit for bit: every block's integer dot product is exact in both kernels, and the
// f32 accumulation below repeats the vpdpbusd tile's operations in the same order
//   acc = fma(float(isum), s * d_a, acc);  acc = fma(c, d_a * sum(a_q), acc)      per block.
// Hence rows below amx_min_rows(BS) can run the vpdpbusd kernel (qmm8.h gemm_vnni) and the rest
// AMX without a row's result depending on the batch.
//
// Why the packed weights need no repacking: a block of the interleaved form is BS/4 lines of
// 64 bytes, line c = 16 output rows x 4 consecutive k — exactly the "B" operand layout of
// TDPB*D (K/4 rows of N=16 dwords, each dword 4 k values).  So per 16-row weight group g,
// 16 activation rows i0.. and block b:
//   A tile (tmm4/5): 16 rows x BS bytes of int8 activations, stride k      (row-major x_q)
//   B tile (tmm6/7): BS/4 rows x 64 bytes of weights, stride 64            (qw[g, b])
//   C tile (tmm0/1): 16 x 16 int32 = sum_j a_q[i, j] * w[r, j] over the block
// TDPBSUD (signed A x unsigned B) for the unsigned types.  Q8_0's signed weights: TDPBSSD,
// plus TDPBSUD against a constant tile of 0x80 (= 128 unsigned), so C = sum (v + 128) a_q —
// the very integer the vpdpbusd kernel forms from v ^ 0x80, with c = -128 s as its bias.
// Each block needs its own C tile (the scales change per block): the tile is stored to a
// 1 KiB buffer and its 16 rows scaled into 16 zmm accumulators, which is where most of the
// time goes (see the README's measurements).  Blocks go in pairs (tmm0/tmm1), software
// pipelined: the tile unit works on pair p while pair p-1 is scaled.
//
// Tile state is per thread: each worker of lp::parallel_for loads the configuration at the
// start of its share of the groups and releases the tiles at its end (ldtilecfg/tilerelease
// once per thread per call), so nothing is assumed about a pool thread's tile state between
// calls (torch's oneDNN may configure its own tiles on the same threads).  The process must
// have asked the kernel for the AMX state first: lp_amx_request_tile_perm (below) —
// worker/runtime/kernels/cpu.py calls it before the `amx` path is used; without it the first
// ldtilecfg raises SIGILL.
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#define LP_QMM_CHUNK 256  // rows per call of gemm below: each weight group is read once per 256 rows
#include "qmm8.h"

namespace {

// A tile always does the work of 16 rows, and costs about what 11 (bs 32) to 14 (bs 16) rows
// cost in the vpdpbusd kernel (measured, see the README): fewer rows than this (a small call,
// or the n % 16 rows after the whole tiles) go to the vpdpbusd kernel, more to a tile (the
// last one zero-padded).  Both give the same bits, so this is a speed choice only.
constexpr int amx_min_rows(int bs) { return bs == 32 ? 12 : 14; }

struct alignas(64) TileConfig {  // the 64-byte ldtilecfg operand, palette 1
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of tmm0..15 (only 0..7 exist)
  uint8_t rows[16];
};

alignas(64) const uint8_t kU128[8 * 64] = {
#define LP_X8 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80
#define LP_X64 LP_X8, LP_X8, LP_X8, LP_X8, LP_X8, LP_X8, LP_X8, LP_X8
    LP_X64, LP_X64, LP_X64, LP_X64, LP_X64, LP_X64, LP_X64, LP_X64,
#undef LP_X64
#undef LP_X8
};

// tmm0, tmm1: C (16 x 16 int32); tmm3: the constant 0x80 B tile (Q8_0 only);
// tmm4, tmm5: A (16 x BS int8); tmm6, tmm7: B (BS/4 x 64 bytes).
template <int BS>
inline void load_tile_config() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  const int c_tiles[] = {0, 1}, b_tiles[] = {3, 6, 7}, a_tiles[] = {4, 5};
  for (int t : c_tiles) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : b_tiles) cfg.rows[t] = BS / 4, cfg.colsb[t] = 64;
  for (int t : a_tiles) cfg.rows[t] = 16, cfg.colsb[t] = BS;
  asm volatile("" ::: "memory");  // _tile_loadconfig's asm names only 8 bytes of cfg as input
  _tile_loadconfig(&cfg);
}

// Store C tile `ct` (16 rows x 64 bytes) to cb.  GCC's _tile_stored clobbers all memory,
// which forces the 16 accumulators below out to the stack around every store; this one names
// only the 1 KiB it writes.
using CTile = int32_t[256];
#define LP_TILE_STORED(ct, cb)                                  \
  asm volatile("tilestored %%tmm" #ct ", (%1,%2,1)"             \
               : "=m"(*(CTile*)(cb))                            \
               : "r"((void*)(cb)), "r"(64L))

// Per tile of 16 activation rows, the rows' scales transposed so that block b's 16 values are
// contiguous: dT (nb32, 16) = d_a, sT (nb, 16) = d_a * sum(a_q) per BS (zero for pad rows).
// Scale one stored C tile (16 rows x 16 int32, row t at cb + 16 t) of block b into acc[16]:
// the vpdpbusd tile's per-block float operations, in its order (qmm8.h tile).
template <int BS, int MODE>
inline void scale_block(const int32_t* cb, const float* S, const float* C, float off, int b, const float* dT,
                        const float* sT, __m512* acc) {
  const __m512 s = _mm512_loadu_ps(S + b * R);
  const __m512 c = MODE == 0 ? _mm512_loadu_ps(C + b * R)
                             : _mm512_mul_ps(s, _mm512_set1_ps(MODE == 1 ? -128.f : off));
  const float* da = dT + ((b * BS) / 32) * 16;
  const float* sa = sT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i isum = _mm512_load_si512((const void*)(cb + 16 * t));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(da[t])), acc[t]);
    acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(sa[t]), acc[t]);
  }
}

// C tile `ct` = the block product of A (16 activation rows at q, stride k) and B (weights wb).
#define LP_AMX_BLOCK(ct, at, bt, q, k, wb)                  \
  do {                                                      \
    _tile_loadd(at, q, k);                                  \
    _tile_loadd(bt, wb, 64);                                \
    _tile_zero(ct);                                         \
    if (MODE == 1) {                                        \
      _tile_dpbssd(ct, at, bt);                             \
      _tile_dpbsud(ct, at, 3);                              \
    } else {                                                \
      _tile_dpbsud(ct, at, bt);                             \
    }                                                       \
  } while (0)

// y rows 0 .. mrows-1 (mrows <= 16) of one tile of 16 activation rows (q: 16 rows of k bytes,
// all readable; dT/sT its transposed scales) x the nvalid rows of one weight group.
template <int BS, int MODE>
void rows16(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* q, long k,
            const float* dT, const float* sT, int mrows, float* y, int64_t ldy, int nvalid,
            int32_t* cbuf /* 4 x 256 */) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  // Software pipeline over pairs of blocks: pair p's tile products are issued, then pair
  // p-1 (stored to the other half of cbuf an iteration earlier) is scaled while the tile unit
  // works, and only then pair p is stored (its tilestored waits for the products; vector
  // loads issued after a pending tile store wait for it too, so the scaling must come first).
  // Blocks are still scaled in order 0, 1, 2, ... (the f32 sum's order).
  const int npairs = nb / 2;
  for (int p = 0; p < npairs; ++p) {
    const int b = 2 * p;
    LP_AMX_BLOCK(0, 4, 6, q + b * BS, k, W + (int64_t)b * BS * R);
    LP_AMX_BLOCK(1, 5, 7, q + (b + 1) * BS, k, W + (int64_t)(b + 1) * BS * R);
    if (p > 0) {
      const int32_t* cq = cbuf + ((p - 1) & 1) * 512;
      scale_block<BS, MODE>(cq, S, C, off, b - 2, dT, sT, acc);
      scale_block<BS, MODE>(cq + 256, S, C, off, b - 1, dT, sT, acc);
    }
    int32_t* cp = cbuf + (p & 1) * 512;
    LP_TILE_STORED(0, cp);
    LP_TILE_STORED(1, cp + 256);
  }
  if (nb & 1) {
    const int b = nb - 1;
    LP_AMX_BLOCK(0, 4, 6, q + b * BS, k, W + (int64_t)b * BS * R);
  }
  if (npairs > 0) {
    const int32_t* cq = cbuf + ((npairs - 1) & 1) * 512;
    scale_block<BS, MODE>(cq, S, C, off, 2 * npairs - 2, dT, sT, acc);
    scale_block<BS, MODE>(cq + 256, S, C, off, 2 * npairs - 1, dT, sT, acc);
  }
  if (nb & 1) {
    LP_TILE_STORED(0, cbuf);
    scale_block<BS, MODE>(cbuf, S, C, off, nb - 1, dT, sT, acc);
  }
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < 16; ++t)
    if (t < mrows) _mm512_mask_storeu_ps(y + t * ldy, m, acc[t]);
}
#undef LP_AMX_BLOCK
#undef LP_TILE_STORED

template <int BS, int MODE>
void gemm(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, const Act& a, int n,
          float* y, int nthreads) {
  const int nb = k / BS, nb32 = k / 32, nb16 = k / 16;
  const int G = (d + R - 1) / R;
  const int64_t wstride = (int64_t)nb * BS * R;  // bytes per group
  const int64_t sstride = (int64_t)nb * R;       // scales per group
  const int nfull = n / 16, rest = n - nfull * 16;
  const int mtail = rest >= amx_min_rows(BS) ? rest : 0;  // rows of the padded tail tile
  const int ntiles = nfull + (mtail ? 1 : 0), mtiles = nfull * 16 + mtail;
  if (mtiles < n) {  // the rows after the tiles: vpdpbusd
    const int64_t r0 = (int64_t)nfull * 16;
    const Act at{a.q + r0 * k, a.d + r0 * nb32, a.s16 + r0 * nb16, a.s32 + r0 * nb32, k};
    gemm_vnni<BS, MODE>(qw, sc, bias, off, d, k, at, n - mtiles, y + r0 * d, nthreads);
  }
  if (ntiles == 0) return;
  const size_t tq_bytes = mtail ? (size_t)16 * k : 0;
  const size_t nfl = (size_t)ntiles * 16 * (nb32 + nb);
  char* buf = (char*)calloc(1, nfl * sizeof(float) + tq_bytes + 64);
  if (!buf) {  // out of memory for the scratch: the vpdpbusd kernel gives the same result
    gemm_vnni<BS, MODE>(qw, sc, bias, off, d, k, a, mtiles, y, nthreads);
    return;
  }
  float* dT = (float*)buf;
  float* sT = dT + (size_t)ntiles * 16 * nb32;
  int8_t* tq = (int8_t*)(sT + (size_t)ntiles * 16 * nb);
  const float* sa = BS == 32 ? a.s32 : a.s16;
  for (int i = 0; i < mtiles; ++i) {
    const int tile = i / 16, t = i % 16;
    for (int j = 0; j < nb32; ++j) dT[((size_t)tile * nb32 + j) * 16 + t] = a.d[(int64_t)i * nb32 + j];
    for (int j = 0; j < nb; ++j) sT[((size_t)tile * nb + j) * 16 + t] = sa[(int64_t)i * (BS == 32 ? nb32 : nb16) + j];
  }
  if (mtail) memcpy(tq, a.q + (int64_t)nfull * 16 * k, (size_t)mtail * k);
  asm volatile("" ::: "memory");  // the scratch is written before any tile load reads it
  const int nt = nthreads > 1 && G > 1 ? (nthreads < G ? nthreads : G) : 1;
  // One index per thread (parallel_for's static split over G, by hand), so that each thread
  // configures its tiles once per call.
  lp::parallel_for(nt, nt, [&](int t) {
    alignas(64) int32_t cbuf[4 * 256];  // two pairs of stored C tiles
    load_tile_config<BS>();
    if (MODE == 1) _tile_loadd(3, kU128, 64);
    const int g0 = (int)((int64_t)G * t / nt), g1 = (int)((int64_t)G * (t + 1) / nt);
    // Groups in spans of about 512 KiB of weights (kept in L2 while every row tile passes
    // over them), so each output row is written in runs of gspan * 64 bytes: one group at a
    // time, a 512-row prefill against a 262144-row LM head wrote 64 bytes per 1 MiB row
    // stride (a TLB and cache miss per store) and took seconds.
    const int gspan = wstride >= (512 << 10) ? 1 : (int)((512 << 10) / wstride);
    for (int gs = g0; gs < g1; gs += gspan) {
      const int ge = gs + gspan < g1 ? gs + gspan : g1;
      for (int it = 0; it < ntiles; ++it) {
        const bool full = it < nfull;
        const int8_t* q = full ? a.q + (int64_t)it * 16 * k : tq;
        for (int g = gs; g < ge; ++g) {
          const float* C = bias ? bias + g * sstride : nullptr;
          const int nvalid = d - g * R < R ? d - g * R : R;
          rows16<BS, MODE>(qw + g * wstride, sc + g * sstride, C, off, nb, q, k, dT + (size_t)it * 16 * nb32,
                           sT + (size_t)it * 16 * nb, full ? 16 : mtail, y + (int64_t)it * 16 * d + (int64_t)g * R,
                           d, nvalid, cbuf);
        }
      }
    }
    _tile_release();
  });
  free(buf);
}

}  // namespace

// Ask Linux for the AMX tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
// Linux >= 5.16; the state is then enabled for every thread of the process).  Returns 0 when
// granted, else the errno (EINVAL: kernel too old or no AMX; EPERM/ENOSPC: refused).
LP_EXPORT int LP_FN(request_tile_perm)(void) {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}

// Quantize x (n, k) f32 (row stride ldx) into the caller's buffers: the int8 quantizer of qmm8.h.
LP_EXPORT void LP_FN(quantize_act)(const float* x, int64_t ldx, int n, int k, int8_t* aq, float* ad, float* as16,
                                   float* as32, int nthreads) {
  quantize_rows(x, ldx, n, k, aq, ad, as16, as32, nthreads);
}

LP_DEFINE_QMM(qmm, Act, int8_t, quantize_rows)
