// flowgen_cpu_pool.h — the thread pool of the cpu target's native kernels: one per process,
// sized once to the cores the process may use (sched_getaffinity), the calling thread included.
//
// Why not an OpenMP team: a parallel region ends at a barrier every member must reach, so on a
// shared machine (more runnable threads than cores) a launch waits for a member the scheduler has
// not run yet: a time slice, milliseconds, for microseconds of work. Here a loop is cut into
// chunks that threads claim from a counter; the caller claims chunks too and waits only for
// chunks a helper has claimed and not finished. A helper that is not running when the loop is
// posted claims nothing, and the caller does its share: a loaded machine degrades to one thread
// instead of stalling. Idle helpers spin briefly (about 20 µs: back-to-back launches hand over
// fast on a quiet machine), then sleep on a condition variable (passive: no core held while idle).
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace flowgen_cpu {

// A loop body behind a pointer: call(body, begin, end) runs items [begin, end).
using LoopBody = void (*)(const void* body, long long begin, long long end);

class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  int threads() const { return (int)helpers_.size() + 1; }

  // Run call(body, begin, end) over [0, n) in `chunks` pieces of about equal size, on the caller
  // and whichever helpers are running; returns when every piece is done. A loop posted from
  // inside a piece (a GEMM slice inside a parallel loop) runs on its caller alone.
  void run(long long n, long long chunks, const void* body, LoopBody call) {
    chunks = std::min(chunks, n);
    if (chunks <= 1 || helpers_.empty() || in_piece_) {
      if (n > 0) call(body, 0LL, n);
      return;
    }
    Job job{n, chunks, body, call};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work(job);
    // Pieces a helper claimed may still run; helpers that entered the job must leave it before
    // `job` (on this stack) goes away. No helper enters once job_ is cleared.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = nullptr;
    }
    while (job.done.load(std::memory_order_acquire) < chunks || job.inside.load(std::memory_order_acquire) > 0)
      std::this_thread::yield();
  }

 private:
  struct Job {
    long long n, chunks;
    const void* body;
    LoopBody call;
    std::atomic<long long> next{0}, done{0};
    std::atomic<int> inside{0};   // helpers inside this job
  };

  Pool() {
    cpu_set_t cores;
    int count = 1;
    if (sched_getaffinity(0, sizeof(cores), &cores) == 0) count = std::max(1, CPU_COUNT(&cores));
    for (int t = 1; t < count; ++t) helpers_.emplace_back([this] { helper(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (std::thread& t : helpers_) t.join();
  }

  static void work(Job& job) {
    in_piece_ = true;
    for (long long c; (c = job.next.fetch_add(1, std::memory_order_relaxed)) < job.chunks;) {
      job.call(job.body, job.n * c / job.chunks, job.n * (c + 1) / job.chunks);
      job.done.fetch_add(1, std::memory_order_release);
    }
    in_piece_ = false;
  }

  void helper() {
    unsigned long long seen = 0;
    for (;;) {
      for (int spin = 0; spin < 2000 && generation_.load(std::memory_order_acquire) == seen; ++spin)
        __builtin_ia32_pause();
      Job* job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        seen = generation_.load(std::memory_order_acquire);
        if (stop_) return;
        job = job_;
        if (job == nullptr) continue;   // the caller finished that loop without us
        job->inside.fetch_add(1, std::memory_order_acq_rel);
      }
      work(*job);
      job->inside.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<unsigned long long> generation_{0};
  Job* job_ = nullptr;
  bool stop_ = false;
  static inline thread_local bool in_piece_ = false;
};

// call(body, begin, end) over [0, n), in pieces of at least `grain` items (fewer pieces than that:
// one call on this thread), at most four per thread so a late helper leaves little to wait for.
// Not a template and never inlined: one compiled copy per object file, which every kernel calls.
// (When the pool's posting and waiting code was a template over the body, inlined into every
// kernel, g++ spent about 6 ms of CPU per native kernel on it: a fifth of a cold build.)
__attribute__((noinline)) inline void parallel_loop(long long n, long long grain, const void* body, LoopBody call) {
  Pool& pool = Pool::get();
  pool.run(n, std::min(n / std::max(grain, 1LL), 4LL * pool.threads()), body, call);
}

// body(begin, end) over [0, n) as parallel_loop spreads it: a kernel's loop instantiates only the
// function that calls its body.
template <class Body>
inline void parallel_for(long long n, long long grain, const Body& body) {
  if (n / std::max(grain, 1LL) <= 1) {   // one piece: the loop inlined here, where g++ sees the kernel's pointers
    if (n > 0) body(0LL, n);
    return;
  }
  parallel_loop(n, grain, &body,
                [](const void* f, long long begin, long long end) { (*static_cast<const Body*>(f))(begin, end); });
}

// The same loop where `n` and `grain` are constants, as in a kernel rendered for fixed sizes:
// `Pieces` (FLOWGEN_PARALLEL_FOR works it out while compiling) is 1 for one piece, 2 for more,
// 0 for sizes known only at run time. g++ then compiles only the path the loop takes; for
// parallel_for it compiles the body twice (inlined, and in the pool's call), which was an
// eighth of the g++ time of a cold MobileNetV2 training build.
template <int Pieces>
struct SizedLoop {
  long long n, grain;

  template <class Body>
  void operator()(const Body& body) const {
    if constexpr (Pieces == 1) {
      if (n > 0) body(0LL, n);
    } else if constexpr (Pieces == 2) {
      parallel_loop(n, grain, &body,
                    [](const void* f, long long begin, long long end) { (*static_cast<const Body*>(f))(begin, end); });
    } else {
      parallel_for(n, grain, body);
    }
  }
};

}  // namespace flowgen_cpu

// `FLOWGEN_PARALLEL_FOR(n, grain)(body);` is parallel_for(n, grain, body) in generated kernels
// (a macro: __builtin_constant_p tells constant sizes from run-time ones, a dynamic
// dimension's, and only for constants the piece count is a template argument; the body stays
// outside the macro's arguments, where its `#pragma omp simd` lines may be).
#define FLOWGEN_PARALLEL_FOR(n, grain)                                                              \
  ::flowgen_cpu::SizedLoop<(__builtin_constant_p((n) / std::max((long long)(grain), 1LL))         \
                                ? ((n) / std::max((long long)(grain), 1LL) <= 1 ? 1 : 2) \
                                : 0)>{(n), (grain)}
