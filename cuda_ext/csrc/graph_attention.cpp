// Python binding of the fused graph attention kernels on CUDA: the operations of
// graph_attention_ops.h with dropout (seed, offset) drawn from torch's CUDA generator.
#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <mutex>

#include "graph_attention_ops.h"

namespace graph_attention_cuda {
namespace {

// (seed, offset) for this call's dropout, drawn from torch's CUDA generator so that
// torch.cuda.manual_seed makes runs reproducible. Returned as int64 bit patterns.
at::Tensor draw_cuda_rng_state(const at::Tensor& q, int64_t counters) {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(q.get_device()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(static_cast<uint64_t>((counters + 3) / 4 * 4));
  }
  TORCH_CHECK(!state.captured_,
              "graph_attention_cuda: dropout inside CUDA graph capture is not supported");
  auto rng = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  rng[0] = static_cast<int64_t>(state.seed_.val);
  rng[1] = static_cast<int64_t>(state.offset_.val);
  return rng;
}

}  // namespace
}  // namespace graph_attention_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused sparse graph attention (BPT / SegTree) CUDA kernels";
  graph_attention_cuda::ops::define_module(m, at::kCUDA,
                                           &graph_attention_cuda::draw_cuda_rng_state);
}
