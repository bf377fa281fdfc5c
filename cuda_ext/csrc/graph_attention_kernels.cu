// Fused sparse graph attention (BP-Transformer / SegTree) on CUDA.
//
// One warp owns one (batch, head, node) row: lane i holds elements [i*VEC, (i+1)*VEC) of
// the D-dim vectors (VEC = D / 32), dot products are butterfly warp reductions, so every
// lane ends with the same bit-exact score and all branches below are warp-uniform.
//
// forward   per query row u: online softmax over the in-edges (CSR by query), relative
//           key vector rel_key[type] added to the key on the fly; writes out and a per-row
//           log-sum-exp. No per-edge tensor is stored.
// backward  dQ per query row over its in-edges; dK/dV per key node over its out-edges
//           (the transposed CSR), so every gradient element is written by one warp in a
//           fixed order: no atomics, bit-reproducible. The relative-key gradient is
//           drel[t] = sum_rows sum_{edges of type t} dS * scale * q_row; the dQ kernel
//           accumulates the per-row, per-type sums of dS (G, one warp per row, sequential)
//           and the launcher contracts G with q in one GEMM.
// dropout   the keep decision of edge e in (batch, head) bh is a pure function of
//           (seed, offset + bh * E + e) (dropout_bits below), so backward regenerates it.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "graph_attention.h"

namespace graph_attention_cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kEdgesPerStep = 4;  // edges whose loads and reductions are interleaved
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* ptr, float (&out)[VEC]) {
  const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(ptr);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = static_cast<float>(pack.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* ptr, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pack.v[i] = static_cast<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(ptr) = pack;
}

template <int N>
__device__ __forceinline__ void warp_sum(float (&x)[N]) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] += __shfl_xor_sync(kFullMask, x[i], offset);
  }
}

template <int VEC>
__device__ __forceinline__ float partial_dot(const float (&a)[VEC], const float (&b)[VEC]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) s = fmaf(a[i], b[i], s);
  return s;
}

// lowbias32 (Chris Wellons): a 32-bit integer hash with good avalanche.
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Counter-based random bits; mirrored exactly by graph_attention_cuda.dropout_keep_mask.
__device__ __forceinline__ uint32_t dropout_bits(uint64_t seed, uint64_t counter) {
  uint32_t h = mix32(static_cast<uint32_t>(seed >> 32) ^ 0x9e3779b9u);
  h = mix32(h ^ static_cast<uint32_t>(seed));
  h = mix32(h ^ static_cast<uint32_t>(counter >> 32));
  return mix32(h ^ static_cast<uint32_t>(counter));
}

template <typename T>
struct Params {
  const T* q;        // [B, H, N, D]
  const T* k;        // [B, H, N, D]
  const T* v;        // [B, H, N, D]
  const T* rel_key;  // [num_edge_types, D] or nullptr
  const int32_t* indptr;     // [N + 1], CSR by query node
  const int32_t* indices;    // [E], key node of each edge
  const int32_t* edge_type;  // [E]
  const bool* key_padding_mask;  // [B, N] (true = absent) or nullptr
  int batch, heads, num_nodes, num_edges, num_edge_types;
  float scale;
  // dropout: an edge is kept when dropout_bits(...) >= drop_threshold
  bool dropout;
  uint32_t drop_threshold;
  float keep_scale;  // 1 / (1 - p)
  uint64_t seed, offset;
};

template <typename T>
__device__ __forceinline__ bool key_present(const Params<T>& p, int b, int key) {
  return p.key_padding_mask == nullptr ||
         !p.key_padding_mask[static_cast<int64_t>(b) * p.num_nodes + key];
}

template <typename T>
__device__ __forceinline__ float dropout_factor(const Params<T>& p, int bh, int edge) {
  if (!p.dropout) return 1.f;
  const uint64_t counter =
      p.offset + static_cast<uint64_t>(bh) * static_cast<uint64_t>(p.num_edges) +
      static_cast<uint64_t>(edge);
  return dropout_bits(p.seed, counter) >= p.drop_threshold ? p.keep_scale : 0.f;
}

// key (+ relative key of the edge type), the vector the query is dotted with
template <typename T, int VEC>
__device__ __forceinline__ void load_key(const Params<T>& p, int64_t row_base, int key, int type,
                                         int lane, float (&out)[VEC]) {
  load_vec<T, VEC>(p.k + (row_base + key) * (VEC * kWarpSize) + lane * VEC, out);
  if (p.rel_key != nullptr) {
    float r[VEC];
    load_vec<T, VEC>(p.rel_key + static_cast<int64_t>(type) * (VEC * kWarpSize) + lane * VEC, r);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] += r[i];
  }
}

// scale * q, the form every kernel dots with keys (identical rounding in all kernels)
template <typename T, int VEC>
__device__ __forceinline__ void load_scaled_query(const Params<T>& p, int64_t row, int lane,
                                                  float (&out)[VEC]) {
  load_vec<T, VEC>(p.q + row * (VEC * kWarpSize) + lane * VEC, out);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] *= p.scale;
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    forward_kernel(const Params<T> p, T* __restrict__ out, float* __restrict__ lse) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  const int u = blockIdx.x * kWarpsPerBlock + threadIdx.y;
  if (u >= p.num_nodes) return;  // whole warp leaves together
  const int bh = blockIdx.y;
  const int b = bh / p.heads;
  const int64_t row_base = static_cast<int64_t>(bh) * p.num_nodes;

  float q[VEC];
  load_scaled_query<T, VEC>(p, row_base + u, lane, q);

  float running_max = -INFINITY, denom = 0.f;
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;

  const int begin = p.indptr[u], end = p.indptr[u + 1];
  for (int e0 = begin; e0 < end; e0 += kEdgesPerStep) {
    float score[kEdgesPerStep];
    float val[kEdgesPerStep][VEC];
    bool valid[kEdgesPerStep];
#pragma unroll
    for (int c = 0; c < kEdgesPerStep; ++c) {
      const int e = e0 + c;
      valid[c] = e < end;
      score[c] = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) val[c][i] = 0.f;
      if (valid[c]) {
        const int key = p.indices[e];
        valid[c] = key_present(p, b, key);
        if (valid[c]) {
          float kk[VEC];
          load_key<T, VEC>(p, row_base, key, p.edge_type[e], lane, kk);
          load_vec<T, VEC>(p.v + (row_base + key) * D + lane * VEC, val[c]);
          score[c] = partial_dot<VEC>(q, kk);
        }
      }
    }
    warp_sum<kEdgesPerStep>(score);

    float step_max = running_max;
#pragma unroll
    for (int c = 0; c < kEdgesPerStep; ++c)
      if (valid[c]) step_max = fmaxf(step_max, score[c]);
    if (step_max == -INFINITY) continue;  // nothing present yet

    const float correction = __expf(running_max - step_max);  // 0 on the first step
    denom *= correction;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= correction;
#pragma unroll
    for (int c = 0; c < kEdgesPerStep; ++c) {
      if (!valid[c]) continue;
      const float prob = __expf(score[c] - step_max);
      denom += prob;
      const float weight = prob * dropout_factor(p, bh, e0 + c);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = fmaf(weight, val[c][i], acc[i]);
    }
    running_max = step_max;
  }

  // denom >= 1 whenever a neighbour was present (the max term contributes exp(0))
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] *= inv;
  store_vec<T, VEC>(out + (row_base + u) * D + lane * VEC, acc);
  if (lane == 0) lse[row_base + u] = denom > 0.f ? running_max + __logf(denom) : -INFINITY;
}

// dQ (and the per-type sums G of dS) for one query row.
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    backward_query_kernel(const Params<T> p, const T* __restrict__ grad_out,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ grad_q, float* __restrict__ type_grad_sums) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  const int u = blockIdx.x * kWarpsPerBlock + threadIdx.y;
  if (u >= p.num_nodes) return;
  const int bh = blockIdx.y;
  const int b = bh / p.heads;
  const int64_t row_base = static_cast<int64_t>(bh) * p.num_nodes;
  const int64_t row = row_base + u;

  float dq[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) dq[i] = 0.f;

  const float row_lse = lse[row];
  if (row_lse != -INFINITY) {
    const float row_delta = delta[row];
    float q[VEC], dout[VEC];
    load_scaled_query<T, VEC>(p, row, lane, q);
    load_vec<T, VEC>(grad_out + row * D + lane * VEC, dout);

    const int begin = p.indptr[u], end = p.indptr[u + 1];
    for (int e0 = begin; e0 < end; e0 += kEdgesPerStep) {
      float score[kEdgesPerStep], dprob[kEdgesPerStep];
      float kk[kEdgesPerStep][VEC];
      bool valid[kEdgesPerStep];
      int type[kEdgesPerStep];
#pragma unroll
      for (int c = 0; c < kEdgesPerStep; ++c) {
        const int e = e0 + c;
        valid[c] = e < end;
        score[c] = 0.f;
        dprob[c] = 0.f;
        type[c] = 0;
#pragma unroll
        for (int i = 0; i < VEC; ++i) kk[c][i] = 0.f;
        if (valid[c]) {
          const int key = p.indices[e];
          valid[c] = key_present(p, b, key);
          if (valid[c]) {
            type[c] = p.edge_type[e];
            float val[VEC];
            load_key<T, VEC>(p, row_base, key, type[c], lane, kk[c]);
            load_vec<T, VEC>(p.v + (row_base + key) * D + lane * VEC, val);
            score[c] = partial_dot<VEC>(q, kk[c]);
            dprob[c] = partial_dot<VEC>(dout, val);
          }
        }
      }
      warp_sum<kEdgesPerStep>(score);
      warp_sum<kEdgesPerStep>(dprob);
#pragma unroll
      for (int c = 0; c < kEdgesPerStep; ++c) {
        if (!valid[c]) continue;
        const float prob = __expf(score[c] - row_lse);
        const float dscore = prob * (dprob[c] * dropout_factor(p, bh, e0 + c) - row_delta);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dq[i] = fmaf(dscore, kk[c][i], dq[i]);
        if (type_grad_sums != nullptr && lane == 0)
          type_grad_sums[row * p.num_edge_types + type[c]] += dscore;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) dq[i] *= p.scale;
  store_vec<T, VEC>(grad_q + row * D + lane * VEC, dq);
}

// dK and dV for one key node, over its out-edges (transposed CSR).
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    backward_key_kernel(const Params<T> p, const int32_t* __restrict__ t_indptr,
                        const int32_t* __restrict__ t_query, const int32_t* __restrict__ t_edge,
                        const T* __restrict__ grad_out, const float* __restrict__ lse,
                        const float* __restrict__ delta, T* __restrict__ grad_k,
                        T* __restrict__ grad_v) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  const int key = blockIdx.x * kWarpsPerBlock + threadIdx.y;
  if (key >= p.num_nodes) return;
  const int bh = blockIdx.y;
  const int b = bh / p.heads;
  const int64_t row_base = static_cast<int64_t>(bh) * p.num_nodes;

  float dk[VEC], dv[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) dk[i] = dv[i] = 0.f;

  if (key_present(p, b, key)) {
    float kbase[VEC], val[VEC];
    load_vec<T, VEC>(p.k + (row_base + key) * D + lane * VEC, kbase);
    load_vec<T, VEC>(p.v + (row_base + key) * D + lane * VEC, val);

    const int begin = t_indptr[key], end = t_indptr[key + 1];
    for (int j0 = begin; j0 < end; j0 += kEdgesPerStep) {
      float score[kEdgesPerStep], dprob[kEdgesPerStep];
      float q[kEdgesPerStep][VEC], dout[kEdgesPerStep][VEC];
      float row_lse[kEdgesPerStep], row_delta[kEdgesPerStep];
      int edge[kEdgesPerStep];
      bool valid[kEdgesPerStep];
#pragma unroll
      for (int c = 0; c < kEdgesPerStep; ++c) {
        const int j = j0 + c;
        valid[c] = j < end;
        score[c] = dprob[c] = 0.f;
        row_lse[c] = -INFINITY;
        row_delta[c] = 0.f;
        edge[c] = 0;
#pragma unroll
        for (int i = 0; i < VEC; ++i) q[c][i] = dout[c][i] = 0.f;
        if (valid[c]) {
          const int64_t row = row_base + t_query[j];
          row_lse[c] = lse[row];
          valid[c] = row_lse[c] != -INFINITY;
          if (valid[c]) {
            edge[c] = t_edge[j];
            row_delta[c] = delta[row];
            float kk[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) kk[i] = kbase[i];
            if (p.rel_key != nullptr) {
              float r[VEC];
              load_vec<T, VEC>(p.rel_key + static_cast<int64_t>(p.edge_type[edge[c]]) * D +
                                   lane * VEC,
                               r);
#pragma unroll
              for (int i = 0; i < VEC; ++i) kk[i] += r[i];
            }
            load_scaled_query<T, VEC>(p, row, lane, q[c]);
            load_vec<T, VEC>(grad_out + row * D + lane * VEC, dout[c]);
            score[c] = partial_dot<VEC>(q[c], kk);
            dprob[c] = partial_dot<VEC>(dout[c], val);
          }
        }
      }
      warp_sum<kEdgesPerStep>(score);
      warp_sum<kEdgesPerStep>(dprob);
#pragma unroll
      for (int c = 0; c < kEdgesPerStep; ++c) {
        if (!valid[c]) continue;
        const float prob = __expf(score[c] - row_lse[c]);
        const float keep = dropout_factor(p, bh, edge[c]);
        const float dscore = prob * (dprob[c] * keep - row_delta[c]);
        const float weight = prob * keep;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          dv[i] = fmaf(weight, dout[c][i], dv[i]);
          dk[i] = fmaf(dscore, q[c][i], dk[i]);  // q is already scaled
        }
      }
    }
  }
  const int64_t out_row = row_base + key;
  store_vec<T, VEC>(grad_k + out_row * D + lane * VEC, dk);
  store_vec<T, VEC>(grad_v + out_row * D + lane * VEC, dv);
}

template <typename T>
Params<T> make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& rel_key, const at::Tensor& indptr,
                      const at::Tensor& indices, const at::Tensor& edge_type,
                      const c10::optional<at::Tensor>& key_padding_mask, double scale,
                      double dropout_p, uint64_t seed, uint64_t offset) {
  Params<T> p;
  p.q = q.const_data_ptr<T>();
  p.k = k.const_data_ptr<T>();
  p.v = v.const_data_ptr<T>();
  p.rel_key = rel_key.has_value() ? rel_key->const_data_ptr<T>() : nullptr;
  p.indptr = indptr.const_data_ptr<int32_t>();
  p.indices = indices.const_data_ptr<int32_t>();
  p.edge_type = edge_type.const_data_ptr<int32_t>();
  p.key_padding_mask =
      key_padding_mask.has_value() ? key_padding_mask->const_data_ptr<bool>() : nullptr;
  p.batch = static_cast<int>(q.size(0));
  p.heads = static_cast<int>(q.size(1));
  p.num_nodes = static_cast<int>(q.size(2));
  p.num_edges = static_cast<int>(indices.numel());
  p.num_edge_types = rel_key.has_value() ? static_cast<int>(rel_key->size(0)) : 0;
  p.scale = static_cast<float>(scale);
  p.dropout = dropout_p > 0.0;
  // keep iff bits >= p * 2^32; dropout_p < 1 is checked by the caller
  p.drop_threshold = static_cast<uint32_t>(dropout_p * 4294967296.0);
  p.keep_scale = p.dropout ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.f;
  p.seed = seed;
  p.offset = offset;
  return p;
}

dim3 grid_for(const at::Tensor& q) {
  const int64_t nodes = q.size(2);
  return dim3(static_cast<unsigned>((nodes + kWarpsPerBlock - 1) / kWarpsPerBlock),
              static_cast<unsigned>(q.size(0) * q.size(1)));
}

const dim3 kBlock(kWarpSize, kWarpsPerBlock);

// float32, float16 and bfloat16 only (no float64 instantiations)
#define GRAPH_ATTENTION_DISPATCH_DTYPE(dtype, name, ...)             \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                      AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                                          AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

#define GRAPH_ATTENTION_DISPATCH_HEAD_DIM(head_dim, ...)              \
  [&] {                                                               \
    switch (head_dim) {                                               \
      case 32: { constexpr int kHeadDim = 32; return __VA_ARGS__(); } \
      case 64: { constexpr int kHeadDim = 64; return __VA_ARGS__(); } \
      case 128: { constexpr int kHeadDim = 128; return __VA_ARGS__(); } \
      default: TORCH_CHECK(false, "graph_attention_cuda: head dim must be 32, 64 or 128, got ", head_dim); \
    }                                                                 \
  }()

}  // namespace

void launch_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const c10::optional<at::Tensor>& rel_key, const at::Tensor& indptr,
                    const at::Tensor& indices, const at::Tensor& edge_type,
                    const c10::optional<at::Tensor>& key_padding_mask, double scale,
                    double dropout_p, uint64_t seed, uint64_t offset, at::Tensor& out,
                    at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.numel() == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  GRAPH_ATTENTION_DISPATCH_DTYPE(q.scalar_type(), "graph_attention_forward", [&] {
    const auto p = make_params<scalar_t>(q, k, v, rel_key, indptr, indices, edge_type,
                                         key_padding_mask, scale, dropout_p, seed, offset);
    GRAPH_ATTENTION_DISPATCH_HEAD_DIM(q.size(3), [&] {
      forward_kernel<scalar_t, kHeadDim><<<grid_for(q), kBlock, 0, stream>>>(
          p, out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void launch_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const c10::optional<at::Tensor>& rel_key,
                     const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& indptr,
                     const at::Tensor& indices, const at::Tensor& edge_type,
                     const at::Tensor& t_indptr, const at::Tensor& t_query,
                     const at::Tensor& t_edge,
                     const c10::optional<at::Tensor>& key_padding_mask, double scale,
                     double dropout_p, uint64_t seed, uint64_t offset, at::Tensor& grad_q,
                     at::Tensor& grad_k, at::Tensor& grad_v,
                     const c10::optional<at::Tensor>& type_grad_sums) {
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.numel() == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  GRAPH_ATTENTION_DISPATCH_DTYPE(q.scalar_type(), "graph_attention_backward", [&] {
    const auto p = make_params<scalar_t>(q, k, v, rel_key, indptr, indices, edge_type,
                                         key_padding_mask, scale, dropout_p, seed, offset);
    GRAPH_ATTENTION_DISPATCH_HEAD_DIM(q.size(3), [&] {
      backward_query_kernel<scalar_t, kHeadDim><<<grid_for(q), kBlock, 0, stream>>>(
          p, grad_out.const_data_ptr<scalar_t>(), lse.const_data_ptr<float>(),
          delta.const_data_ptr<float>(), grad_q.mutable_data_ptr<scalar_t>(),
          type_grad_sums.has_value() ? type_grad_sums->mutable_data_ptr<float>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      backward_key_kernel<scalar_t, kHeadDim><<<grid_for(q), kBlock, 0, stream>>>(
          p, t_indptr.const_data_ptr<int32_t>(), t_query.const_data_ptr<int32_t>(),
          t_edge.const_data_ptr<int32_t>(), grad_out.const_data_ptr<scalar_t>(),
          lse.const_data_ptr<float>(), delta.const_data_ptr<float>(),
          grad_k.mutable_data_ptr<scalar_t>(), grad_v.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace graph_attention_cuda
