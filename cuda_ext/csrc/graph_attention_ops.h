// The operations both bindings expose (graph_attention.cpp on CUDA, host_emulation.cpp on
// CPU): input validation, output allocation, Delta = dO . O and the relative-key gradient
// contraction. A binding supplies its device type; the caller draws the dropout (seed,
// offset) as a tensor on the inputs' device, which the kernels read there.
#pragma once

#include <torch/extension.h>

#include <limits>
#include <tuple>

#include "graph_attention.h"

namespace graph_attention_cuda {
namespace ops {

constexpr int64_t kMaxLaunchWarps = (int64_t{1} << 31) - 1;  // 4 warps per block, grid.x < 2^31

inline void check_vector_input(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device() == like.device(), "graph_attention_cuda: ", name, " is on ",
              t.device(), " but query is on ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "graph_attention_cuda: ", name,
              " has dtype ", t.scalar_type(), " but query has ", like.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "graph_attention_cuda: ", name, " must be contiguous");
  // the kernels load D / 32 elements per lane as one vector
  const int64_t align = (like.size(-1) / 32) * like.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0,
              "graph_attention_cuda: ", name, " must be ", align, "-byte aligned");
}

inline void check_index(const at::Tensor& t, const at::Tensor& q, int64_t numel,
                        const char* name) {
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 1 &&
                  t.is_contiguous(),
              "graph_attention_cuda: ", name, " must be a contiguous int32 vector on ",
              q.device());
  TORCH_CHECK(t.numel() == numel, "graph_attention_cuda: ", name, " has ", t.numel(),
              " entries, expected ", numel);
}

// Shapes only: the contents (rows, edge ranges, slots) come from the schedule builder,
// which validates the graph once (fairseq_plugins/graph_attention/cuda_backend.py).
inline WorkSchedule schedule(const at::Tensor& q, const at::Tensor& pieces,
                             const at::Tensor& merges, int64_t num_slots, const char* name) {
  for (const auto& [t, fields] : {std::pair{pieces, 5}, std::pair{merges, 4}}) {
    TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 2 &&
                    t.size(1) == fields && t.is_contiguous(),
                "graph_attention_cuda: the ", name, " schedule must be contiguous int32 [*, ",
                fields, "] tensors on ", q.device());
  }
  TORCH_CHECK(num_slots >= 0 && num_slots < std::numeric_limits<int32_t>::max(),
              "graph_attention_cuda: bad ", name, " slot count ", num_slots);
  const int64_t warps = std::max(pieces.size(0), merges.size(0)) * q.size(0) * q.size(1);
  TORCH_CHECK(warps <= kMaxLaunchWarps, "graph_attention_cuda: ", warps,
              " warps exceed one launch; use fewer sentences or heads per call");
  return {pieces, merges, num_slots};
}

inline void check_inputs(at::DeviceType device_type, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const c10::optional<at::Tensor>& rel_key,
                         const at::Tensor& indices, const at::Tensor& edge_type,
                         const c10::optional<at::Tensor>& key_padding_mask, double dropout_p) {
  TORCH_CHECK(q.device().type() == device_type && q.dim() == 4, "graph_attention_cuda: query "
              "must be a ", c10::DeviceTypeName(device_type), " tensor [B, H, N, D]");
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
  const int64_t nodes = q.size(2);
  TORCH_CHECK(nodes < std::numeric_limits<int32_t>::max(), "graph_attention_cuda: too many nodes");
  TORCH_CHECK(q.size(0) * q.size(1) < std::numeric_limits<int32_t>::max(),
              "graph_attention_cuda: too many sentences * heads");
  if (rel_key.has_value()) {
    check_vector_input(*rel_key, q, "rel_key");
    TORCH_CHECK(rel_key->dim() == 2 && rel_key->size(1) == head_dim,
                "graph_attention_cuda: rel_key must be [num_edge_types, ", head_dim, "], got ",
                rel_key->sizes());
  }
  TORCH_CHECK(indices.numel() < std::numeric_limits<int32_t>::max(),
              "graph_attention_cuda: too many edges");
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

// The dropout stream: int64 [2] (seed, offset) on the query's device, read by the kernels
// (never by the host, so a captured CUDA graph replays the draw that fills it).
inline void check_rng(const at::Tensor& q, const c10::optional<at::Tensor>& rng,
                      double dropout_p) {
  if (dropout_p == 0.0) return;
  TORCH_CHECK(rng.has_value() && rng->device() == q.device() &&
                  rng->scalar_type() == at::kLong && rng->numel() == 2 && rng->is_contiguous(),
              "graph_attention_cuda: dropout needs its (seed, offset) as a contiguous int64 [2] "
              "tensor on ", q.device());
}

inline std::tuple<at::Tensor, at::Tensor> forward(
    at::DeviceType device_type, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& rel_key, const at::Tensor& indices,
    const at::Tensor& edge_type, const at::Tensor& q_pieces, const at::Tensor& q_merges,
    int64_t q_num_slots, const c10::optional<at::Tensor>& key_padding_mask, double scale,
    double dropout_p, const c10::optional<at::Tensor>& rng) {
  check_inputs(device_type, q, k, v, rel_key, indices, edge_type, key_padding_mask, dropout_p);
  check_rng(q, rng, dropout_p);
  const WorkSchedule by_query = schedule(q, q_pieces, q_merges, q_num_slots, "query");
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  launch_forward(q, k, v, rel_key, indices, edge_type, by_query, key_padding_mask, scale,
                 dropout_p, rng, out, lse);
  return {out, lse};
}

// Returns dq, dk, dv and drel ([num_edge_types, D], or [0, D] unless need_rel_grad).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    at::DeviceType device_type, const at::Tensor& grad_out, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& rel_key,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& rng,
    const at::Tensor& indices, const at::Tensor& edge_type, const at::Tensor& q_pieces,
    const at::Tensor& q_merges, int64_t q_num_slots, const at::Tensor& t_query,
    const at::Tensor& t_edge, const at::Tensor& k_pieces, const at::Tensor& k_merges,
    int64_t k_num_slots, const c10::optional<at::Tensor>& key_padding_mask, double scale,
    double dropout_p, bool need_rel_grad) {
  check_inputs(device_type, q, k, v, rel_key, indices, edge_type, key_padding_mask, dropout_p);
  check_rng(q, rng, dropout_p);
  const WorkSchedule by_query = schedule(q, q_pieces, q_merges, q_num_slots, "query");
  const WorkSchedule by_key = schedule(q, k_pieces, k_merges, k_num_slots, "key");
  check_vector_input(grad_out, q, "grad_out");
  check_vector_input(out, q, "out");
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "graph_attention_cuda: grad_out and out must have the query's shape");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.device() == q.device() && lse.numel() == q.numel() / q.size(3),
              "graph_attention_cuda: lse must be the float32 [B, H, N] tensor from forward");
  check_index(t_query, q, indices.numel(), "transposed query");
  check_index(t_edge, q, indices.numel(), "transposed edge id");
  TORCH_CHECK(!need_rel_grad || rel_key.has_value(),
              "graph_attention_cuda: need_rel_grad without rel_key");

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
  launch_backward(grad_out, q, k, v, rel_key, lse, delta, indices, edge_type, by_query, t_query,
                  t_edge, by_key, key_padding_mask, scale, dropout_p, rng, grad_q, grad_k,
                  grad_v, type_grad_sums);
  at::Tensor grad_rel = at::empty({0, q.size(3)}, q.options());
  if (need_rel_grad) {
    // drel[t] = scale * sum_rows G[row, t] * q[row]: one GEMM, no atomics
    grad_rel = at::matmul(type_grad_sums->t(), q.reshape({-1, q.size(3)}).to(at::kFloat))
                   .mul_(scale)
                   .to(rel_key->scalar_type());
  }
  return {grad_q, grad_k, grad_v, grad_rel};
}

// The Python module: forward and backward bound to a device type.
inline void define_module(pybind11::module_& m, at::DeviceType device_type) {
  m.def("forward",
        [=](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const c10::optional<at::Tensor>& rel_key, const at::Tensor& indices,
            const at::Tensor& edge_type, const at::Tensor& q_pieces, const at::Tensor& q_merges,
            int64_t q_num_slots, const c10::optional<at::Tensor>& key_padding_mask,
            double scale, double dropout_p, const c10::optional<at::Tensor>& rng) {
          return forward(device_type, q, k, v, rel_key, indices, edge_type, q_pieces, q_merges,
                         q_num_slots, key_padding_mask, scale, dropout_p, rng);
        },
        "out, lse = forward(q, k, v, rel_key, indices, edge_type, q_pieces, q_merges, "
        "q_num_slots, key_padding_mask, scale, dropout_p, rng)");
  m.def("backward",
        [=](const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
            const at::Tensor& v, const c10::optional<at::Tensor>& rel_key, const at::Tensor& out,
            const at::Tensor& lse, const c10::optional<at::Tensor>& rng,
            const at::Tensor& indices,
            const at::Tensor& edge_type, const at::Tensor& q_pieces, const at::Tensor& q_merges,
            int64_t q_num_slots, const at::Tensor& t_query, const at::Tensor& t_edge,
            const at::Tensor& k_pieces, const at::Tensor& k_merges, int64_t k_num_slots,
            const c10::optional<at::Tensor>& key_padding_mask, double scale, double dropout_p,
            bool need_rel_grad) {
          return backward(device_type, grad_out, q, k, v, rel_key, out, lse, rng, indices,
                          edge_type, q_pieces, q_merges, q_num_slots, t_query, t_edge, k_pieces,
                          k_merges, k_num_slots, key_padding_mask, scale, dropout_p,
                          need_rel_grad);
        },
        "dq, dk, dv, drel = backward(grad_out, q, k, v, rel_key, out, lse, rng, indices, "
        "edge_type, q_pieces, q_merges, q_num_slots, t_query, t_edge, k_pieces, k_merges, "
        "k_num_slots, key_padding_mask, scale, dropout_p, need_rel_grad)");
}

}  // namespace ops
}  // namespace graph_attention_cuda
