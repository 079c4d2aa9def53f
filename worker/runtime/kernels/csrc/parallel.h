// The one place the C kernels go parallel: lp::parallel_for(n, nthreads, f) runs f(i) for
// i in [0, n) split into nthreads contiguous static chunks (chunk t gets
// [t*n/nthreads, (t+1)*n/nthreads)), so which thread computes which index never depends on
// timing, and every index is computed by the same code whatever the thread count (rows and
// output groups stay bit-identical with 1 or 2 threads, and when a call runs inline).
//
// Backends (library.py sets the choice per library from LORAPLANE_KERNEL_THREADS):
// - pool (default): our persistent thread pool, csrc/threadpool.cpp — workers spin for at most
//   LORAPLANE_KERNEL_SPIN_US, then sleep on a futex. When the pool is already running another
//   call (a second Python thread calling a kernel at the same time, or a nested call) the
//   loop runs inline on the calling thread instead of waiting.
// - omp: `#pragma omp parallel` in torch's libgomp (OMP_WAIT_POLICY applies), for comparison.
// Every kernel calls this and nothing else, so the backend changes here without touching a kernel.
#pragma once

#include <stdint.h>

#include <atomic>

#ifdef _OPENMP
#include <omp.h>
#endif

#define LP_BACKEND_POOL 0
#define LP_BACKEND_OMP 1

namespace lp {

// Chunk t of nt of one dispatch.
typedef void (*task_fn)(void* ctx, int t, int nt);

// Run fn(ctx, t, nt) for t in [0, nt) with nt = min(nthreads, pool size) on the pool, chunk 0 on
// the calling thread; returns when all are done. Returns false, having run nothing, when the
// pool is busy with another call or holds no second thread: the caller then runs inline.
bool pool_run(int nthreads, task_fn fn, void* ctx);

// Open (open > 0) or close (open <= 0, once per open) a burst: a run of dispatches close
// together, between which the pool's threads poll instead of sleeping (csrc/threadpool.cpp).
// BurstScope holds one for a scope; bursts nest (two callers at once).
void burst(int open);
struct BurstScope {
  BurstScope() { burst(1); }
  ~BurstScope() { burst(0); }
  BurstScope(const BurstScope&) = delete;
  BurstScope& operator=(const BurstScope&) = delete;
};

extern std::atomic<int> g_backend;

template <class F>
inline void parallel_for(int n, int nthreads, F&& f) {
  if (nthreads > n) nthreads = n;
  if (nthreads <= 1) {
    for (int i = 0; i < n; ++i) f(i);
    return;
  }
  if (g_backend.load(std::memory_order_relaxed) == LP_BACKEND_OMP) {
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
      const int t = 0, nt = 1;
#endif
      const int lo = (int)((int64_t)n * t / nt), hi = (int)((int64_t)n * (t + 1) / nt);
      for (int i = lo; i < hi; ++i) f(i);
    }
    return;
  }
  struct Ctx {
    F* f;
    int n;
  } ctx{&f, n};
  auto chunk = [](void* c, int t, int nt) {
    const Ctx& x = *static_cast<Ctx*>(c);
    const int lo = (int)((int64_t)x.n * t / nt), hi = (int)((int64_t)x.n * (t + 1) / nt);
    for (int i = lo; i < hi; ++i) (*x.f)(i);
  };
  if (!pool_run(nthreads, chunk, &ctx))
    for (int i = 0; i < n; ++i) f(i);
}

}  // namespace lp
