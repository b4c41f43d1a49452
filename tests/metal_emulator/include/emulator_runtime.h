// The execution side of the MSL emulator: runs the threads of a Metal dispatch on the CPU.
//
// A dispatch is a grid of threadgroups. Threadgroups are independent, so they are shared out
// to a few OS threads ("workers"). Inside a threadgroup, threads that never synchronise run
// one after another in a plain loop (fast). Kernels that call threadgroup_barrier or a simd-group
// function run each thread as a fiber on its own stack: a fiber runs until it reaches a
// synchronisation point and then yields to the worker's scheduler, which resumes the others;
// a barrier releases when every live thread of its scope (threadgroup or simd-group) arrived.
// Threads that wait at different barriers forever are a divergent barrier: the dispatch fails
// with a message instead of hanging.
//
// Context switching uses a few lines of assembly on x86-64 (callee-saved registers and the
// stack pointer; kernels never change the floating-point environment, so it is not saved) and
// ucontext elsewhere; ucontext is correct everywhere but makes a system call per switch.
// A fiber that blocks hands over directly to the next runnable fiber of its threadgroup; only
// when none is runnable does control go back to the scheduler, which then finds the threadgroup
// either finished or deadlocked.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/mman.h>

namespace emu {

constexpr int kMaxBindings = 31;     // Metal's buffer / threadgroup-memory index limit
constexpr int kMaxThreads = 1024;    // threads per threadgroup the emulated GPU allows
constexpr int kSlotBytes = 32;       // largest value a simd-group function exchanges
constexpr size_t kStackBytes = 32 * 1024;

// Filled in by the Python harness (ctypes mirror in harness.py): one dispatch.
struct Dispatch {
  void* buffers[kMaxBindings];
  uint64_t lengths[kMaxBindings];    // bytes the kernel may touch from buffers[i]
  uint64_t extent_lo[kMaxBindings];  // the allocation holding buffer i, guard bands included
  uint64_t extent_hi[kMaxBindings];
  uint64_t tg_lengths[kMaxBindings];
  uint32_t groups[3];
  uint32_t threads[3];
  uint32_t simd_width;
  uint32_t workers;
  uint32_t checks;  // kCheckBounds | kCheckRaces
  char error[1024];
};

// The names of a kernel's parameters by binding index (for error messages).
struct Names {
  const char* buffers[kMaxBindings];
  const char* threadgroup[kMaxBindings];
};

// Everything a thread can ask for through a position attribute.
struct ThreadIds {
  uint32_t grid[3], local[3], group[3], tpg[3], groups[3], grid_size[3];
  uint32_t index, lane, simdgroup, simd_width, simdgroups;
  uint32_t group_linear;
};
}  // namespace emu

// The runtime itself is not instrumented: only kernel code reaches the access hooks.
#pragma clang attribute push(__attribute__((no_sanitize("coverage"))), apply_to = function)

#include "emulator_checks.h"
#include "emulator_fibers.h"

namespace emu {

using Body = void (*)(const Dispatch*, void* const*, const ThreadIds&);

// ---- per-worker scheduler ----------------------------------------------------------------

enum Wait : uint8_t { kRunnable, kAtThreadgroupBarrier, kAtSimdBarrier, kFinished };

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  ThreadIds ids;
  Wait wait = kRunnable;
  uint32_t gen = 0;  // generation of the barrier being waited on
  uint32_t mem = 0;  // mem_flags of the last barrier reached
};

struct SimdGroup {
  uint32_t arrived = 0, gen = 0, live = 0;
  uint32_t mem = 0;  // mem_flags of the simdgroup_barrier being gathered (0: a function)
  uint32_t mask[2] = {0, 0};  // lanes that deposited a value, per generation parity
  alignas(16) unsigned char slots[2][32][kSlotBytes];
};

struct Run;  // one dispatch, shared by its workers

struct Worker {
  Run* run = nullptr;
  bool fiber_mode = false;
  std::vector<Fiber> fibers;
  Context scheduler;
  int current = -1;
  uint32_t count = 0;  // threads in the current threadgroup
  const ThreadIds* ids = nullptr;  // the running thread's, in both modes
  uint32_t tg_arrived = 0, tg_gen = 0, tg_size = 0;
  SimdGroup simd[kMaxThreads / 32];
  void* tg_ptrs[kMaxBindings] = {};
  Checker check;
};

struct Run {
  const Dispatch* d;
  Dispatch* out;
  Body body;
  const char* kernel;
  const Names* names;
  std::atomic<uint64_t> next_group{0};
  std::atomic<bool> failed{false};
  std::mutex error_lock;

  void fail(const char* message) {
    std::lock_guard<std::mutex> guard(error_lock);
    if (!failed.exchange(true)) snprintf(out->error, sizeof(out->error), "%s", message);
  }
};

// initial-exec: the access hooks read it at every load and store
static thread_local Worker* tls_worker __attribute__((tls_model("initial-exec"))) = nullptr;

inline Worker& current_worker() { return *tls_worker; }

// Atomic operations are exempt from race checking (they are how threads may share words).
struct AtomicScope {
  AtomicScope() { if (tls_worker) ++tls_worker->check.atomic; }
  ~AtomicScope() { if (tls_worker) --tls_worker->check.atomic; }
};

inline void report_outside_fiber(const char* what) {
  Worker* w = tls_worker;
  if (w == nullptr) return;  // called outside any dispatch: nothing to synchronise
  char msg[256];
  snprintf(msg, sizeof(msg),
           "kernel %s called %s but the emulator classified it as free of synchronisation; "
           "the harness's call-graph scan missed a path", w->run->kernel, what);
  w->run->fail(msg);
}

inline bool ready(const Worker& w, const Fiber& f) {
  switch (f.wait) {
    case kRunnable: return true;
    case kAtThreadgroupBarrier: return w.tg_gen != f.gen;
    case kAtSimdBarrier: return w.simd[f.ids.simdgroup].gen != f.gen;
    default: return false;
  }
}

// Leave the current fiber (blocked or finished) for the next runnable one after it in
// round-robin order, or for the scheduler when there is none.
inline void switch_away(Worker& w) {
  const int n = static_cast<int>(w.count);
  Fiber& from = w.fibers[w.current];
  for (int step = 1; step <= n; ++step) {
    int next = w.current + step;
    if (next >= n) next -= n;
    Fiber& f = w.fibers[next];
    if (ready(w, f)) {
      f.wait = kRunnable;
      w.current = next;
      w.ids = &f.ids;
      w.check.local = f.ids.index;
      if (&f != &from) context_switch(from.ctx, f.ctx);
      return;
    }
  }
  context_switch(from.ctx, w.scheduler);
}

inline void release_threadgroup(Worker& w, uint32_t mem) {
  w.tg_arrived = 0;
  ++w.tg_gen;
  w.check.barrier(mem);
}

// Release simd-group `index` of worker `w`; a simdgroup_barrier orders memory for its lanes.
inline void release_simd(Worker& w, uint32_t index) {
  SimdGroup& s = w.simd[index];
  s.arrived = 0;
  ++s.gen;
  s.mask[s.gen & 1] = 0;
  if (s.mem) w.check.simd_barrier(index, s.mem);
  s.mem = 0;
}

// threadgroup_barrier(): wait until every thread of the threadgroup arrives.
inline void threadgroup_wait(uint32_t mem) {
  Worker* w = tls_worker;
  if (w == nullptr || !w->fiber_mode) {
    report_outside_fiber("threadgroup_barrier");
    return;
  }
  Fiber& f = w->fibers[w->current];
  f.mem = mem;
  if (++w->tg_arrived == w->tg_size) {
    release_threadgroup(*w, mem);
    return;
  }
  f.wait = kAtThreadgroupBarrier;
  f.gen = w->tg_gen;
  switch_away(*w);
}

// One simd-group exchange: deposit `value`, wait for every live lane of the simd-group, and
// return the 32 deposited slots (lanes in `mask`). Slots of a generation stay intact until the
// next-but-one exchange, which cannot start before every lane has left this one.
// `mem` is the mem_flags of a simdgroup_barrier (0 for simd-group functions, which do not order
// memory).
template <class T>
inline const unsigned char (*simd_exchange(const T& value, uint32_t& mask,
                                           uint32_t mem = 0))[kSlotBytes] {
  static_assert(sizeof(T) <= kSlotBytes, "simd-group value too large for the emulator");
  Worker* w = tls_worker;
  if (w == nullptr || !w->fiber_mode) {
    report_outside_fiber("a simd-group function");
    static unsigned char dummy[32][kSlotBytes];
    std::memcpy(dummy[0], &value, sizeof(T));
    mask = 1;
    return dummy;
  }
  Fiber& f = w->fibers[w->current];
  SimdGroup& s = w->simd[f.ids.simdgroup];
  const uint32_t parity = s.gen & 1;
  std::memcpy(s.slots[parity][f.ids.lane], &value, sizeof(T));
  s.mask[parity] |= 1u << f.ids.lane;
  s.mem |= mem;
  if (++s.arrived == s.live) {
    release_simd(*w, f.ids.simdgroup);
  } else {
    f.wait = kAtSimdBarrier;
    f.gen = s.gen;
    switch_away(*w);
  }
  mask = s.mask[parity];
  return s.slots[parity];
}

// A simdgroup_matrix product reached by fewer than the 32 lanes of its simd-group (a partial
// simd-group, or lanes that diverged): undefined in MSL, an error here.
inline void report_partial_simdgroup(const char* what) {
  Worker* w = tls_worker;
  if (w == nullptr) return;
  char msg[256];
  snprintf(msg, sizeof(msg),
           "kernel %s: %s was executed by only some lanes of simd-group %u; MSL requires all 32 "
           "lanes of a simd-group to execute simdgroup_matrix operations together",
           w->run->kernel, what, w->ids->simdgroup);
  w->run->fail(msg);
}

inline uint32_t current_lane() { return tls_worker ? tls_worker->ids->lane : 0; }

// ---- running a threadgroup ---------------------------------------------------------------

inline void fiber_entry(void* arg) {
  Worker& w = current_worker();
  auto* f = static_cast<Fiber*>(arg);
  w.check.local = f->ids.index;
  try {
    w.run->body(w.run->d, w.tg_ptrs, f->ids);
  } catch (const OutOfBounds&) {
    // reported; this thread stops here (the others stop at their next barrier or finish)
  }
  f->wait = kFinished;
  // A finished thread is no longer an active lane of its simd-group, which may complete a
  // simd-group function the others wait in. A threadgroup barrier, by contrast, must be
  // reached by every thread of the threadgroup (MSL), so finishing never releases one.
  SimdGroup& s = w.simd[f->ids.simdgroup];
  --s.live;
  if (s.arrived > 0 && s.arrived == s.live) release_simd(w, f->ids.simdgroup);
  switch_away(w);  // never resumed
  std::abort();
}

inline void fill_ids(ThreadIds& t, const Dispatch* d, const uint32_t group[3], uint32_t x,
                     uint32_t y, uint32_t z) {
  const uint32_t* n = d->threads;
  t.local[0] = x; t.local[1] = y; t.local[2] = z;
  for (int i = 0; i < 3; ++i) {
    t.group[i] = group[i];
    t.tpg[i] = n[i];
    t.groups[i] = d->groups[i];
    t.grid_size[i] = d->groups[i] * n[i];
    t.grid[i] = group[i] * n[i] + t.local[i];
  }
  t.index = x + n[0] * (y + n[1] * z);
  t.simd_width = d->simd_width;
  t.lane = t.index % d->simd_width;
  t.simdgroup = t.index / d->simd_width;
  t.simdgroups = (n[0] * n[1] * n[2] + d->simd_width - 1) / d->simd_width;
  t.group_linear = group[0] + d->groups[0] * (group[1] + d->groups[1] * group[2]);
}

inline void allocate_stacks(Worker& w, uint32_t count) {
  const size_t page = 4096;
  while (w.fibers.size() < count) {
    w.fibers.emplace_back();
    void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
      w.fibers.pop_back();
      return;
    }
    mprotect(mem, page, PROT_NONE);  // guard page: an overflow faults instead of corrupting
    w.fibers.back().stack = static_cast<char*>(mem) + page;
  }
}

inline void run_fibers(Worker& w, const uint32_t group[3]) {
  const Dispatch* d = w.run->d;
  const uint32_t* n = d->threads;
  const uint32_t count = n[0] * n[1] * n[2];
  allocate_stacks(w, count);
  if (w.fibers.size() < count) {
    w.run->fail("the emulator could not allocate fiber stacks");
    return;
  }
  uint32_t i = 0;
  for (uint32_t z = 0; z < n[2]; ++z)
    for (uint32_t y = 0; y < n[1]; ++y)
      for (uint32_t x = 0; x < n[0]; ++x, ++i) {
        Fiber& f = w.fibers[i];
        fill_ids(f.ids, d, group, x, y, z);
        f.wait = kRunnable;
        context_init(f.ctx, f.stack, kStackBytes, &f);
      }
  w.tg_arrived = 0;
  w.tg_size = count;
  const uint32_t simdgroups = (count + d->simd_width - 1) / d->simd_width;
  for (uint32_t s = 0; s < simdgroups; ++s) {
    w.simd[s].arrived = 0;
    w.simd[s].mem = 0;
    w.simd[s].mask[0] = w.simd[s].mask[1] = 0;
    w.simd[s].live = s + 1 < simdgroups ? d->simd_width : count - s * d->simd_width;
  }
  w.count = count;
  w.current = 0;
  w.ids = &w.fibers[0].ids;
  w.check.local = 0;
  context_switch(w.scheduler, w.fibers[0].ctx);  // returns when no fiber can run
  uint32_t finished = 0, at_tg = 0, at_simd = 0;
  for (uint32_t t = 0; t < count; ++t) {
    finished += w.fibers[t].wait == kFinished;
    at_tg += w.fibers[t].wait == kAtThreadgroupBarrier;
    at_simd += w.fibers[t].wait == kAtSimdBarrier;
  }
  if (finished < count) {
    char msg[512];
    snprintf(msg, sizeof(msg),
             "kernel %s deadlocked in threadgroup (%u,%u,%u): %u threads wait at "
             "threadgroup_barrier, %u at simd-group functions, %u finished; a barrier or "
             "simd-group function is not reached by every thread (divergent control flow)",
             w.run->kernel, group[0], group[1], group[2], at_tg, at_simd, finished);
    w.run->fail(msg);
    // the blocked fibers are abandoned; their stacks are re-initialised for the next group
  }
}

inline void run_loop(Worker& w, const uint32_t group[3]) {
  const Body body = w.run->body;
  const Dispatch* d = w.run->d;
  const uint32_t* n = d->threads;
  ThreadIds t;
  try {
    for (uint32_t z = 0; z < n[2]; ++z)
      for (uint32_t y = 0; y < n[1]; ++y) {
        fill_ids(t, d, group, 0, y, z);
        for (uint32_t x = 0; x < n[0]; ++x) {
          t.local[0] = x;
          t.grid[0] = group[0] * n[0] + x;
          w.ids = &t;
          w.check.local = t.index;
          body(d, w.tg_ptrs, t);
          ++t.index;
          if (++t.lane == t.simd_width) {
            t.lane = 0;
            ++t.simdgroup;
          }
        }
      }
  } catch (const OutOfBounds&) {
    // reported; the dispatch has failed
  }
}

}  // namespace emu

#include "emulator_memory.h"

namespace emu {

inline void work(Worker& w) {
  tls_worker = &w;
  Run& r = *w.run;
  const Dispatch* d = r.d;
  Checker& c = w.check;
  c.flags = d->checks;
  c.kernel = r.kernel;
  c.reported = false;
  c.fail = &run_failed;
  c.fail_ctx = &r;
  c.groups[0] = d->groups[0];
  c.groups[1] = d->groups[1];
  c.groups[2] = d->groups[2];
  c.tg_threads = d->threads[0] * d->threads[1] * d->threads[2];
  if (!prepare_threadgroup_memory(w)) {
    r.fail("the emulator ran out of threadgroup memory");
    tls_worker = nullptr;
    return;
  }
  prepare_device_memory(w);
  const uint64_t gx = d->groups[0], gy = d->groups[1], total_groups = gx * gy * d->groups[2];
  for (;;) {
    const uint64_t g = r.next_group.fetch_add(1);
    if (g >= total_groups || r.failed.load(std::memory_order_relaxed)) break;
    const uint32_t group[3] = {uint32_t(g % gx), uint32_t((g / gx) % gy), uint32_t(g / (gx * gy))};
    c.start_group(uint32_t(g));
    c.active = c.flags != 0 && !c.reported;
    if (w.fiber_mode) {
      run_fibers(w, group);
    } else {
      run_loop(w, group);
    }
    c.active = false;
  }
  tls_worker = nullptr;
}

static Worker g_workers[4];  // per library; the harness serialises dispatches

// Run one dispatch; returns 0 on success, 1 with d->error set otherwise.
inline int dispatch(Dispatch* d, Body body, bool synchronises, const char* kernel,
                    const Names* names) {
  d->error[0] = '\0';
  if (d->simd_width != 32) {
    snprintf(d->error, sizeof(d->error), "the emulator runs simd-groups of 32 threads only");
    return 1;
  }
  if (uint64_t(d->threads[0]) * d->threads[1] * d->threads[2] > kMaxThreads) {
    snprintf(d->error, sizeof(d->error), "the emulator runs at most %d threads per threadgroup",
             kMaxThreads);
    return 1;
  }
  Run run;
  run.d = d;
  run.out = d;
  run.body = body;
  run.kernel = kernel;
  run.names = names;
  const uint64_t groups = uint64_t(d->groups[0]) * d->groups[1] * d->groups[2];
  const uint64_t threads = groups * d->threads[0] * d->threads[1] * d->threads[2];
  uint32_t count = d->workers < 1 ? 1 : (d->workers > 4 ? 4 : d->workers);
  if (groups < count) count = static_cast<uint32_t>(groups);
  if (!synchronises && threads < 65536) count = 1;  // thread start-up would cost more
  if (d->checks & kCheckRaces) count = count ? 1 : 0;  // shadow state follows one schedule
  if (count == 0) return 0;
  for (uint32_t i = 0; i < count; ++i) {
    g_workers[i].run = &run;
    g_workers[i].fiber_mode = synchronises;
  }
  std::vector<std::thread> helpers;
  for (uint32_t i = 1; i < count; ++i) helpers.emplace_back(work, std::ref(g_workers[i]));
  work(g_workers[0]);
  for (auto& h : helpers) h.join();
  return run.failed.load() ? 1 : 0;
}

}  // namespace emu

#pragma clang attribute pop
