// The CUDA kernels run on CPU tensors under host_emulation.h, bound like graph_attention.cpp,
// plus the bare launchers (no input checks, outputs allocated by the caller) so that tests
// can run the kernels over tensors too large to fill. Built by the tests only.
#include "host_emulation.h"
#include "graph_attention_kernels.cuh"
#include "graph_attention_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using graph_attention_cuda::WorkSchedule;
  m.doc() = "Graph attention CUDA kernels emulated on the CPU (tests only)";
  graph_attention_cuda::ops::define_module(m, at::kCPU);
  m.def("launch_forward",
        [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const c10::optional<at::Tensor>& rel_key, const at::Tensor& indices,
           const at::Tensor& edge_type, const at::Tensor& q_pieces, const at::Tensor& q_merges,
           int64_t q_num_slots, const c10::optional<at::Tensor>& key_padding_mask,
           double scale, double dropout_p, const c10::optional<at::Tensor>& rng, at::Tensor out,
           at::Tensor lse) {
          graph_attention_cuda::launch_forward(q, k, v, rel_key, indices, edge_type,
                                               WorkSchedule{q_pieces, q_merges, q_num_slots},
                                               key_padding_mask, scale, dropout_p, rng, out, lse);
        });
  m.def("launch_backward",
        [](const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
           const at::Tensor& v, const c10::optional<at::Tensor>& rel_key, const at::Tensor& lse,
           const at::Tensor& delta, const at::Tensor& indices, const at::Tensor& edge_type,
           const at::Tensor& q_pieces, const at::Tensor& q_merges, int64_t q_num_slots,
           const at::Tensor& t_query, const at::Tensor& t_edge, const at::Tensor& k_pieces,
           const at::Tensor& k_merges, int64_t k_num_slots,
           const c10::optional<at::Tensor>& key_padding_mask, double scale, double dropout_p,
           const c10::optional<at::Tensor>& rng, at::Tensor grad_q, at::Tensor grad_k,
           at::Tensor grad_v, const c10::optional<at::Tensor>& type_grad_sums) {
          graph_attention_cuda::launch_backward(
              grad_out, q, k, v, rel_key, lse, delta, indices, edge_type,
              WorkSchedule{q_pieces, q_merges, q_num_slots}, t_query, t_edge,
              WorkSchedule{k_pieces, k_merges, k_num_slots}, key_padding_mask, scale, dropout_p,
              rng, grad_q, grad_k, grad_v, type_grad_sums);
        });
}
