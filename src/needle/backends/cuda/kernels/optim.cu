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

template <class T>
__device__ __forceinline__ void adam(T* __restrict__ w, const T* __restrict__ g,
                                     typename Acc<T>::type* __restrict__ m,
                                     typename Acc<T>::type* __restrict__ v,
                                     const AdamParams<typename Acc<T>::type>& p) {
  typedef typename Acc<T>::type C;
  for (i64 i = global_thread(); i < p.n; i += grid_threads()) {
    C wi = load(w[i]), gi = load(g[i]);
    if (p.decay_mode == 2) wi = wi * p.decay;
    else if (p.decay_mode == 1) gi = gi + wi * p.decay;
    const C g2 = (gi * gi) * p.one_minus_beta2;
    const C mi = m[i] * p.beta1 + gi * p.one_minus_beta1;
    const C vi = v[i] * p.beta2 + g2;
    m[i] = mi;
    v[i] = vi;
    w[i] = store<T>(wi - mi / (m_sqrt(vi) + p.eps) * p.step_size);
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
