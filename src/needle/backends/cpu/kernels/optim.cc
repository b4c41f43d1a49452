// Fused optimizer updates: adam_update and sgd_update write one parameter and its state in
// place in a single pass (numpy_ref states the formulas). An unfused Adam step is a dozen
// passes over the weights; this one reads w, g, m, v once and writes w, m, v once.
//
// The parameter and gradient have storage type S (float16/bfloat16/float32/float64); the
// state and all arithmetic use compute_t<S> (float32 for the half types), and w is rounded
// once when stored. Scalars are folded on the host in double, as needle.optim folds them.
#include "common.h"

namespace needle {
namespace {

// Around twenty flops per element (a sqrt and a division among them): threads pay off
// earlier than for a plain add.
constexpr int64_t kGrainOptim = int64_t(1) << 14;

// Adam's per-step scalars, already in the compute type.
template <class C> struct AdamScalars {
  C beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, decay;
  int decay_mode;  // 0: none, 1: L2 (g += w * decay), 2: decoupled (w *= decay)
};

template <class S>
void adam_kernel(void* w_, const void* g_, void* m_, void* v_, int64_t n,
                 const AdamScalars<compute_t<S>>& k) {
  using C = compute_t<S>;
  S* __restrict w = (S*)w_;
  const S* __restrict g = (const S*)g_;
  C* __restrict m = (C*)m_;
  C* __restrict v = (C*)v_;
  parallel_for(n, kGrainOptim, [&](int64_t lo, int64_t hi) {
    const AdamScalars<C> s = k;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      C wi = load(w[i]), gi = load(g[i]);
      if (s.decay_mode == 2) wi = wi * s.decay;
      if (s.decay_mode == 1) gi = gi + wi * s.decay;
      const C g2 = (gi * gi) * s.one_minus_beta2;
      const C mi = m[i] * s.beta1 + gi * s.one_minus_beta1;
      const C vi = v[i] * s.beta2 + g2;
      m[i] = mi;
      v[i] = vi;
      w[i] = store<S>(wi - mi / (std::sqrt(vi) + s.eps) * s.step_size);
    }
  });
}

// SGD's per-step scalars in the compute type; u is the momentum buffer (or null).
template <class C> struct SgdScalars {
  C lr, momentum, one_minus_dampening, weight_decay;
  bool has_momentum, first, nesterov, dampened;
};

template <class S>
void sgd_kernel(void* w_, const void* g_, void* u_, int64_t n, const SgdScalars<compute_t<S>>& k) {
  using C = compute_t<S>;
  S* __restrict w = (S*)w_;
  const S* __restrict g = (const S*)g_;
  C* __restrict u = (C*)u_;
  parallel_for(n, kGrainOptim, [&](int64_t lo, int64_t hi) {
    const SgdScalars<C> s = k;
    auto decayed = [&](int64_t i, C wi) {
      const C gi = load(g[i]);
      return s.weight_decay != C(0) ? gi + wi * s.weight_decay : gi;
    };
    // Without momentum u is null: a loop of its own, since a vectorized loop may load what
    // a branch in it would have skipped.
    if (!s.has_momentum) {
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) {
        const C wi = load(w[i]);
        w[i] = store<S>(wi - decayed(i, wi) * s.lr);
      }
      return;
    }
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const C wi = load(w[i]), gi = decayed(i, wi);
      const C ui = s.first ? gi
                           : u[i] * s.momentum + (s.dampened ? gi * s.one_minus_dampening : gi);
      u[i] = ui;
      w[i] = store<S>(wi - (s.nesterov ? gi + ui * s.momentum : ui) * s.lr);
    }
  });
}

using AdamFn = void (*)(void*, const void*, void*, void*, int64_t, const void*);
using SgdFn = void (*)(void*, const void*, void*, int64_t, const void*);

template <class S>
void adam_entry(void* w, const void* g, void* m, void* v, int64_t n, const void* k) {
  adam_kernel<S>(w, g, m, v, n, *(const AdamScalars<compute_t<S>>*)k);
}
template <class S> void sgd_entry(void* w, const void* g, void* u, int64_t n, const void* k) {
  sgd_kernel<S>(w, g, u, n, *(const SgdScalars<compute_t<S>>*)k);
}

const KernelTable<AdamFn> kAdam("adam_update", [](auto tag) -> AdamFn {
  using S = typename decltype(tag)::type;
  if constexpr (is_float_storage_v<S>) return &adam_entry<S>;
  else return nullptr;
});
const KernelTable<SgdFn> kSgd("sgd_update", [](auto tag) -> SgdFn {
  using S = typename decltype(tag)::type;
  if constexpr (is_float_storage_v<S>) return &sgd_entry<S>;
  else return nullptr;
});

DType state_dtype(DType dt) { return dt == DType::f16 || dt == DType::bf16 ? DType::f32 : dt; }

// param and grad: one dtype and size; each state buffer: the state dtype, the same size.
void check_operands(const Array& param, const Array& grad, const Array* state[], int n_state,
                    const char* fn) {
  check_same_dtype(param, grad, fn);
  check_size(grad, param.size, fn, "grad");
  for (int i = 0; i < n_state; ++i) {
    check_dtype(*state[i], state_dtype(param.dtype), fn, "state buffer");
    check_size(*state[i], param.size, fn, "state buffer");
  }
}

}  // namespace

void bind_optim(nb::module_& m) {
  m.def("adam_update", [](Array& param, const Array& grad, Array& mom, Array& var, double lr,
                          double beta1, double beta2, double eps, double weight_decay,
                          int64_t step, bool decoupled) {
    const Array* state[] = {&mom, &var};
    check_operands(param, grad, state, 2, "adam_update");
    const AdamFn fn = kAdam[param.dtype];
    const double bc1 = 1 - std::pow(beta1, (double)step);
    const double root_bc2 = std::sqrt(1 - std::pow(beta2, (double)step));
    const int mode = decoupled ? 2 : (weight_decay != 0 ? 1 : 0);
    const double decay = decoupled ? 1 - lr * weight_decay : weight_decay;
    auto run = [&](auto scalars) {
      without_gil([&] { fn(param.data, grad.data, mom.data, var.data, param.size, &scalars); });
    };
    auto fold = [&](auto zero) {
      using C = decltype(zero);
      return AdamScalars<C>{(C)beta1, (C)(1 - beta1), (C)beta2, (C)(1 - beta2),
                            (C)(eps * root_bc2), (C)(lr * root_bc2 / bc1), (C)decay, mode};
    };
    if (param.dtype == DType::f64) run(fold(0.0));
    else run(fold(0.0f));
  }, nb::arg("param"), nb::arg("grad"), nb::arg("m"), nb::arg("v"), nb::arg("lr"),
     nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"),
     nb::arg("step"), nb::arg("decoupled"),
     "One Adam step of param (in place, with its moments m and v); see numpy_ref.");

  m.def("sgd_update", [](Array& param, const Array& grad, Array* buf, double lr,
                         double momentum, double dampening, double weight_decay, bool nesterov,
                         bool first) {
    if ((buf == nullptr) != (momentum == 0))
      raise("NeedleError", "sgd_update needs a momentum buffer exactly when momentum != 0");
    const Array* state[] = {buf};
    check_operands(param, grad, state, buf ? 1 : 0, "sgd_update");
    const SgdFn fn = kSgd[param.dtype];
    void* u = buf ? buf->data : nullptr;
    auto run = [&](auto scalars) {
      without_gil([&] { fn(param.data, grad.data, u, param.size, &scalars); });
    };
    auto fold = [&](auto zero) {
      using C = decltype(zero);
      return SgdScalars<C>{(C)lr, (C)momentum, (C)(1 - dampening), (C)weight_decay,
                           buf != nullptr, first, nesterov, dampening != 0};
    };
    if (param.dtype == DType::f64) run(fold(0.0));
    else run(fold(0.0f));
  }, nb::arg("param"), nb::arg("grad"), nb::arg("momentum_buf").none(), nb::arg("lr"),
     nb::arg("momentum"), nb::arg("dampening"), nb::arg("weight_decay"), nb::arg("nesterov"),
     nb::arg("first"), "One SGD step of param (in place, with its momentum buffer or None).");
}

}  // namespace needle
