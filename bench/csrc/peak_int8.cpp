// Peak int8 multiply-accumulate rate of one x86 instruction family, on N threads.
//
//   peak_int8 ISA THREADS ITERS   ->  prints "<macs> <seconds>" (all threads together)
//
// ISA: amx (tdpbusd), avx512vnni (vpdpbusd zmm), avxvnni (vpdpbusd ymm, VEX), avx2
// (vpmaddubsw + vpmaddwd + vpaddd, ymm). Each thread runs ITERS iterations of a loop of
// independent accumulator chains (enough of them to cover the instruction's latency, so the loop
// is bound by throughput, not latency); the operands stay in registers (tiles for AMX), so no
// memory traffic is measured. Each function carries its own target attribute, so the binary is
// compiled without -m flags and only the path the caller asks for must exist on the CPU (the
// caller checks /proc/cpuinfo first; a fault is the child's exit status, not the caller's crash).
//
// MACs counted (u8 x s8 products accumulated):
//   tdpbusd tmm: 16 rows x 16 int32 columns x 64 bytes of K = 16384 per instruction;
//   vpdpbusd zmm: 16 int32 lanes x 4 = 64; vpdpbusd ymm: 32;
//   vpmaddubsw ymm: 32 u8 x s8 products (summed in pairs to i16; vpmaddwd and vpaddd widen and
//   accumulate them), so one vpmaddubsw + vpmaddwd + vpaddd triple = 32 MACs.
// AMX needs the process's permission for XTILEDATA (Linux arch_prctl ARCH_REQ_XCOMP_PERM, as
// ggml-cpu/amx/amx.cpp asks for it in ggml_amx_init).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static volatile int64_t g_sink;

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int64_t run_avx512vnni(int64_t iters) {
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
            c9 = c0, c10 = c0, c11 = c0;
    for (int64_t i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+v"(a), "+v"(b));  // keep the operands opaque: no folding of the chains
        c0 = _mm512_dpbusd_epi32(c0, a, b); c1 = _mm512_dpbusd_epi32(c1, a, b);
        c2 = _mm512_dpbusd_epi32(c2, a, b); c3 = _mm512_dpbusd_epi32(c3, a, b);
        c4 = _mm512_dpbusd_epi32(c4, a, b); c5 = _mm512_dpbusd_epi32(c5, a, b);
        c6 = _mm512_dpbusd_epi32(c6, a, b); c7 = _mm512_dpbusd_epi32(c7, a, b);
        c8 = _mm512_dpbusd_epi32(c8, a, b); c9 = _mm512_dpbusd_epi32(c9, a, b);
        c10 = _mm512_dpbusd_epi32(c10, a, b); c11 = _mm512_dpbusd_epi32(c11, a, b);
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
    g_sink = _mm512_reduce_add_epi32(s);
    return iters * 12 * 64;
}

__attribute__((target("avx2,avxvnni"))) static int64_t run_avxvnni(int64_t iters) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
            c9 = c0, c10 = c0, c11 = c0;
    for (int64_t i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+x"(a), "+x"(b));
        c0 = _mm256_dpbusd_avx_epi32(c0, a, b); c1 = _mm256_dpbusd_avx_epi32(c1, a, b);
        c2 = _mm256_dpbusd_avx_epi32(c2, a, b); c3 = _mm256_dpbusd_avx_epi32(c3, a, b);
        c4 = _mm256_dpbusd_avx_epi32(c4, a, b); c5 = _mm256_dpbusd_avx_epi32(c5, a, b);
        c6 = _mm256_dpbusd_avx_epi32(c6, a, b); c7 = _mm256_dpbusd_avx_epi32(c7, a, b);
        c8 = _mm256_dpbusd_avx_epi32(c8, a, b); c9 = _mm256_dpbusd_avx_epi32(c9, a, b);
        c10 = _mm256_dpbusd_avx_epi32(c10, a, b); c11 = _mm256_dpbusd_avx_epi32(c11, a, b);
    }
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(c8, c9), _mm256_add_epi32(c10, c11)));
    alignas(32) int32_t out[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
    g_sink = out[0] + out[7];
    return iters * 12 * 32;
}

__attribute__((target("avx2"))) static int64_t run_avx2(int64_t iters) {
    // 8 chains on 8 distinct (a, b) operand pairs: one pair per chain, so the compiler cannot
    // compute one vpmaddubsw and reuse it (15 of the 16 ymm registers in use)
    __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(4), ones = _mm256_set1_epi16(1);
    __m256i b0 = _mm256_set1_epi8(5), b1 = _mm256_set1_epi8(6), b2 = _mm256_set1_epi8(7), b3 = _mm256_set1_epi8(8);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
#define LP_STEP(c, a, b) c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))
    for (int64_t i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3));
        LP_STEP(c0, a0, b0); LP_STEP(c1, a0, b1); LP_STEP(c2, a0, b2); LP_STEP(c3, a0, b3);
        LP_STEP(c4, a1, b0); LP_STEP(c5, a1, b1); LP_STEP(c6, a1, b2); LP_STEP(c7, a1, b3);
    }
#undef LP_STEP
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    alignas(32) int32_t out[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
    g_sink = out[0] + out[7];
    return iters * 8 * 32;
}

// AMX: 4 accumulator tiles (tmm0-3), 2 A tiles (tmm4-5, 16 rows x 64 bytes), 2 B tiles (tmm6-7,
// 16 rows x 64 bytes = 64 K x 16 int32 columns in VNNI layout): 4 independent tdpbusd per
// iteration, each A and B tile used twice — the 2x2 blocking of ggml's AMX int8 kernels.
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

__attribute__((target("amx-tile,amx-int8"))) static int64_t run_amx(int64_t iters) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    alignas(64) static const int8_t src[16 * 64] = {1};
    alignas(64) int32_t dst[16 * 16];
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, src, 64); _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64); _tile_loadd(7, src, 64);
    for (int64_t i = 0; i < iters; ++i) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, dst, 64);
    _tile_release();
    g_sink = dst[0];
    return iters * 4 * 16384;
}

static bool amx_permission() {
    // ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 (Linux arch/x86/include/uapi/asm/prctl.h)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s amx|avx512vnni|avxvnni|avx2 THREADS ITERS\n", argv[0]);
        return 2;
    }
    const char* isa = argv[1];
    int threads = std::atoi(argv[2]);
    int64_t iters = std::atoll(argv[3]);
    int64_t (*fn)(int64_t) = nullptr;
    if (!std::strcmp(isa, "amx")) {
        if (!amx_permission()) {
            std::fprintf(stderr, "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused\n");
            return 3;
        }
        fn = run_amx;
    } else if (!std::strcmp(isa, "avx512vnni")) {
        fn = run_avx512vnni;
    } else if (!std::strcmp(isa, "avxvnni")) {
        fn = run_avxvnni;
    } else if (!std::strcmp(isa, "avx2")) {
        fn = run_avx2;
    } else {
        std::fprintf(stderr, "unknown ISA %s\n", isa);
        return 2;
    }
    fn(iters / 16 + 1);  // warm-up: wakes the wide units (AVX-512/AMX licence) before timing
    std::vector<int64_t> macs(threads, 0);
    std::vector<std::thread> pool;
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { macs[t] = fn(iters); });
    for (auto& th : pool) th.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int64_t total = 0;
    for (int64_t m : macs) total += m;
    std::printf("%lld %.9f\n", static_cast<long long>(total), s);
    return 0;
}
