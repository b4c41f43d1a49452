// Fused optimizer updates (docs/kernels.md, family optim): one grid-stride pass writes a
// parameter and its state in place, where the unfused step takes a dozen launches per
// parameter. numpy_ref.adam_update / sgd_update state the formulas; the host folds the
// per-step scalars (bias corrections, 1 - beta, ...) in double and passes them as S.
//
// param and grad have storage type T; the state (m, v, the momentum buffer) and the
// arithmetic use Acc<T> (float for half and bfloat16), and param is rounded once when stored.
#include "common.cuh"

template <class S> struct AdamParams {
  i64 n;
  i64 decay_mode;  // 0: none, 1: L2 (g += w * decay), 2: decoupled (w *= decay)
  S beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, decay;
};

enum SgdFlags { kMomentum = 1, kFirst = 2, kNesterov = 4, kDampened = 8 };

template <class S> struct SgdParams {
  i64 n;
  i64 flags;  // SgdFlags; without kMomentum the buffer slot holds any buffer, never touched
  S lr, momentum, one_minus_dampening, weight_decay;
};

// Products and sums rounded one at a time (no fused multiply-add): NVCC contracts a*b + c
// into an FMA as each kernel's code happens to allow, so the same formula could round
// differently in two kernels. Rounded separately, the update is numpy_ref's, operation for
// operation, and adam_update_* and adam_update_many_* agree bit for bit.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// One element's Adam step (numpy_ref.adam_update's order of operations).
template <class T, class C>
__device__ __forceinline__ void adam_one(T& w, const T& g, C& m, C& v, const AdamParams<C>& p) {
  C wi = load(w), gi = load(g);
  if (p.decay_mode == 2) wi = mul_rn(wi, p.decay);
  else if (p.decay_mode == 1) gi = add_rn(gi, mul_rn(wi, p.decay));
  const C g2 = mul_rn(mul_rn(gi, gi), p.one_minus_beta2);
  const C mi = add_rn(mul_rn(m, p.beta1), mul_rn(gi, p.one_minus_beta1));
  const C vi = add_rn(mul_rn(v, p.beta2), g2);
  m = mi;
  v = vi;
  w = store<T>(wi - mul_rn(mi / add_rn(m_sqrt(vi), p.eps), p.step_size));
}

template <class T>
__device__ __forceinline__ void adam(T* __restrict__ w, const T* __restrict__ g,
                                     typename Acc<T>::type* __restrict__ m,
                                     typename Acc<T>::type* __restrict__ v,
                                     const AdamParams<typename Acc<T>::type>& p) {
  for (i64 i = global_thread(); i < p.n; i += grid_threads()) adam_one(w[i], g[i], m[i], v[i], p);
}

// Many parameters' Adam steps in one launch (adam_update_many_*): the optimizer's step is
// ~100 launches for a small transformer, most of them too short to fill the GPU. The
// tensors' addresses travel in the params struct (by value: a CUDA graph keeps them, no
// table to upload); each tensor gets ceil(n / ADAM_MANY_BLOCK) groups, numbered from
// first_group[t], and a group finds its tensor by a binary search over those numbers.
constexpr int ADAM_MANY = 16, ADAM_MANY_THREADS = 256, ADAM_MANY_EACH = 8;
constexpr int ADAM_MANY_BLOCK = ADAM_MANY_THREADS * ADAM_MANY_EACH;

template <class T> struct AdamManyParams {
  AdamParams<typename Acc<T>::type> step;  // step.n unused: each tensor's own n below
  i64 count;
  T* w[ADAM_MANY];
  const T* g[ADAM_MANY];
  typename Acc<T>::type* m[ADAM_MANY];
  typename Acc<T>::type* v[ADAM_MANY];
  i64 n[ADAM_MANY];
  i64 first_group[ADAM_MANY + 1];  // [count]: the total
};

template <class T>
__device__ __forceinline__ void adam_many(const AdamManyParams<T>& p) {
  const i64 group = blockIdx.x;
  int lo = 0, hi = (int)p.count - 1;  // the last tensor whose first group is <= group
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.first_group[mid] <= group) lo = mid;
    else hi = mid - 1;
  }
  const i64 n = p.n[lo], base = (group - p.first_group[lo]) * ADAM_MANY_BLOCK;
  T* __restrict__ w = p.w[lo];
  const T* __restrict__ g = p.g[lo];
  typename Acc<T>::type* __restrict__ m = p.m[lo];
  typename Acc<T>::type* __restrict__ v = p.v[lo];
#pragma unroll
  for (int j = 0; j < ADAM_MANY_EACH; j++) {
    const i64 i = base + j * ADAM_MANY_THREADS + threadIdx.x;
    if (i < n) adam_one(w[i], g[i], m[i], v[i], p.step);
  }
}

template <class T>
__device__ __forceinline__ void sgd(T* __restrict__ w, const T* __restrict__ g,
                                    typename Acc<T>::type* __restrict__ u,
                                    const SgdParams<typename Acc<T>::type>& p) {
  typedef typename Acc<T>::type C;
  for (i64 i = global_thread(); i < p.n; i += grid_threads()) {
    const C wi = load(w[i]);
    C gi = load(g[i]);
    if (p.weight_decay != C(0)) gi = gi + wi * p.weight_decay;
    if (p.flags & kMomentum) {
      C ui = gi;
      if (!(p.flags & kFirst))
        ui = u[i] * p.momentum + ((p.flags & kDampened) ? gi * p.one_minus_dampening : gi);
      u[i] = ui;
      gi = (p.flags & kNesterov) ? gi + ui * p.momentum : ui;
    }
    w[i] = store<T>(wi - gi * p.lr);
  }
}

#define OPTIM(SFX, T)                                                                          \
  extern "C" __global__ void adam_update_##SFX(T* __restrict__ w, const T* __restrict__ g,     \
                                               Acc<T>::type* __restrict__ m,                   \
                                               Acc<T>::type* __restrict__ v,                   \
                                               AdamParams<Acc<T>::type> p) {                   \
    pdl_entry();                                                                               \
    adam(w, g, m, v, p);                                                                       \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(ADAM_MANY_THREADS)                              \
      adam_update_many_##SFX(AdamManyParams<T> p) {                                            \
    pdl_entry();                                                                               \
    adam_many(p);                                                                              \
  }                                                                                            \
  extern "C" __global__ void sgd_update_##SFX(T* __restrict__ w, const T* __restrict__ g,      \
                                              Acc<T>::type* __restrict__ u,                    \
                                              SgdParams<Acc<T>::type> p) {                     \
    pdl_entry();                                                                               \
    sgd(w, g, u, p);                                                                           \
  }

ONLY(f16, OPTIM(f16, half_t))
ONLY(bf16, OPTIM(bf16, bf16_t))
ONLY(f32, OPTIM(f32, float))
ONLY(f64, OPTIM(f64, double))
