// Context switching for the emulator's fibers (the threads of a threadgroup that synchronise):
// a few lines of assembly on x86-64 (callee-saved registers and the stack pointer; kernels never
// change the floating-point environment, so it is not saved), ucontext elsewhere. Included by
// emulator_runtime.h, which defines fiber_entry.
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__) || defined(NEEDLE_EMU_UCONTEXT)
#define NEEDLE_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace emu {

// ---- context switching -------------------------------------------------------------------

#ifndef NEEDLE_EMU_USE_UCONTEXT
extern "C" void needle_emu_switch(void** save_sp, void* load_sp);
extern "C" void needle_emu_start();
asm(R"(
  .text
  .globl needle_emu_switch
  .hidden needle_emu_switch
  .type needle_emu_switch,@function
needle_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size needle_emu_switch,.-needle_emu_switch

  .globl needle_emu_start
  .hidden needle_emu_start
  .type needle_emu_start,@function
needle_emu_start:
  movq %r12, %rdi
  andq $-16, %rsp
  callq *%r13
  ud2
  .size needle_emu_start,.-needle_emu_start
)");
#endif

struct Context {
#ifdef NEEDLE_EMU_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

inline void context_switch(Context& from, Context& to) {
#ifdef NEEDLE_EMU_USE_UCONTEXT
  swapcontext(&from.uc, &to.uc);
#else
  needle_emu_switch(&from.sp, to.sp);
#endif
}

inline void fiber_entry(void* fiber);

#ifdef NEEDLE_EMU_USE_UCONTEXT
// makecontext passes int arguments only: the fiber pointer travels as two halves.
inline void ucontext_entry(unsigned hi, unsigned lo) {
  fiber_entry(reinterpret_cast<void*>((uintptr_t(hi) << 32) | lo));
}
#endif

// Prepare `ctx` to run fiber_entry(fiber) on the stack [base, base + size) when switched to.
inline void context_init(Context& ctx, char* base, size_t size, void* fiber) {
#ifdef NEEDLE_EMU_USE_UCONTEXT
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = base;
  ctx.uc.uc_stack.ss_size = size;
  ctx.uc.uc_link = nullptr;
  const auto p = reinterpret_cast<uintptr_t>(fiber);
  makecontext(&ctx.uc, reinterpret_cast<void (*)()>(&ucontext_entry), 2,
              static_cast<unsigned>(p >> 32), static_cast<unsigned>(p & 0xffffffffu));
#else
  auto* p = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15));
  *--p = 0;                                              // alignment slot
  *--p = reinterpret_cast<uint64_t>(&needle_emu_start);  // return address of the first switch
  *--p = 0;                                              // rbp
  *--p = 0;                                              // rbx
  *--p = reinterpret_cast<uint64_t>(fiber);              // r12: argument
  *--p = reinterpret_cast<uint64_t>(&fiber_entry);       // r13: entry point
  *--p = 0;                                              // r14
  *--p = 0;                                              // r15
  ctx.sp = p;
#endif
}

}  // namespace emu
