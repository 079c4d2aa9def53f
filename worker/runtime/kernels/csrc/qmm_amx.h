// What the two AMX matmuls share (qmm8_amx.h: int8 activations; qmm16_amx.h: int16 activations
// by a byte split), built only into the `amx` library (-DLP_AMX -DLP_AVX512 + the avx512 flags +
// -mamx-tile -mamx-int8): the tile configuration, the tile store, and the driver gemm_amx that
// splits a call into tiles of 16 activation rows, stages their scales, and walks the weight
// groups on lp::parallel_for.  Each activation precision supplies only its tile arithmetic, as a
// traits struct K:
//   using Act                          its activation struct (qmm8.h Act / qmm16.h Act16)
//   pays(bs), min_rows(bs)             whether tiles pay for this block size at all; the fewest
//                                      rows worth a (zero-padded) tile — fewer run vnni
//   kSumScale                          factor on each block's d * sum(q) in the staged sT
//   kCbuf                              int32 per thread for stored C tiles
//   vnni<BS, MODE>(...)                its vpdpbusd / vpdpwssd kernel (same bits, any rows)
//   input_bytes(ntiles, mtail, k)      bytes of the staged tile input
//   stage<BS>(in, a, nfull, mtail, nb) fill it; input<BS>(in, a, it, nfull, nb): tile it's rows
//   configure<BS, MODE>()              ldtilecfg on the calling thread
//   rows<BS, MODE>(..., stream)        y rows of one row tile x one weight group of 16 rows; it
//                                      prefetches the weights into L1 ahead, and into L2 far
//                                      ahead when stream (lp::prefetch_weights) — the first row
//                                      tile of a span; the others find the span in L2
// Both precisions give their vnni kernel's f32 results bit for bit, so which rows take tiles is
// a speed choice only (why and the measurements: the kernels' README, "AMX").
//
// Tile state is per thread: each worker of lp::parallel_for loads the configuration at the start
// of its share of the groups and releases the tiles at its end (ldtilecfg/tilerelease once per
// thread per call), so nothing is assumed about a pool thread's tile state between calls
// (torch's oneDNN may configure its own tiles on the same threads).  The process must have asked
// the kernel for the AMX state first: lp_amx_request_tile_perm (qmm.cpp) —
// worker/runtime/kernels/cpu.py calls it before the `amx` path is used; without it the first
// ldtilecfg raises SIGILL.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

namespace {

struct alignas(64) TileConfig {  // the 64-byte ldtilecfg operand, palette 1
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of tmm0..15 (only 0..7 exist)
  uint8_t rows[16];
};

// Configure tmm0..7 on the calling thread: bit t of c_tiles marks tmm t as a C tile (16 x 16
// int32), of a_tiles an A tile (16 rows x bs bytes), of b_tiles a B tile (bs/4 rows x 64 bytes).
inline void load_tile_config(unsigned c_tiles, unsigned a_tiles, unsigned b_tiles, int bs) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    if (c_tiles >> t & 1) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    if (a_tiles >> t & 1) cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)bs;
    if (b_tiles >> t & 1) cfg.rows[t] = (uint8_t)(bs / 4), cfg.colsb[t] = 64;
  }
  asm volatile("" ::: "memory");  // _tile_loadconfig's asm names only 8 bytes of cfg as input
  _tile_loadconfig(&cfg);
}

// Store C tile `ct` (16 rows x 64 bytes) to cb.  GCC's _tile_stored clobbers all memory, which
// forces the 16 accumulators out to the stack around every store; this one names only the 1 KiB
// it writes.
using CTile = int32_t[256];
#define LP_TILE_STORED(ct, cb)                      \
  asm volatile("tilestored %%tmm" #ct ", (%1,%2,1)" \
               : "=m"(*(CTile*)(cb))                \
               : "r"((void*)(cb)), "r"(64L))

// y (n, d) f32 = x @ W.T, x given as K's quantized activations a (n rows); the arguments of
// the vnni kernels (qmm8.h gemm_vnni).  Rows in whole tiles of 16 (plus a zero-padded last one
// of at least K::min_rows) go to AMX, the rest to K::vnni.
template <class K, int BS, int MODE>
void gemm_amx(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k,
              const typename K::Act& a, int n, float* y, int nthreads) {
  if (!K::pays(BS)) {
    K::template vnni<BS, MODE>(qw, sc, bias, off, d, k, a, n, y, nthreads);
    return;
  }
  const int nb = k / BS, nb32 = k / 32, nb16 = k / 16;
  const int G = (d + R - 1) / R;
  const int64_t wstride = (int64_t)nb * BS * R;  // bytes per group
  const int64_t sstride = (int64_t)nb * R;       // scales per group
  const int nfull = n / 16, rest = n - nfull * 16;
  const int mtail = rest >= K::min_rows(BS) ? rest : 0;  // rows of the padded tail tile
  const int ntiles = nfull + (mtail ? 1 : 0), mtiles = nfull * 16 + mtail;
  if (mtiles < n) {  // the rows after the tiles: vnni
    const int64_t r0 = (int64_t)nfull * 16;
    K::template vnni<BS, MODE>(qw, sc, bias, off, d, k, a.from_row(r0), n - mtiles, y + r0 * d, nthreads);
  }
  if (ntiles == 0) return;
  // Scratch (zeroed: pad rows have zero scales and activations): the staged tile input, then per
  // tile of 16 rows the scales transposed so that block b's 16 values are contiguous:
  // dT (nb32, 16) = d_a, sT (nb, 16) = kSumScale * d_a * sum(a_q) per BS.
  const size_t in_bytes = K::input_bytes(ntiles, mtail, k);
  const size_t nfl = (size_t)ntiles * 16 * (nb32 + nb);
  const size_t bytes = (in_bytes + nfl * sizeof(float) + 63) & ~(size_t)63;
  char* buf = (char*)aligned_alloc(64, bytes);
  if (!buf) {  // out of memory for the scratch: the vnni kernel gives the same result
    K::template vnni<BS, MODE>(qw, sc, bias, off, d, k, a, mtiles, y, nthreads);
    return;
  }
  memset(buf, 0, bytes);
  int8_t* in = (int8_t*)buf;
  float* dT = (float*)(buf + in_bytes);
  float* sT = dT + (size_t)ntiles * 16 * nb32;
  const float* sa = BS == 32 ? a.s32 : a.s16;
  for (int i = 0; i < mtiles; ++i) {
    const int tile = i / 16, t = i % 16;
    for (int j = 0; j < nb32; ++j) dT[((size_t)tile * nb32 + j) * 16 + t] = a.d[(int64_t)i * nb32 + j];
    for (int j = 0; j < nb; ++j)
      sT[((size_t)tile * nb + j) * 16 + t] = K::kSumScale * sa[(int64_t)i * (BS == 32 ? nb32 : nb16) + j];
  }
  K::template stage<BS>(in, a, nfull, mtail, nb);
  asm volatile("" ::: "memory");  // the scratch is written before any tile load reads it
  const int nt = nthreads > 1 && G > 1 ? (nthreads < G ? nthreads : G) : 1;
  // One index per thread (parallel_for's static split over G, by hand), so that each thread
  // configures its tiles once per call.
  lp::parallel_for(nt, nt, [&](int th) {
    alignas(64) int32_t cbuf[K::kCbuf];
    K::template configure<BS, MODE>();
    const int g0 = (int)((int64_t)G * th / nt), g1 = (int)((int64_t)G * (th + 1) / nt);
    // Groups in spans of about 512 KiB of weights (kept in L2 while every row tile passes
    // over them), so each output row is written in runs of gspan * 64 bytes: one group at a
    // time, a 512-row prefill against a 262144-row LM head wrote 64 bytes per 1 MiB row
    // stride (a TLB and cache miss per store) and took seconds.
    const int gspan = wstride >= (512 << 10) ? 1 : (int)((512 << 10) / wstride);
    for (int gs = g0; gs < g1; gs += gspan) {
      const int ge = gs + gspan < g1 ? gs + gspan : g1;
      for (int it = 0; it < ntiles; ++it) {
        const int8_t* x = K::template input<BS>(in, a, it, nfull, nb);
        for (int g = gs; g < ge; ++g) {
          const float* C = bias ? bias + g * sstride : nullptr;
          const int nvalid = d - g * R < R ? d - g * R : R;
          K::template rows<BS, MODE>(qw + g * wstride, sc + g * sstride, C, off, nb, x, k,
                                     dT + (size_t)it * 16 * nb32, sT + (size_t)it * 16 * nb,
                                     it < nfull ? 16 : mtail, y + (int64_t)it * 16 * d + (int64_t)g * R, d, nvalid,
                                     cbuf, it == 0);  // the first row tile streams the span in
        }
      }
    }
    _tile_release();
  });
  free(buf);
}

}  // namespace
