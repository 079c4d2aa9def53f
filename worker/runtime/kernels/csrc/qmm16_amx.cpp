// int16-activation matmul on AMX tiles (AMX-TILE + AMX-INT8), built only into the `amx`
// library.  Same inputs and outputs as qmm16.cpp's avx512 kernel (quantize_rows16: int16 per
// row and per 32) and the same f32 results bit for bit.
//
// AMX has no int16 product, so each activation q (|q| <= 32767) is split into bytes:
//   q = 256 * hi + lo,   hi = q >> 8 (arithmetic: signed int8),   lo = q & 0xFF (unsigned)
// and sum q*w = 256 * sum hi*w + sum lo*w exactly.  AMX-INT8 has every sign pair: unsigned
// weights u: TDPBSUD (hi signed x u) + TDPBUUD (lo x u); Q8_0's signed v: TDPBSSD + TDPBUSD.
//
// What the avx512 kernel accumulates (qmm16.h tile): per block and output row two int32
// half-sums, lane 2r over the inputs j with j % 4 in {0, 1} (even pair of each 4) and lane
// 2r+1 over j % 4 in {2, 3}, each scaled into its own f32 accumulator
//   acc_h = fma(float(isum_h), s * d_a, acc_h);  acc_h = fma(c, 0.5 * d_a * sum(q), acc_h)
// (no second term for Q8_0), the two added once at the end: y = acc_0 + acc_1.  A tile product
// sums all 4 bytes of a dword, so the halves come from activation copies with the other pair
// zeroed: four A planes per block, hiE / hiO / loE / loO (E: bytes 2, 3 of every 4 zeroed,
// O: bytes 0, 1), four C tiles, and per half isum = (C_hi << 8) + C_lo in int32 (|isum| <
// 16 * 32768 * 255 < 2^27: exact) — the very integers of the vpdpwssd lanes.  The f32 operations
// then repeat the avx512 kernel's element by element (its pair layout only permutes lanes), so
// the rows below amx16_min_rows run that kernel (gemm_vnni16) without a row's result depending
// on the batch.
//
// Weights: the packed block is already the VNNI "B" layout (see qmm_amx.cpp).  Tiles:
//   tmm0..3 C (16 x 16 int32: hiE, hiO, loE, loO), tmm4/5/7 A (16 rows x BS bytes), tmm6 B
//   (BS/4 x 64 bytes).  One block in flight: the tile unit works on block b while block b-1's
//   four stored C tiles are scaled.  Tile state per thread and call, as qmm_amx.cpp.
#define LP_QMM_CHUNK 256  // rows per call of gemm below (each weight group reused by 16 tiles)
#include "qmm16.h"

namespace {

// Where tiles pay (measured, README "AMX"): the split costs 4 tile products and 4 tile stores
// per block where the int8 kernel needs 1, so a tile of 16 rows costs about what 14 vpdpwssd
// rows cost for bs 32 and more than 16 for bs 16 (Q6_K: 0.8x).  bs 16 therefore runs
// gemm_vnni16 throughout, and for bs 32 fewer rows than amx16_min_rows (a small call, or the
// n % 16 rows after the whole tiles) do; more take a tile (the last one zero-padded).  Same
// bits either way: a speed choice only.  (Tested bit-identical on tiles for bs 16 as well.)
constexpr bool amx16_pays(int bs) { return bs == 32; }
constexpr int amx16_min_rows(int bs) { return bs == 32 ? 15 : 16; }

struct alignas(64) TileConfig {  // the 64-byte ldtilecfg operand, palette 1
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int BS>
inline void load_tile_config16() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  const int a_tiles[] = {4, 5, 7};
  for (int t : a_tiles) cfg.rows[t] = 16, cfg.colsb[t] = BS;
  cfg.rows[6] = BS / 4, cfg.colsb[6] = 64;
  asm volatile("" ::: "memory");  // _tile_loadconfig's asm names only 8 bytes of cfg as input
  _tile_loadconfig(&cfg);
}

// Store C tile `ct` (16 x 64 bytes) naming only the 1 KiB written (GCC's _tile_stored clobbers
// all memory and would spill the accumulators around every store).
using CTile = int32_t[256];
#define LP_TILE_STORED(ct, cb)                      \
  asm volatile("tilestored %%tmm" #ct ", (%1,%2,1)" \
               : "=m"(*(CTile*)(cb))                \
               : "r"((void*)(cb)), "r"(64L))

// Block product: the four planes at ab (hiE, hiO, loE, loO, each 16 x BS bytes, contiguous)
// against the weight block wb.
#define LP_AMX16_BLOCK(ab, wb)                  \
  do {                                          \
    _tile_loadd(6, wb, 64);                     \
    _tile_loadd(4, ab, BS);                     \
    _tile_loadd(5, (ab) + 16 * BS, BS);         \
    _tile_loadd(7, (ab) + 32 * BS, BS);         \
    _tile_zero(0);                              \
    _tile_zero(1);                              \
    _tile_zero(2);                              \
    _tile_zero(3);                              \
    if (MODE == 1) {                            \
      _tile_dpbssd(0, 4, 6);                    \
      _tile_dpbssd(1, 5, 6);                    \
      _tile_dpbusd(2, 7, 6);                    \
      _tile_loadd(4, (ab) + 48 * BS, BS);       \
      _tile_dpbusd(3, 4, 6);                    \
    } else {                                    \
      _tile_dpbsud(0, 4, 6);                    \
      _tile_dpbsud(1, 5, 6);                    \
      _tile_dpbuud(2, 7, 6);                    \
      _tile_loadd(4, (ab) + 48 * BS, BS);       \
      _tile_dpbuud(3, 4, 6);                    \
    }                                           \
  } while (0)

// Scale block b's four stored C tiles (cb: hiE, hiO, loE, loO, 256 int32 each) into the even /
// odd half accumulators: qmm16.h tile's per-block f32 operations, element by element.
// dT (nb32, 16) = d_a and hT (nb, 16) = 0.5 * d_a * sum(q) per BS, transposed per row tile.
template <int BS, int MODE>
inline void scale_block16(const int32_t* cb, const float* S, const float* C, float off, int b, const float* dT,
                          const float* hT, __m512* accE, __m512* accO) {
  const __m512 s = _mm512_loadu_ps(S + b * R);
  __m512 c = _mm512_setzero_ps();
  if (MODE == 0) c = _mm512_loadu_ps(C + b * R);
  if (MODE == 2) c = _mm512_mul_ps(s, _mm512_set1_ps(off));
  const float* da = dT + ((b * BS) / 32) * 16;
  const float* ha = hT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i e = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)(cb + 16 * t)), 8),
                                       _mm512_load_si512((const void*)(cb + 512 + 16 * t)));
    const __m512i o = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)(cb + 256 + 16 * t)), 8),
                                       _mm512_load_si512((const void*)(cb + 768 + 16 * t)));
    const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(da[t]));
    accE[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), sd, accE[t]);
    accO[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o), sd, accO[t]);
    if (MODE != 1) {
      const __m512 h = _mm512_set1_ps(ha[t]);
      accE[t] = _mm512_fmadd_ps(c, h, accE[t]);
      accO[t] = _mm512_fmadd_ps(c, h, accO[t]);
    }
  }
}

// y rows 0 .. mrows-1 of one tile of 16 activation rows (planes: nb blocks x 4 x 16 x BS bytes)
// x the nvalid rows of one weight group.
template <int BS, int MODE>
void rows16x16(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* planes,
               const float* dT, const float* hT, int mrows, float* y, int64_t ldy, int nvalid,
               int32_t* cbuf /* 2 x 1024 */) {
  __m512 accE[16], accO[16];
  for (int t = 0; t < 16; ++t) accE[t] = accO[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const int8_t* ab = planes + (int64_t)b * 64 * BS;
    {  // the weights 4 blocks ahead (the next group's first ones at the end): streamed from memory
      const char* pf = (const char*)(W + (int64_t)(b + 4) * BS * R);
      for (int l = 0; l < BS * R; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
    }
    LP_AMX16_BLOCK(ab, W + (int64_t)b * BS * R);
    if (b > 0) scale_block16<BS, MODE>(cbuf + ((b - 1) & 1) * 1024, S, C, off, b - 1, dT, hT, accE, accO);
    int32_t* cp = cbuf + (b & 1) * 1024;
    LP_TILE_STORED(0, cp);
    LP_TILE_STORED(1, cp + 256);
    LP_TILE_STORED(2, cp + 512);
    LP_TILE_STORED(3, cp + 768);
  }
  scale_block16<BS, MODE>(cbuf + ((nb - 1) & 1) * 1024, S, C, off, nb - 1, dT, hT, accE, accO);
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < 16; ++t)
    if (t < mrows) _mm512_mask_storeu_ps(y + t * ldy, m, _mm512_add_ps(accE[t], accO[t]));
}
#undef LP_AMX16_BLOCK
#undef LP_TILE_STORED

template <int BS, int MODE>
void gemm(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, const Act16& a, int n,
          float* y, int nthreads) {
  const int nb = k / BS, nb32 = k / 32, nb16 = k / 16;
  const int G = (d + R - 1) / R;
  const int64_t wstride = (int64_t)nb * BS * R;
  const int64_t sstride = (int64_t)nb * R;
  if (!amx16_pays(BS)) {
    gemm_vnni16<BS, MODE>(qw, sc, bias, off, d, k, a, n, y, nthreads);
    return;
  }
  const int nfull = n / 16, rest = n - nfull * 16;
  const int mtail = rest >= amx16_min_rows(BS) ? rest : 0;
  const int ntiles = nfull + (mtail ? 1 : 0), mtiles = nfull * 16 + mtail;
  if (mtiles < n) {  // the rows after the tiles: vpdpwssd
    const int64_t r0 = (int64_t)nfull * 16;
    const Act16 at{a.q + r0 * k, a.d + r0 * nb32, a.s16 + r0 * nb16, a.s32 + r0 * nb32, k};
    gemm_vnni16<BS, MODE>(qw, sc, bias, off, d, k, at, n - mtiles, y + r0 * d, nthreads);
  }
  if (ntiles == 0) return;
  const size_t nfl = (size_t)ntiles * 16 * (nb32 + nb);
  const size_t pbytes = (size_t)ntiles * 64 * k;  // 4 planes x 16 rows x k per tile
  char* buf = (char*)aligned_alloc(64, ((nfl * sizeof(float) + pbytes) + 63) & ~(size_t)63);
  if (!buf) {  // out of memory for the scratch: the vpdpwssd kernel gives the same result
    gemm_vnni16<BS, MODE>(qw, sc, bias, off, d, k, a, mtiles, y, nthreads);
    return;
  }
  memset(buf, 0, nfl * sizeof(float) + pbytes);
  int8_t* planes = (int8_t*)buf;
  float* dT = (float*)(buf + pbytes);
  float* hT = dT + (size_t)ntiles * 16 * nb32;
  const float* sa = BS == 32 ? a.s32 : a.s16;
  const __mmask16 even = 0x3333;  // i16 lanes j with j % 4 in {0, 1}
  const __m256i lomask = _mm256_set1_epi16(0xFF);
  for (int i = 0; i < mtiles; ++i) {
    const int tile = i / 16, t = i % 16;
    for (int j = 0; j < nb32; ++j) dT[((size_t)tile * nb32 + j) * 16 + t] = a.d[(int64_t)i * nb32 + j];
    for (int j = 0; j < nb; ++j)
      hT[((size_t)tile * nb + j) * 16 + t] = 0.5f * sa[(int64_t)i * (BS == 32 ? nb32 : nb16) + j];
    const int16_t* qr = a.q + (int64_t)i * k;
    for (int b = 0; b < nb; ++b) {
      int8_t* pb = planes + ((size_t)tile * nb + b) * 64 * BS + t * BS;
      for (int j = 0; j < BS; j += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qr + b * BS + j));
        const __m256i hi = _mm256_srai_epi16(v, 8), lo = _mm256_and_si256(v, lomask);
        _mm_storeu_si128((__m128i*)(pb + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(even, hi)));
        _mm_storeu_si128((__m128i*)(pb + 16 * BS + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(~even, hi)));
        _mm_storeu_si128((__m128i*)(pb + 32 * BS + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(even, lo)));
        _mm_storeu_si128((__m128i*)(pb + 48 * BS + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(~even, lo)));
      }
    }
  }
  asm volatile("" ::: "memory");  // the scratch is written before any tile load reads it
  const int nt = nthreads > 1 && G > 1 ? (nthreads < G ? nthreads : G) : 1;
  lp::parallel_for(nt, nt, [&](int th) {
    alignas(64) int32_t cbuf[2 * 1024];  // two blocks' four stored C tiles
    load_tile_config16<BS>();
    const int g0 = (int)((int64_t)G * th / nt), g1 = (int)((int64_t)G * (th + 1) / nt);
    const int gspan = wstride >= (512 << 10) ? 1 : (int)((512 << 10) / wstride);  // see qmm_amx.cpp
    for (int gs = g0; gs < g1; gs += gspan) {
      const int ge = gs + gspan < g1 ? gs + gspan : g1;
      for (int it = 0; it < ntiles; ++it) {
        const bool full = it < nfull;
        for (int g = gs; g < ge; ++g) {
          const float* C = bias ? bias + g * sstride : nullptr;
          const int nvalid = d - g * R < R ? d - g * R : R;
          rows16x16<BS, MODE>(qw + g * wstride, sc + g * sstride, C, off, nb, planes + (size_t)it * nb * 64 * BS,
                              dT + (size_t)it * 16 * nb32, hT + (size_t)it * 16 * nb, full ? 16 : mtail,
                              y + (int64_t)it * 16 * d + (int64_t)g * R, d, nvalid, cbuf);
        }
      }
    }
    _tile_release();
  });
  free(buf);
}

}  // namespace

LP_EXPORT void LP_FN(quantize_act16)(const float* x, int64_t ldx, int n, int k, int16_t* aq, float* ad,
                                     float* as16, float* as32, int nthreads) {
  quantize_rows16(x, ldx, n, k, aq, ad, as16, as32, nthreads);
}

LP_DEFINE_QMM(qmm16, Act16, int16_t, quantize_rows16)
