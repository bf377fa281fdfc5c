// Declarations shared by the kernels (graph_attention_kernels.cuh) and the bindings
// (graph_attention_ops.h). Inputs are validated by the binding, not here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace graph_attention_cuda {

// The warps' work over one CSR (rows by query, or by key for dK/dV), built once per graph:
// pieces int32 [P, 5] (row, begin, end, slot or -1, row has several edge types), longest
// first; merges int32 [S, 4] (row, first slot, slot count, several types) for the rows
// split into several pieces; num_slots workspace slots in all.
struct WorkSchedule {
  at::Tensor pieces;
  at::Tensor merges;
  int64_t num_slots;
};

// rng: int64 [2] (seed, offset) on the inputs' device, read by the kernels when
// dropout_p > 0 (may be absent otherwise).
// out [B, H, N, D] and lse [B, H, N] (float32) are written.
void launch_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const c10::optional<at::Tensor>& rel_key, const at::Tensor& indices,
                    const at::Tensor& edge_type, const WorkSchedule& by_query,
                    const c10::optional<at::Tensor>& key_padding_mask, double scale,
                    double dropout_p, const c10::optional<at::Tensor>& rng, at::Tensor& out,
                    at::Tensor& lse);

// grad_q/grad_k/grad_v are written; type_grad_sums ([B * H * N, num_edge_types] float32,
// zero-filled) receives the per-row, per-edge-type sums of dS when given.
void launch_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const c10::optional<at::Tensor>& rel_key,
                     const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& indices,
                     const at::Tensor& edge_type, const WorkSchedule& by_query,
                     const at::Tensor& t_query, const at::Tensor& t_edge,
                     const WorkSchedule& by_key,
                     const c10::optional<at::Tensor>& key_padding_mask, double scale,
                     double dropout_p, const c10::optional<at::Tensor>& rng, at::Tensor& grad_q,
                     at::Tensor& grad_k, at::Tensor& grad_v,
                     const c10::optional<at::Tensor>& type_grad_sums);

}  // namespace graph_attention_cuda
