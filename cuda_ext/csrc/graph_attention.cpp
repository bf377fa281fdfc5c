// Python binding of the fused graph attention kernels on CUDA: the operations of
// graph_attention_ops.h. The dropout (seed, offset) is an input tensor on the GPU, drawn by
// the caller from torch's generator of that device (cuda_backend.py).
#include "graph_attention_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused sparse graph attention (BPT / SegTree) CUDA kernels";
  graph_attention_cuda::ops::define_module(m, at::kCUDA);
}
