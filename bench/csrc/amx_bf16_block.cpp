// Per-block cost of the two AMX matmuls for a B=16 decode (one tile of 16 activation rows), one
// thread, weights hot in L2: the int16 tiles (worker/runtime/kernels/csrc/qmm16_amx.h rows16x16:
// byte planes hi/lo, two TDPB*D, two tile stores, the integer merge and the f32 scaling per
// block) and the bf16 tiles (csrc/qmmbf16.cpp: each weight group widened to bf16 128 + u once,
// then rows16: one TDPBF16PS and one tile store per block) — the kernels' own code, included.
// Weights: Q5_0-like unsigned values with a stored bias (MODE 0).  The two alternate round by
// round; printed: ns per 16 x 16 x 32 block, median [min-max] of 9 rounds.
//
//   g++ -O2 -fopenmp -DLP_AMX -DLP_AVX512 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl \
//       -mavx512vnni -mamx-tile -mamx-int8 -Iworker/runtime/kernels/csrc \
//       bench/csrc/amx_bf16_block.cpp worker/runtime/kernels/csrc/threadpool.cpp -o /tmp/amx_bf16_block
//   /tmp/amx_bf16_block [G=128 k=640 reps=200 convert=1]
//     G weight groups of 16 outputs, k inputs; convert=0 times the bf16 tiles on weights converted
//     once beforehand (as if stored in bf16).
// Not part of the build or the tests; results and their reading: worker/runtime/kernels/README.md
// ("bf16 tiles").  AMX needs the process's permission for XTILEDATA (arch_prctl, asked in main).
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "qmm16_amx.h"
#include "qmmbf16.cpp"

int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  const int G = argc > 1 ? atoi(argv[1]) : 128, k = argc > 2 ? atoi(argv[2]) : 640;
  const int reps = argc > 3 ? atoi(argv[3]) : 200, convert = argc > 4 ? atoi(argv[4]) : 1;
  constexpr int BS = 32;
  const int nb = k / BS, d = G * R;
  srand(1);
  std::vector<uint8_t> W((size_t)G * nb * BS * R);
  for (auto& w : W) w = rand() & 31;
  std::vector<float> S((size_t)G * nb * R), C((size_t)G * nb * R);
  for (size_t i = 0; i < S.size(); ++i) S[i] = 0.01f * (1 + rand() % 7), C[i] = -0.1f * (rand() % 5);
  // int16 tiles: the two byte planes of 16 rows, d_a and d_a * sum(q) per block (transposed)
  std::vector<int8_t> planes((size_t)nb * 32 * BS);
  for (auto& p : planes) p = (int8_t)rand();
  std::vector<float> dT(nb * 16, 1e-3f), hT(nb * 16, 0.5f);
  // bf16 tiles: 16 rows x k bf16 in blocks, their sums; the converted weights of every group
  uint16_t* A = (uint16_t*)aligned_alloc(64, (size_t)nb * 16 * BS * 2);
  for (int i = 0; i < nb * 16 * BS; ++i) A[i] = 0x3f80 + (rand() & 127);
  std::vector<float> xs(nb * 16, 0.5f);
  uint16_t* wb = (uint16_t*)aligned_alloc(64, (size_t)G * nb * 16 * BS * 2);
  std::vector<float> y((size_t)16 * d);
  alignas(64) int32_t cb16[2048];
  alignas(64) float cbf[1024];
  const int rounds = 9;
  double ns[2][rounds];
  for (int round = 0; round < rounds; ++round)
    for (int w = 0; w < 2; ++w) {
      const int which = round % 2 ? 1 - w : w;  // alternate which kernel runs first
      if (which == 0) load_tile_config(0x0F, 0x30, 0x40, BS);
      else load_tile_config(0x3, 0x30, 0xC0, 2 * BS);
      if (which == 1 && !convert)
        for (int g = 0; g < G; ++g) convert_group<BS>(W.data() + (size_t)g * nb * BS * R, nb, wb + (size_t)g * nb * 16 * BS);
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        for (int g = 0; g < G; ++g) {
          const uint8_t* Wg = W.data() + (size_t)g * nb * BS * R;
          const float *Sg = S.data() + (size_t)g * nb * R, *Cg = C.data() + (size_t)g * nb * R;
          float* yg = y.data() + g * R;
          if (which == 0) {
            rows16x16<BS, 0>(Wg, Sg, Cg, 0.f, nb, planes.data(), dT.data(), hT.data(), 16, yg, d, 16, cb16, true);
          } else {
            uint16_t* wg = convert ? wb : wb + (size_t)g * nb * 16 * BS;
            if (convert) convert_group<BS>(Wg, nb, wg);
            rows16<BS, 0>(wg, Sg, Cg, 0.f, nb, A, xs.data(), 16, yg, d, 16, cbf, nullptr, nullptr, nullptr);
          }
        }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      _tile_release();
      ns[which][round] = s / ((double)reps * G * nb) * 1e9;
    }
  for (int w = 0; w < 2; ++w) {
    std::sort(ns[w], ns[w] + rounds);
    printf("%s G=%d k=%d convert=%d: %.1f [%.1f-%.1f] ns per 16x16x32 block (median [min-max] of %d rounds)\n",
           w ? "bf16" : "i16 ", G, k, convert, ns[w][rounds / 2], ns[w][0], ns[w][rounds - 1], rounds);
  }
  printf("checksum %g\n", y[5]);
}
