// The C kernels' own thread pool (lp::pool_run, declared in parallel.h): persistent workers that
// spin briefly, then sleep on a futex. The scheme follows llama.cpp's CPU threadpool
// (ggml/src/ggml-cpu/ggml-cpu.c: ggml_graph_compute_thread / ggml_graph_compute_poll_for_work /
// ggml_graph_compute_thread_sync): a worker polls for new work for a bounded time, then waits
// on a condition; here the condition is a Linux futex on the dispatch word and the completion
// counter, and the poll is bounded in microseconds (LORAPLANE_KERNEL_SPIN_US), not iterations.
//
// Why not OpenMP: libgomp's OMP_WAIT_POLICY is one process-wide choice, made when torch loads
// it, for torch's ops and ours alike. ACTIVE (spin) is faster on an idle machine and collapses
// when another process takes a core; PASSIVE sleeps at once and pays a wake-up per region.
// This pool gives the kernels their own spin budget, and a second concurrent caller runs
// inline instead of starting another team. Measured on the shared 2-core machine
// (worker/runtime/kernels/README.md, "Threads"), any budget >= 20 us cost more than it saved,
// so the default is 0: sleep at once, as fast as OpenMP PASSIVE.
//
// Bursts: while a burst is open (lp::BurstScope, held by one layer kernel call) the pool's
// threads poll for up to LORAPLANE_KERNEL_BURST_US (default 1000) instead of the spin budget:
// within a burst the next dispatch comes microseconds after the last, and a futex wake-up of a
// halted vCPU costs 50-150 us on the VMs measured (kernels README, "Threads"), as much as a
// whole matmul of a decode step.  The threads stop polling when the burst closes, so between
// bursts the spin budget (default 0) applies as before.
//
// Spin back-off: a spinning thread that finds itself descheduled (a clock gap in its poll loop)
// stops every thread of the pool from spinning (bursts included) for
// LORAPLANE_KERNEL_SPIN_BACKOFF_MS.
//
// Protocol (one dispatch):
//   caller: claims the pool (busy flag; a second caller, or a nested call, runs inline instead),
//           writes fn/ctx, then bumps `word` = (generation << 8 | nthreads) and wakes sleepers;
//           runs chunk 0; waits for `pending` (nthreads − 1) to reach 0: spin, then futex.
//   worker i (1 ≤ i < pool size): waits for `word` to change: spin, then futex. If i < the
//           nthreads packed in the word it runs chunk i and decrements `pending`; the last one
//           wakes the caller if it sleeps. Workers with i ≥ nthreads ignore the dispatch.
// nthreads travels in the same 32-bit word as the generation so a worker never pairs one
// dispatch's generation with another's thread count; fn/ctx are read only by participants,
// and the caller cannot overwrite them before every participant has decremented `pending`.
// Sleep/wake uses the Dekker pattern (seq_cst): a sleeper announces itself (`sleepers`,
// `caller_sleeps`) before re-reading the word it waits on; the waker writes the word before
// reading the announcement, so one of the two sees the other and no wake-up is lost.
//
// Lifetime: the pool is allocated once and never freed, and its threads are never joined: at
// process exit they are sleeping in futex (or spinning for at most the budget) and exit_group
// ends them, so there is no static destructor to race and no join to hang the interpreter's
// shutdown. After fork() the child has only the forking thread: a pthread_atfork child handler
// drops the parent's pool (leaked, its threads do not exist in the child), and the next call
// builds a new one.
#include <errno.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>

#include "parallel.h"
#include "qmm_common.h"

namespace lp {

std::atomic<int> g_backend{LP_BACKEND_POOL};
static std::atomic<int64_t> g_spin_ns{0};                 // LORAPLANE_KERNEL_SPIN_US (us -> ns)
static std::atomic<int64_t> g_backoff_ns{100 * 1000000};  // LORAPLANE_KERNEL_SPIN_BACKOFF_MS (ms -> ns)
static std::atomic<int64_t> g_nospin_until{0};            // CLOCK_MONOTONIC ns
static std::atomic<int64_t> g_burst_ns{1000 * 1000};      // LORAPLANE_KERNEL_BURST_US (us -> ns)
static std::atomic<int> g_burst{0};                       // bursts open now (nesting count)

namespace {

constexpr int kMaxThreads = 256;  // nthreads is packed in the low 8 bits of the dispatch word

inline long futex_wait(std::atomic<uint32_t>* addr, uint32_t expected) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline long futex_wake(std::atomic<uint32_t>* addr, int n) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, n, nullptr, nullptr, 0);
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

constexpr int64_t kPreemptedNs = 200 * 1000;

// Spin (with pause) until done() or the spin budget has passed (while a burst is open: the
// larger of it and the burst budget); true when done() held.
// A gap of more than kPreemptedNs between two clock reads means this thread was descheduled
// while it spun: another runnable thread wants this core, spinning takes its time (and costs
// us the scheduler's wake-up preference), so every thread of this pool sleeps at once instead
// of spinning for the next g_backoff_ns.
template <class P>
inline bool spin_until(P done) {
  const int64_t spin = g_spin_ns.load(std::memory_order_relaxed);
  const int64_t burst = g_burst.load(std::memory_order_relaxed) > 0 ? g_burst_ns.load(std::memory_order_relaxed) : 0;
  if (spin <= 0 && burst <= 0) return done();
  int64_t t = now_ns();
  if (t < g_nospin_until.load(std::memory_order_relaxed)) return done();
  const int64_t end = t + spin, burst_end = t + burst;
  for (;;) {
    for (int j = 0; j < 16; ++j) {
      if (done()) return true;
      _mm_pause();
    }
    const int64_t t2 = now_ns();
    if (t2 - t > kPreemptedNs) {
      const int64_t b = g_backoff_ns.load(std::memory_order_relaxed);
      if (b > 0) g_nospin_until.store(t2 + b, std::memory_order_relaxed);
      return done();
    }
    if (t2 >= end && (t2 >= burst_end || g_burst.load(std::memory_order_relaxed) <= 0)) return done();
    t = t2;
  }
}

struct Pool {
  // written by the claiming caller only
  task_fn fn = nullptr;
  void* ctx = nullptr;
  std::atomic<int> size{1};  // threads incl. the caller (workers 1..size-1 exist); atomic for lp_*_pool_size
  alignas(64) std::atomic<uint32_t> word{0};  // generation << 8 | nthreads
  alignas(64) std::atomic<uint32_t> sleepers{0};
  alignas(64) std::atomic<uint32_t> pending{0};
  alignas(64) std::atomic<uint32_t> caller_sleeps{0};
  alignas(64) std::atomic<bool> busy{false};
};

struct WorkerArg {
  Pool* pool;
  int index;
  uint32_t seen;
};

std::atomic<Pool*> g_pool{nullptr};
pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

void atfork_child() {
  // Only the forking thread exists in the child; the parent's workers are gone. Leak the old
  // pool (its memory may be in any state) and let the next call create a fresh one.
  g_pool.store(nullptr, std::memory_order_relaxed);
}

void register_atfork() { pthread_atfork(nullptr, nullptr, atfork_child); }

void* worker_main(void* p) {
  WorkerArg a = *static_cast<WorkerArg*>(p);
  delete static_cast<WorkerArg*>(p);
  Pool* pool = a.pool;
  uint32_t seen = a.seen;
  for (;;) {
    if (!spin_until([&] { return pool->word.load(std::memory_order_acquire) != seen; })) {
      pool->sleepers.fetch_add(1, std::memory_order_seq_cst);
      while (pool->word.load(std::memory_order_seq_cst) == seen) futex_wait(&pool->word, seen);
      pool->sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = pool->word.load(std::memory_order_acquire);
    const int nt = (int)(seen & 0xff);
    if (a.index >= nt) continue;  // not part of this dispatch
    pool->fn(pool->ctx, a.index, nt);
    if (pool->pending.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        pool->caller_sleeps.load(std::memory_order_seq_cst))
      futex_wake(&pool->pending, 1);
  }
  return nullptr;
}

// Start workers until the pool has `want` threads (caller included); if the system refuses a
// thread the pool keeps what it has and dispatches over fewer threads.
void grow(Pool* pool, int want) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);  // signals stay with the interpreter's threads
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  while (pool->size < want) {
    auto* arg = new WorkerArg{pool, pool->size.load(), pool->word.load(std::memory_order_relaxed)};
    pthread_t th;
    if (pthread_create(&th, &attr, worker_main, arg) != 0) {
      delete arg;
      break;
    }
    ++pool->size;
  }
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

Pool* get_pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return p;
  pthread_once(&g_atfork_once, register_atfork);
  Pool* fresh = new Pool();
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;
  return p;
}

}  // namespace

void burst(int open) { g_burst.fetch_add(open > 0 ? 1 : -1, std::memory_order_relaxed); }

bool pool_run(int nthreads, task_fn fn, void* ctx) {
  if (nthreads > kMaxThreads - 1) nthreads = kMaxThreads - 1;
  Pool* pool = get_pool();
  bool expected = false;
  if (!pool->busy.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
  if (pool->size < nthreads) grow(pool, nthreads);
  const int size = pool->size.load(std::memory_order_relaxed);
  const int nt = nthreads < size ? nthreads : size;
  if (nt <= 1) {
    pool->busy.store(false, std::memory_order_release);
    return false;
  }
  pool->fn = fn;
  pool->ctx = ctx;
  pool->pending.store((uint32_t)(nt - 1), std::memory_order_relaxed);
  const uint32_t gen = (pool->word.load(std::memory_order_relaxed) >> 8) + 1;
  pool->word.store((gen << 8) | (uint32_t)nt, std::memory_order_seq_cst);
  if (pool->sleepers.load(std::memory_order_seq_cst)) futex_wake(&pool->word, INT_MAX);

  fn(ctx, 0, nt);

  // completion: spin until pending == 0, then sleep on it
  uint32_t left = 0;
  if (!spin_until([&] { return (left = pool->pending.load(std::memory_order_acquire)) == 0; }))
    left = pool->pending.load(std::memory_order_acquire);
  if (left != 0) {
    pool->caller_sleeps.store(1, std::memory_order_seq_cst);
    while ((left = pool->pending.load(std::memory_order_seq_cst)) != 0) futex_wait(&pool->pending, left);
    pool->caller_sleeps.store(0, std::memory_order_relaxed);
  }
  pool->busy.store(false, std::memory_order_release);
  return true;
}

}  // namespace lp

// Threading backend and spin budget for this library's kernels (library.py sets them from
// LORAPLANE_KERNEL_THREADS / LORAPLANE_KERNEL_SPIN_US / LORAPLANE_KERNEL_SPIN_BACKOFF_MS /
// LORAPLANE_KERNEL_BURST_US when it loads the library).
// backend: 0 = our pool, 1 = OpenMP (torch's libgomp); spin_us, backoff_ms, burst_us < 0 keep
// the current value; backoff_ms = 0 never stops spinning after a preemption; burst_us = 0 makes
// a burst no different from the time between bursts.
LP_EXPORT void LP_FN(threads_config)(int backend, int spin_us, int backoff_ms, int burst_us) {
  lp::g_backend.store(backend == 1 ? LP_BACKEND_OMP : LP_BACKEND_POOL, std::memory_order_relaxed);
  if (spin_us >= 0) lp::g_spin_ns.store((int64_t)spin_us * 1000, std::memory_order_relaxed);
  if (backoff_ms >= 0) lp::g_backoff_ns.store((int64_t)backoff_ms * 1000000, std::memory_order_relaxed);
  if (burst_us >= 0) lp::g_burst_ns.store((int64_t)burst_us * 1000, std::memory_order_relaxed);
  lp::g_nospin_until.store(0, std::memory_order_relaxed);
}

// Threads the pool holds now, the caller included (1 before the first parallel call, and in a
// forked child until its first one).
LP_EXPORT int LP_FN(pool_size)(void) {
  lp::Pool* p = lp::g_pool.load(std::memory_order_acquire);
  return p ? p->size.load(std::memory_order_relaxed) : 1;
}
