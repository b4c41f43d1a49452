// The emulator's memory checks: out-of-bounds access (like compute-sanitizer's memcheck) and
// data races between the threads of a dispatch (like its racecheck).
//
// Every load and store of the kernels' code reaches this file: the harness compiles kernels
// with clang's -fsanitize-coverage=trace-loads,trace-stores, which calls
// __sanitizer_cov_load{1,2,4,8,16} / __sanitizer_cov_store{...} with the address before each
// access that survived optimisation (registers and locals never reach memory, so they cost
// nothing). The hooks ignore addresses outside kernel memory (stacks, the emulator's own state).
//
// Bounds. Each bound buffer knows its own byte length (the backend's buffer, not the pool block
// holding it) and lies inside a larger allocation with guard bands (the fake's buffers are
// mapped with 256 KiB of unused address space on both sides). An access inside an allocation but
// outside every bound range that covers it is out of bounds; the hook throws before it happens,
// so a bad write never corrupts a neighbour. Threadgroup memory (dynamic blocks and variables
// declared in kernels) lives in one arena per worker with red zones between blocks.
//
// Races. Shadow state per 4-byte word remembers the last writer and two readers of the current
// barrier interval: (thread, interval clock, simd-group clock, bytes touched). Two accesses to
// the same bytes by different threads, one of them a write, race unless a barrier covering that
// memory (threadgroup_barrier with mem_threadgroup/mem_device, or simdgroup_barrier for two
// threads of one simd-group) released in between. Threads of different threadgroups are never
// ordered within a dispatch, so a device word written by one threadgroup and touched by another
// is a race. Atomic operations are exempt. Simdgroup-matrix loads and stores are each lane's own
// accesses (every lane holds a fragment of the matrix). Race checking needs
// one worker per dispatch (threadgroups in order), which dispatch() arranges.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace emu {

enum : uint32_t { kCheckBounds = 1, kCheckRaces = 2 };
enum Space : int { kThreadgroupSpace = 0, kDeviceSpace = 1 };
constexpr uint32_t kMemDevice = 1, kMemThreadgroup = 2;  // msl::metal::mem_flags bits
constexpr size_t kArenaBytes = 192 * 1024;  // threadgroup memory of one worker, red zones included
constexpr size_t kRedzone = 1024;
constexpr size_t kPageWords = 1024;

struct OutOfBounds {};  // thrown by the access hook so that the access itself never happens

struct Access {
  uint32_t clock = 0, sg_clock = 0, actor = 0;
  uint8_t mask = 0, sg = 0, valid = 0, pad = 0;
};

struct Shadow {
  Access write, read[2];
};

struct Block {  // a bound buffer, threadgroup block or threadgroup variable
  uintptr_t base = 0, end = 0;  // the bytes the kernel may touch
  uintptr_t lo = 0, hi = 0;     // the allocation around them (guard bands / red zones)
  int alloc = 0;                // device: index of the allocation's shadow
  char what[96] = {};
};

struct Checker {
  uint32_t flags = 0;
  bool active = false;  // a kernel body runs on this worker
  bool reported = false;
  int atomic = 0;       // > 0 inside an atomic operation
  const char* kernel = "";
  uint32_t groups[3] = {1, 1, 1}, tg_threads = 1;
  // who runs now
  uint32_t group_linear = 0, local = 0;
  // device memory of this dispatch
  int n_dev = 0;
  Block dev[31];
  std::vector<std::vector<Shadow*>> pages;  // per allocation
  std::vector<std::unique_ptr<Shadow[]>> page_store;
  size_t pages_used = 0;
  // threadgroup arena
  unsigned char* arena = nullptr;
  size_t arena_used = 0, dynamic_end = 0, tg_bytes = 0;
  int n_tg = 0;
  Block tg[64];
  int tg_ids[64] = {};
  std::unique_ptr<Shadow[]> tg_shadow;
  // clocks: one counter; a space's clock moves at each barrier releasing it
  uint32_t clock = 1, group_start = 1;
  uint32_t space_clock[2] = {1, 1};
  uint32_t sg_clock[32][2] = {};
  // where errors go
  void (*fail)(void* ctx, const char* message) = nullptr;
  void* fail_ctx = nullptr;

  void report(const char* message) {
    reported = true;
    if (fail) fail(fail_ctx, message);
  }

  // ---- per dispatch / threadgroup -----------------------------------------------------------

  void reset_device() {
    n_dev = 0;
    for (auto& p : pages) p.clear();
    pages_used = 0;
  }

  Shadow* page(int alloc, size_t index) {
    auto& table = pages[alloc];
    if (table.size() <= index) table.resize(index + 1, nullptr);
    Shadow*& p = table[index];
    if (p == nullptr) {
      if (pages_used == page_store.size()) page_store.emplace_back(new Shadow[kPageWords]);
      p = page_store[pages_used++].get();
      std::memset(static_cast<void*>(p), 0, sizeof(Shadow) * kPageWords);
    }
    return p;
  }

  void start_group(uint32_t linear) {
    group_linear = linear;
    group_start = ++clock;
    space_clock[0] = space_clock[1] = group_start;
    for (auto& s : sg_clock) s[0] = s[1] = group_start;
  }

  void barrier(uint32_t mem) {  // a threadgroup_barrier released
    ++clock;
    if (mem & kMemThreadgroup) space_clock[kThreadgroupSpace] = clock;
    if (mem & kMemDevice) space_clock[kDeviceSpace] = clock;
  }

  void simd_barrier(uint32_t sg, uint32_t mem) {  // a simdgroup_barrier released
    ++clock;
    if (mem & kMemThreadgroup) sg_clock[sg][kThreadgroupSpace] = clock;
    if (mem & kMemDevice) sg_clock[sg][kDeviceSpace] = clock;
  }

  // ---- describing threads and places ---------------------------------------------------------

  void describe_actor(char* out, size_t n, uint32_t actor) const {
    const uint32_t t = actor % tg_threads, g = actor / tg_threads;
    const uint32_t gx = g % groups[0], gy = (g / groups[0]) % groups[1],
                   gz = g / (groups[0] * groups[1]);
    snprintf(out, n, "thread %u (simd-group %u) of threadgroup (%u,%u,%u)", t, t / 32, gx, gy,
             gz);
  }

  uint32_t actor_now() const {
    return group_linear * tg_threads + local;
  }

  // ---- the checks ----------------------------------------------------------------------------

  bool ordered(const Access& prev, int space, uint32_t actor, uint32_t sg) const {
    if (prev.clock < group_start) return space == kThreadgroupSpace;  // earlier threadgroup
    if (prev.actor == actor) return true;
    if (prev.clock < space_clock[space]) return true;  // a threadgroup_barrier since
    return prev.sg == sg && prev.sg_clock < sg_clock[sg][space];  // a simdgroup_barrier since
  }

  void race(const Access& prev, bool prev_write, bool write, int space, const Block& b,
            uintptr_t word, uint32_t actor) {
    char first[128], second[128], msg[700];
    describe_actor(first, sizeof first, prev.actor);
    describe_actor(second, sizeof second, actor);
    snprintf(msg, sizeof msg,
             "kernel %s: data race on %s at byte offset %llu (address 0x%llx): %s %s it and %s "
             "%s it with no %s between them (racecheck)",
             kernel, b.what, (unsigned long long)(word - b.base), (unsigned long long)word, first,
             prev_write ? "wrote" : "read", second, write ? "wrote" : "read",
             space == kThreadgroupSpace ? "threadgroup_barrier(mem_threadgroup) (or "
                                          "simdgroup_barrier within one simd-group)"
                                        : "ordering: device memory is ordered only by a barrier "
                                          "with mem_device inside one threadgroup, never across "
                                          "threadgroups");
    report(msg);
  }

  void shadow_word(Shadow& s, uint8_t mask, bool write, int space, const Block& b,
                   uintptr_t word) {
    const uint32_t actor = actor_now();
    const uint32_t sg = local / 32u;
    if (s.write.valid && (s.write.mask & mask) && !ordered(s.write, space, actor, sg))
      return race(s.write, true, write, space, b, word, actor);
    if (write) {
      for (const Access& r : s.read)
        if (r.valid && (r.mask & mask) && !ordered(r, space, actor, sg))
          return race(r, false, true, space, b, word, actor);
    }
    Access now;
    now.clock = clock;
    now.sg_clock = sg_clock[sg][space];
    now.actor = actor;
    now.mask = mask;
    now.sg = uint8_t(sg);
    now.valid = 1;
    if (write) {
      s.write = now;
    } else if (!(s.read[0].valid && s.read[0].actor == actor && s.read[0].clock == clock)) {
      s.read[1] = s.read[0];  // keep the two latest readers
      s.read[0] = now;
    }
  }

  void check_races(Shadow* (Checker::*lookup)(const Block&, uintptr_t), const Block& b,
                   uintptr_t a, uint32_t n, bool write, int space) {
    const uintptr_t last = a + n - 1;
    for (uintptr_t word = a & ~uintptr_t(3); word <= last; word += 4) {
      uint8_t mask = 0;
      for (uint32_t i = 0; i < 4; ++i)
        if (word + i >= a && word + i <= last) mask |= uint8_t(1u << i);
      shadow_word(*(this->*lookup)(b, word), mask, write, space, b, word);
      if (reported) return;
    }
  }

  Shadow* tg_lookup(const Block&, uintptr_t word) {
    return &tg_shadow[(word - reinterpret_cast<uintptr_t>(arena)) / 4];
  }

  Shadow* dev_lookup(const Block& b, uintptr_t word) {
    const size_t w = (word - b.lo) / 4;
    return page(b.alloc, w / kPageWords) + w % kPageWords;
  }

  [[noreturn]] void out_of_bounds(const Block& b, uintptr_t a, uint32_t n, bool write) {
    char who[128], msg[600];
    describe_actor(who, sizeof who, actor_now());
    const long long offset = (long long)(a - b.base);
    snprintf(msg, sizeof msg,
             "kernel %s: out-of-bounds %s of %u bytes at byte offset %lld (index %lld of %u-byte "
             "elements) of %s, which has %llu bytes, by %s (memcheck)",
             kernel, write ? "write" : "read", n, offset, offset / (long long)n, n, b.what,
             (unsigned long long)(b.end - b.base), who);
    report(msg);
    active = false;  // nothing more to check in this dispatch
    throw OutOfBounds{};
  }

  // Called by the hooks; checking is off while it runs (the checker's own std:: containers
  // may be instrumented) and after the first error.
  void hook(uintptr_t a, uint32_t n, bool write) {
    active = false;
    access(a, n, write);  // throws OutOfBounds, leaving checking off
    active = !reported;
  }

  void access(uintptr_t a, uint32_t n, bool write) {
    const uintptr_t arena_lo = reinterpret_cast<uintptr_t>(arena);
    if (a - arena_lo < kArenaBytes) {
      const Block* near = nullptr;
      for (int i = 0; i < n_tg; ++i) {
        const Block& b = tg[i];
        if (a >= b.base && a + n <= b.end) {
          if ((flags & kCheckRaces) && !atomic)
            check_races(&Checker::tg_lookup, b, a, n, write, kThreadgroupSpace);
          return;
        }
        if (a >= b.lo && a < b.hi) near = &b;
      }
      if (flags & kCheckBounds) {
        if (near == nullptr && n_tg) near = &tg[n_tg - 1];
        if (near) out_of_bounds(*near, a, n, write);
      }
      return;
    }
    const Block* near = nullptr;
    for (int i = 0; i < n_dev; ++i) {
      const Block& b = dev[i];
      if (a >= b.base && a + n <= b.end) {
        if ((flags & kCheckRaces) && !atomic)
          check_races(&Checker::dev_lookup, b, a, n, write, kDeviceSpace);
        return;
      }
      if (a >= b.lo && a < b.hi) near = &b;
    }
    if (near && (flags & kCheckBounds)) out_of_bounds(*near, a, n, write);
  }
};

}  // namespace emu
