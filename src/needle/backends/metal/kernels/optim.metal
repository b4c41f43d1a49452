// Fused optimizer updates (docs/kernels.md, family optim): one grid-stride pass writes a
// parameter and its state in place, where the unfused step takes a dozen dispatches per
// parameter. numpy_ref.adam_update / sgd_update state the formulas; the host folds the
// per-step scalars (bias corrections, 1 - beta, ...) and passes them as float.
//
// param and grad have storage type T; the state (m, v, the momentum buffer) and the
// arithmetic are float, and param is rounded once when stored.
#include <metal_stdlib>
using namespace metal;

template <class S>
struct AdamParams {
  long n;
  long decay_mode;  // 0: none, 1: L2 (g += w * decay), 2: decoupled (w *= decay)
  S beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, decay;
};

constant long kMomentum = 1, kFirst = 2, kNesterov = 4, kDampened = 8;

template <class S>
struct SgdParams {
  long n;
  long flags;  // kMomentum...; without kMomentum the buffer slot holds any buffer, untouched
  S lr, momentum, one_minus_dampening, weight_decay;
};

template <class T>
kernel void adam_update(device T* w [[buffer(0)]], device const T* g [[buffer(1)]],
                        device float* m [[buffer(2)]], device float* v [[buffer(3)]],
                        constant AdamParams<float>& p [[buffer(4)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) {
    float wi = load(w[i]), gi = load(g[i]);
    if (p.decay_mode == 2) {
      wi = wi * p.decay;
    } else if (p.decay_mode == 1) {
      gi = gi + wi * p.decay;
    }
    const float g2 = (gi * gi) * p.one_minus_beta2;
    const float mi = m[i] * p.beta1 + gi * p.one_minus_beta1;
    const float vi = v[i] * p.beta2 + g2;
    m[i] = mi;
    v[i] = vi;
    w[i] = store<T>(wi - mi / (sqrt(vi) + p.eps) * p.step_size);
  }
}

template <class T>
kernel void sgd_update(device T* w [[buffer(0)]], device const T* g [[buffer(1)]],
                       device float* u [[buffer(2)]], constant SgdParams<float>& p [[buffer(3)]],
                       GRID_ARGS) {
  GRID_STRIDE(i, p.n) {
    const float wi = load(w[i]);
    float gi = load(g[i]);
    if (p.weight_decay != 0.0f) gi = gi + wi * p.weight_decay;
    if ((p.flags & kMomentum) != 0) {
      float ui = gi;
      if ((p.flags & kFirst) == 0) {
        ui = u[i] * p.momentum + ((p.flags & kDampened) != 0 ? gi * p.one_minus_dampening : gi);
      }
      u[i] = ui;
      gi = (p.flags & kNesterov) != 0 ? gi + ui * p.momentum : ui;
    }
    w[i] = store<T>(wi - gi * p.lr);
  }
}

#define OPTIM(unused, SFX, T)                                   \
  INSTANTIATE(NAME(adam_update_##SFX), adam_update<T>)          \
  INSTANTIATE(NAME(sgd_update_##SFX), sgd_update<T>)

FLOATS(OPTIM, _)
