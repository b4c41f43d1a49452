// Memory of a dispatch as the emulator's checks see it (emulator_checks.h): the threadgroup
// arena with red zones, `threadgroup` variables declared in kernels (tg_static), the bound
// device buffers, and the access hooks every kernel load and store calls. Included by
// emulator_runtime.h after Worker and Run.
#pragma once

namespace emu {

inline void run_failed(void* run, const char* message) { static_cast<Run*>(run)->fail(message); }

// Threadgroup memory of a worker: dynamic blocks first, then variables declared in kernels as
// they are first reached (tg_static), each followed by a red zone, in one arena filled with
// 0xff so that reading before writing gives NaN / -1 rather than plausible zeros.
inline bool prepare_threadgroup_memory(Worker& w) {
  Checker& c = w.check;
  if (c.arena == nullptr) {
    void* mem = mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) return false;
    c.arena = static_cast<unsigned char*>(mem);
    c.tg_shadow.reset(new Shadow[kArenaBytes / 4]);
  }
  const Dispatch* d = w.run->d;
  c.n_tg = 0;
  c.arena_used = kRedzone;
  c.tg_bytes = 0;
  for (int i = 0; i < kMaxBindings; ++i) {
    w.tg_ptrs[i] = nullptr;
    if (!d->tg_lengths[i]) continue;
    const size_t len = d->tg_lengths[i];
    if (c.arena_used + len + kRedzone > kArenaBytes || c.n_tg == 64) return false;
    Block& b = c.tg[c.n_tg];
    c.tg_ids[c.n_tg++] = -1;
    b.base = b.lo = reinterpret_cast<uintptr_t>(c.arena) + c.arena_used;
    b.end = b.base + len;
    b.hi = b.end + kRedzone;
    const char* name = w.run->names ? w.run->names->threadgroup[i] : nullptr;
    snprintf(b.what, sizeof b.what, "threadgroup memory [[threadgroup(%d)]] '%s'", i,
             name ? name : "?");
    w.tg_ptrs[i] = c.arena + c.arena_used;
    c.arena_used = (c.arena_used + len + kRedzone + 15) & ~size_t(15);
    c.tg_bytes += len;
  }
  std::memset(c.arena, 0xff, c.arena_used);
  c.dynamic_end = c.arena_used;
  return true;
}

// Storage for `threadgroup T name[N];` declared in a kernel: shared by the threadgroup's
// threads, the same block for every threadgroup a worker runs in one dispatch.
inline void* tg_static(int id, size_t size, size_t align, const char* name) {
  Worker* w = tls_worker;
  if (w == nullptr) {  // compiled but not dispatched (never happens in a dispatch)
    static unsigned char spare[64 * 1024];
    return spare;
  }
  Checker& c = w->check;
  for (int i = 0; i < c.n_tg; ++i)
    if (c.tg_ids[i] == id) return reinterpret_cast<void*>(c.tg[i].base);
  size_t at = (c.arena_used + align - 1) / align * align;
  if (at + size + kRedzone > kArenaBytes || c.n_tg == 64) {
    w->run->fail("the emulator ran out of threadgroup memory for variables declared in the "
                 "kernel");
    throw OutOfBounds{};
  }
  Block& b = c.tg[c.n_tg];
  c.tg_ids[c.n_tg++] = id;
  b.base = b.lo = reinterpret_cast<uintptr_t>(c.arena) + at;
  b.end = b.base + size;
  b.hi = b.end + kRedzone;
  snprintf(b.what, sizeof b.what, "threadgroup variable '%s'", name);
  std::memset(c.arena + at, 0xff, size);
  c.arena_used = at + size + kRedzone;
  c.tg_bytes += size;
  if (c.tg_bytes > 32 * 1024) {
    char msg[256];
    snprintf(msg, sizeof msg, "kernel %s uses %zu bytes of threadgroup memory; Metal allows "
             "32768", w->run->kernel, c.tg_bytes);
    w->run->fail(msg);
    throw OutOfBounds{};
  }
  return c.arena + at;
}

inline void prepare_device_memory(Worker& w) {
  Checker& c = w.check;
  const Dispatch* d = w.run->d;
  c.reset_device();
  uint64_t allocs[kMaxBindings];
  int n_allocs = 0;
  for (int i = 0; i < kMaxBindings; ++i) {
    if (!d->buffers[i] || !d->extent_hi[i]) continue;
    Block& b = c.dev[c.n_dev++];
    b.base = reinterpret_cast<uintptr_t>(d->buffers[i]);
    b.end = b.base + d->lengths[i];
    b.lo = d->extent_lo[i];
    b.hi = d->extent_hi[i];
    b.alloc = -1;
    for (int a = 0; a < n_allocs; ++a)
      if (allocs[a] == b.lo) b.alloc = a;
    if (b.alloc < 0) {
      b.alloc = n_allocs;
      allocs[n_allocs++] = b.lo;
    }
    const char* name = w.run->names ? w.run->names->buffers[i] : nullptr;
    snprintf(b.what, sizeof b.what, "buffer [[buffer(%d)]] '%s'", i, name ? name : "?");
  }
  if (c.pages.size() < size_t(n_allocs)) c.pages.resize(n_allocs);
}

}  // namespace emu

// ---- the access hooks (see emulator_checks.h) ----------------------------------------------

#define NEEDLE_EMU_HOOK(N, T)                                                             \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("coverage"))) void           \
      __sanitizer_cov_load##N(T* p) {                                                     \
    emu::Worker* w = emu::tls_worker;                                                     \
    if (w != nullptr && w->check.active) w->check.hook(uintptr_t(p), N, false);           \
  }                                                                                       \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("coverage"))) void           \
      __sanitizer_cov_store##N(T* p) {                                                    \
    emu::Worker* w = emu::tls_worker;                                                     \
    if (w != nullptr && w->check.active) w->check.hook(uintptr_t(p), N, true);            \
  }
NEEDLE_EMU_HOOK(1, uint8_t)
NEEDLE_EMU_HOOK(2, uint16_t)
NEEDLE_EMU_HOOK(4, uint32_t)
NEEDLE_EMU_HOOK(8, uint64_t)
NEEDLE_EMU_HOOK(16, __int128)
#undef NEEDLE_EMU_HOOK
