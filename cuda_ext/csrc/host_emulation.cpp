// The CUDA kernels run on CPU tensors under host_emulation.h, bound like graph_attention.cpp
// (dropout seed and offset drawn from torch's CPU generator). Built by the tests only.
#include "host_emulation.h"
#include "graph_attention_kernels.cuh"
#include "graph_attention_ops.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace {

// a fresh (seed, offset) per call; the offset's high bits exercise the 64-bit counter
at::Tensor draw_cpu_rng_state(const at::Tensor& /*q*/, int64_t /*counters*/) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  auto rng = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  rng[0] = static_cast<int64_t>(impl->random64());
  rng[1] = static_cast<int64_t>(impl->random64() >> 24);
  return rng;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Graph attention CUDA kernels emulated on the CPU (tests only)";
  graph_attention_cuda::ops::define_module(m, at::kCPU, &draw_cpu_rng_state);
}
