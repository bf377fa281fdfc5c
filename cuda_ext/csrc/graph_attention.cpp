// Python binding of the fused graph attention kernels: input validation, output
// allocation, the dropout RNG state and the relative-key gradient contraction.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <torch/extension.h>

#include <limits>
#include <mutex>
#include <tuple>

#include "graph_attention.h"

namespace graph_attention_cuda {
namespace {

void check_vector_input(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda(), "graph_attention_cuda: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), "graph_attention_cuda: ", name,
              " is on ", t.device(), " but query is on ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "graph_attention_cuda: ", name,
              " has dtype ", t.scalar_type(), " but query has ", like.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "graph_attention_cuda: ", name, " must be contiguous");
  // the kernels load D / 32 elements per lane as one vector
  const int64_t align = (like.size(-1) / 32) * like.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0,
              "graph_attention_cuda: ", name, " must be ", align, "-byte aligned");
}

void check_index(const at::Tensor& t, const at::Tensor& q, int64_t numel, const char* name) {
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 1 &&
                  t.is_contiguous(),
              "graph_attention_cuda: ", name, " must be a contiguous int32 vector on ",
              q.device());
  TORCH_CHECK(t.numel() == numel, "graph_attention_cuda: ", name, " has ", t.numel(),
              " entries, expected ", numel);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& rel_key, const at::Tensor& indptr,
                  const at::Tensor& indices, const at::Tensor& edge_type,
                  const c10::optional<at::Tensor>& key_padding_mask, double dropout_p) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4, "graph_attention_cuda: query must be a CUDA tensor [B, H, N, D]");
  const int64_t head_dim = q.size(3);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128,
              "graph_attention_cuda: head dim must be 32, 64 or 128, got ", head_dim);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf ||
                  q.scalar_type() == at::kBFloat16,
              "graph_attention_cuda: dtype must be float32, float16 or bfloat16, got ",
              q.scalar_type());
  check_vector_input(q, q, "query");
  check_vector_input(k, q, "key");
  check_vector_input(v, q, "value");
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "graph_attention_cuda: query, key and value must have the same shape, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.size(0) * q.size(1) <= 65535,
              "graph_attention_cuda: batch * heads must be at most 65535, got ",
              q.size(0) * q.size(1));
  const int64_t nodes = q.size(2);
  TORCH_CHECK(nodes < std::numeric_limits<int32_t>::max(), "graph_attention_cuda: too many nodes");
  if (rel_key.has_value()) {
    check_vector_input(*rel_key, q, "rel_key");
    TORCH_CHECK(rel_key->dim() == 2 && rel_key->size(1) == head_dim,
                "graph_attention_cuda: rel_key must be [num_edge_types, ", head_dim, "], got ",
                rel_key->sizes());
  }
  check_index(indptr, q, nodes + 1, "indptr");
  check_index(indices, q, indices.numel(), "indices");
  check_index(edge_type, q, indices.numel(), "edge_type");
  if (key_padding_mask.has_value()) {
    const auto& m = *key_padding_mask;
    TORCH_CHECK(m.device() == q.device() && m.scalar_type() == at::kBool && m.is_contiguous() &&
                    m.dim() == 2 && m.size(0) == q.size(0) && m.size(1) == nodes,
                "graph_attention_cuda: key_padding_mask must be a contiguous bool tensor [",
                q.size(0), ", ", nodes, "] on ", q.device());
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "graph_attention_cuda: dropout_p must be in [0, 1), got ", dropout_p);
}

// (seed, offset) for this call's dropout, drawn from torch's CUDA generator so that
// torch.cuda.manual_seed makes runs reproducible. Returned as int64 bit patterns.
at::Tensor draw_rng_state(const at::Tensor& q, int64_t counters) {
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

std::tuple<uint64_t, uint64_t> unpack_rng_state(const at::Tensor& rng) {
  TORCH_CHECK(rng.device().is_cpu() && rng.scalar_type() == at::kLong && rng.numel() == 2,
              "graph_attention_cuda: rng_state must be the CPU int64 [2] tensor from forward");
  const auto* data = rng.const_data_ptr<int64_t>();
  return {static_cast<uint64_t>(data[0]), static_cast<uint64_t>(data[1])};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& rel_key, const at::Tensor& indptr,
    const at::Tensor& indices, const at::Tensor& edge_type,
    const c10::optional<at::Tensor>& key_padding_mask, double scale, double dropout_p) {
  check_inputs(q, k, v, rel_key, indptr, indices, edge_type, key_padding_mask, dropout_p);
  at::Tensor rng = dropout_p > 0.0
                       ? draw_rng_state(q, q.size(0) * q.size(1) * indices.numel())
                       : at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  const auto [seed, offset] = unpack_rng_state(rng);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  launch_forward(q, k, v, rel_key, indptr, indices, edge_type, key_padding_mask, scale,
                 dropout_p, seed, offset, out, lse);
  return {out, lse, rng};
}

// Returns dq, dk, dv and drel (undefined unless need_rel_grad).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& rel_key, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& rng, const at::Tensor& indptr, const at::Tensor& indices,
    const at::Tensor& edge_type, const at::Tensor& t_indptr, const at::Tensor& t_query,
    const at::Tensor& t_edge, const c10::optional<at::Tensor>& key_padding_mask, double scale,
    double dropout_p, bool need_rel_grad) {
  check_inputs(q, k, v, rel_key, indptr, indices, edge_type, key_padding_mask, dropout_p);
  check_vector_input(grad_out, q, "grad_out");
  check_vector_input(out, q, "out");
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "graph_attention_cuda: grad_out and out must have the query's shape");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.device() == q.device() && lse.numel() == q.numel() / q.size(3),
              "graph_attention_cuda: lse must be the float32 [B, H, N] tensor from forward");
  check_index(t_indptr, q, q.size(2) + 1, "transposed indptr");
  check_index(t_query, q, indices.numel(), "transposed query");
  check_index(t_edge, q, indices.numel(), "transposed edge id");
  TORCH_CHECK(!need_rel_grad || rel_key.has_value(),
              "graph_attention_cuda: need_rel_grad without rel_key");
  const auto [seed, offset] = unpack_rng_state(rng);

  // Delta_u = dO_u . O_u = sum_e P_e dP_e (with dropout, O already carries the mask)
  const auto delta = (grad_out.to(at::kFloat) * out.to(at::kFloat)).sum(-1).contiguous();
  auto grad_q = at::empty_like(q);
  auto grad_k = at::empty_like(k);
  auto grad_v = at::empty_like(v);
  c10::optional<at::Tensor> type_grad_sums;
  if (need_rel_grad) {
    type_grad_sums = at::zeros({q.numel() / q.size(3), rel_key->size(0)},
                               q.options().dtype(at::kFloat));
  }
  launch_backward(grad_out, q, k, v, rel_key, lse, delta, indptr, indices, edge_type, t_indptr,
                  t_query, t_edge, key_padding_mask, scale, dropout_p, seed, offset, grad_q,
                  grad_k, grad_v, type_grad_sums);
  at::Tensor grad_rel;
  if (need_rel_grad) {
    // drel[t] = scale * sum_rows G[row, t] * q[row]: one GEMM, no atomics
    grad_rel = at::matmul(type_grad_sums->t(), q.reshape({-1, q.size(3)}).to(at::kFloat))
                   .mul_(scale)
                   .to(rel_key->scalar_type());
  }
  return {grad_q, grad_k, grad_v, grad_rel};
}

}  // namespace
}  // namespace graph_attention_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused sparse graph attention (BPT / SegTree) CUDA kernels";
  m.def("forward", &graph_attention_cuda::forward,
        "out, lse, rng_state = forward(q, k, v, rel_key, indptr, indices, edge_type, "
        "key_padding_mask, scale, dropout_p)");
  m.def("backward", &graph_attention_cuda::backward,
        "dq, dk, dv, drel = backward(grad_out, q, k, v, rel_key, out, lse, rng_state, indptr, "
        "indices, edge_type, t_indptr, t_query, t_edge, key_padding_mask, scale, dropout_p, "
        "need_rel_grad)");
}
