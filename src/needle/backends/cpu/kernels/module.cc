// The extension module needle.backends.cpu._cpu: the array API (design §3) for the host CPU.
// Each kernel family registers its functions; this file only assembles the module.
#include "common.h"

namespace needle {
void bind_attention(nb::module_& m);  // attention.cc
void bind_decode(nb::module_& m);  // decode.cc
void bind_indexing(nb::module_& m);  // indexing.cc
void bind_optim(nb::module_& m);  // optim.cc
void bind_paged(nb::module_& m);  // paged.cc
void bind_quant(nb::module_& m);  // quant.cc
}

NB_MODULE(_cpu, m) {
  m.doc() = "needle's native CPU backend: C++17 kernels, OpenMP across cores.";
  m.attr("name") = "cpu";
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
  m.def("num_threads", &needle::max_threads, "Threads the kernels use (OMP_NUM_THREADS).");
  needle::bind_memory(m);
  needle::bind_elementwise(m);
  needle::bind_reduce(m);
  needle::bind_matmul(m);
  needle::bind_nn(m);
  needle::bind_indexing(m);
  needle::bind_attention(m);
  needle::bind_decode(m);
  needle::bind_optim(m);
  needle::bind_paged(m);
  needle::bind_quant(m);
}
