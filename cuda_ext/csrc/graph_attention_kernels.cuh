// Fused sparse graph attention (BP-Transformer / SegTree): the kernels and their launchers.
//
// Compiled by nvcc (graph_attention_kernels.cu) and, unchanged, by g++ on a CPU with the
// host emulation of host_emulation.h (tests/graph_attention/test_cuda_ext_emulation.py). The includer
// defines GA_DEVICE_GUARD(tensor) and GA_LAUNCH(kernel_pointer, grid, block, args...).
//
// Work is a list of pieces of CSR rows (the schedule, built once per graph by
// fairseq_plugins/graph_attention/cuda_backend.py): a row of at most `split_edges` edges is
// one piece, a longer row is cut into pieces of that size. One warp owns one (piece, batch
// * head): lane i holds elements [i*VEC, (i+1)*VEC) of the D-dim vectors (VEC = D / 32),
// dot products are butterfly warp reductions, so every lane ends with the same bit-exact
// score and all branches below are warp-uniform. Pieces are sorted longest first and
// warps take them in that order (batch * head fastest), so the long rows start first.
// A piece of a split row writes a partial result to a float32 workspace slot; a merge
// kernel then combines the slots of each split row in slot order (log-sum-exp for the
// forward, plain sums for the gradients), so results stay bit-reproducible.
//
// forward   online softmax over a piece's edges, relative key rel_key[type] added to the
//           key on the fly; writes out and a per-row log-sum-exp. No per-edge tensor.
// backward  dQ per query piece; dK/dV per key piece of the transposed CSR: every gradient
//           element is written by one warp or one merge, no atomics. The relative-key
//           gradient is drel[t] = scale * sum_rows G[row, t] q_row with G the per-row,
//           per-type sums of dS, accumulated in registers across the lanes (a piece's
//           types lie in one window of kTypeWindow) and stored once per piece; a row
//           whose edges all share one type has G = sum_e dS_e = 0 exactly and stores
//           nothing. No read-modify-write of G anywhere.
// dropout   the keep decision of edge e in (batch, head) bh is a pure function of
//           (seed, offset + bh * E + e) (dropout_bits below), so backward regenerates it.
//           seed and offset are read from device memory (int64 [2], drawn by torch on the
//           device for every call), never passed by value: a captured CUDA graph replays
//           the draw, and with it a new mask.
// offsets   every element offset is computed in int64, such as (bh * N + node) * D:
//           B * H * N * D may exceed 2^31 (tests/graph_attention/test_cuda_ext_offsets.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <cstdint>

#include "graph_attention.h"

namespace graph_attention_cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kEdgesPerStep = 4;  // edges whose loads and reductions are interleaved
constexpr unsigned kFullMask = 0xffffffffu;
// The dQ kernel sums dS per edge type in registers: lane L, slot s holds type
// type_base + s * 32 + L. The schedule keeps each piece's types within one window of
// kTypeWindow types (cuda_backend.TYPE_WINDOW); rows over several windows are split.
constexpr int kTypeSlots = 4;
constexpr int kTypeWindow = kTypeSlots * kWarpSize;

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

// Counter-based random bits; mirrored exactly by tests/cuda_ext_reference.dropout_keep_mask.
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
  const int32_t* indices;    // [E], key node of each edge (CSR by query, type-ordered rows)
  const int32_t* edge_type;  // [E]
  const bool* key_padding_mask;  // [B, N] (true = absent) or nullptr
  int batch_heads, heads, num_nodes, num_edges, num_edge_types;
  float scale;
  // dropout: an edge is kept when dropout_bits(...) >= drop_threshold
  bool dropout;
  uint32_t drop_threshold;
  float keep_scale;  // 1 / (1 - p)
  const int64_t* rng;  // [2] (seed, offset) in device memory; read only with dropout
};

// The dropout stream of one call, loaded once per warp (every lane reads the same two words).
struct RngState {
  uint64_t seed, offset;
};

template <typename T>
__device__ __forceinline__ RngState load_rng(const Params<T>& p) {
  if (!p.dropout) return {0, 0};
  return {static_cast<uint64_t>(p.rng[0]), static_cast<uint64_t>(p.rng[1])};
}

// One row of the piece table: the warp's work. Layout fixed by cuda_backend.py.
struct Piece {
  int row, begin, end, slot;  // slot < 0: the piece is its whole row
  bool multi_type;            // the row has edges of more than one type
};
// One row of the merge table: a split row and its workspace slots.
struct Merge {
  int row, first_slot, num_slots;
  bool multi_type;
};
constexpr int kPieceFields = 5;
constexpr int kMergeFields = 4;

struct Schedule {
  const int32_t* pieces;  // [num_pieces, kPieceFields]
  const int32_t* merges;  // [num_merges, kMergeFields]
  int num_pieces, num_merges, num_slots;
};

// Which (item, bh) this warp owns among count * batch_heads; false when none.
__device__ __forceinline__ bool warp_item(int count, int batch_heads, int& item, int& bh) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  if (g >= static_cast<int64_t>(count) * batch_heads) return false;
  item = static_cast<int>(g / batch_heads);
  bh = static_cast<int>(g % batch_heads);
  return true;
}

__device__ __forceinline__ Piece load_piece(const Schedule& s, int item) {
  const int32_t* f = s.pieces + static_cast<int64_t>(item) * kPieceFields;
  return {f[0], f[1], f[2], f[3], f[4] != 0};
}

__device__ __forceinline__ Merge load_merge(const Schedule& s, int item) {
  const int32_t* f = s.merges + static_cast<int64_t>(item) * kMergeFields;
  return {f[0], f[1], f[2], f[3] != 0};
}

// start of a split row's workspace slot of `width` floats
__device__ __forceinline__ int64_t slot_offset(const Schedule& s, int bh, int slot, int width) {
  return (static_cast<int64_t>(bh) * s.num_slots + slot) * width;
}

template <typename T>
__device__ __forceinline__ bool key_present(const Params<T>& p, int b, int key) {
  return p.key_padding_mask == nullptr ||
         !p.key_padding_mask[static_cast<int64_t>(b) * p.num_nodes + key];
}

template <typename T>
__device__ __forceinline__ float dropout_factor(const Params<T>& p, const RngState& rng, int bh,
                                                int edge) {
  if (!p.dropout) return 1.f;
  const uint64_t counter =
      rng.offset + static_cast<uint64_t>(bh) * static_cast<uint64_t>(p.num_edges) +
      static_cast<uint64_t>(edge);
  return dropout_bits(rng.seed, counter) >= p.drop_threshold ? p.keep_scale : 0.f;
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

// Forward over one query piece. A whole row writes out and lse; a piece of a split row
// writes (running max, denominator, unnormalised accumulator) to its slot of `partial`
// ([batch_heads, num_slots, D + 2]).
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    forward_kernel(const Params<T> p, const Schedule s, T* __restrict__ out,
                   float* __restrict__ lse, float* __restrict__ partial) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  int item, bh;
  if (!warp_item(s.num_pieces, p.batch_heads, item, bh)) return;  // whole warp leaves
  const Piece piece = load_piece(s, item);
  const int b = bh / p.heads;
  const int64_t row_base = static_cast<int64_t>(bh) * p.num_nodes;
  const RngState rng = load_rng(p);

  float q[VEC];
  load_scaled_query<T, VEC>(p, row_base + piece.row, lane, q);

  float running_max = -INFINITY, denom = 0.f;
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;

  for (int e0 = piece.begin; e0 < piece.end; e0 += kEdgesPerStep) {
    float score[kEdgesPerStep];
    float val[kEdgesPerStep][VEC];
    bool valid[kEdgesPerStep];
#pragma unroll
    for (int c = 0; c < kEdgesPerStep; ++c) {
      const int e = e0 + c;
      valid[c] = e < piece.end;
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
      const float weight = prob * dropout_factor(p, rng, bh, e0 + c);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = fmaf(weight, val[c][i], acc[i]);
    }
    running_max = step_max;
  }

  if (piece.slot >= 0) {
    float* dst = partial + slot_offset(s, bh, piece.slot, D + 2);
    if (lane == 0) {
      dst[0] = running_max;
      dst[1] = denom;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[2 + lane * VEC + i] = acc[i];
    return;
  }
  // denom >= 1 whenever a neighbour was present (the max term contributes exp(0))
  const int64_t row = row_base + piece.row;
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] *= inv;
  store_vec<T, VEC>(out + row * D + lane * VEC, acc);
  if (lane == 0) lse[row] = denom > 0.f ? running_max + __logf(denom) : -INFINITY;
}

// Combines the slots of each split query row by log-sum-exp into out and lse.
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    forward_merge_kernel(const Params<T> p, const Schedule s, T* __restrict__ out,
                         float* __restrict__ lse, const float* __restrict__ partial) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  int item, bh;
  if (!warp_item(s.num_merges, p.batch_heads, item, bh)) return;
  const Merge merge = load_merge(s, item);

  float row_max = -INFINITY;
  for (int j = 0; j < merge.num_slots; ++j)
    row_max = fmaxf(row_max, partial[slot_offset(s, bh, merge.first_slot + j, D + 2)]);
  float denom = 0.f, acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  if (row_max != -INFINITY) {
    for (int j = 0; j < merge.num_slots; ++j) {
      const float* src = partial + slot_offset(s, bh, merge.first_slot + j, D + 2);
      if (src[0] == -INFINITY) continue;  // no present key in this piece
      const float weight = __expf(src[0] - row_max);
      denom = fmaf(weight, src[1], denom);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = fmaf(weight, src[2 + lane * VEC + i], acc[i]);
    }
  }
  const int64_t row = static_cast<int64_t>(bh) * p.num_nodes + merge.row;
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] *= inv;
  store_vec<T, VEC>(out + row * D + lane * VEC, acc);
  if (lane == 0) lse[row] = denom > 0.f ? row_max + __logf(denom) : -INFINITY;
}

// dQ and the per-type sums G of dS for one query piece. A whole row writes grad_q and its
// G row; a piece of a split row writes its dQ to `partial` ([batch_heads, num_slots, D])
// and its G to `type_partial` ([batch_heads, num_slots, T], zero-filled).
// min 1 block per SM: without it ptxas capped sm_90's registers and spilled (fp16/bf16, D 32/64)
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock, 1)
    backward_query_kernel(const Params<T> p, const Schedule s, const T* __restrict__ grad_out,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ grad_q, float* __restrict__ type_grad_sums,
                          float* __restrict__ partial, float* __restrict__ type_partial) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  int item, bh;
  if (!warp_item(s.num_pieces, p.batch_heads, item, bh)) return;
  const Piece piece = load_piece(s, item);
  const int b = bh / p.heads;
  const int64_t row_base = static_cast<int64_t>(bh) * p.num_nodes;
  const int64_t row = row_base + piece.row;
  const RngState rng = load_rng(p);
  // where this piece's per-type sums go (nowhere for a single-type row: they are zero)
  float* type_dst = nullptr;
  if (type_grad_sums != nullptr && piece.multi_type) {
    type_dst = piece.slot < 0 ? type_grad_sums + row * p.num_edge_types
                              : type_partial + slot_offset(s, bh, piece.slot, p.num_edge_types);
  }

  float dq[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) dq[i] = 0.f;
  // G of this piece: lane L, slot s holds type type_base + s * kWarpSize + L
  const int type_base =
      piece.begin < piece.end ? p.edge_type[piece.begin] / kTypeWindow * kTypeWindow : 0;
  float type_sum[kTypeSlots];
#pragma unroll
  for (int s = 0; s < kTypeSlots; ++s) type_sum[s] = 0.f;

  const float row_lse = lse[row];
  if (row_lse != -INFINITY) {
    const float row_delta = delta[row];
    float q[VEC], dout[VEC];
    load_scaled_query<T, VEC>(p, row, lane, q);
    load_vec<T, VEC>(grad_out + row * D + lane * VEC, dout);

    for (int e0 = piece.begin; e0 < piece.end; e0 += kEdgesPerStep) {
      float score[kEdgesPerStep], dprob[kEdgesPerStep];
      float kk[kEdgesPerStep][VEC];
      bool valid[kEdgesPerStep];
      int type[kEdgesPerStep];
#pragma unroll
      for (int c = 0; c < kEdgesPerStep; ++c) {
        const int e = e0 + c;
        valid[c] = e < piece.end;
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
        const float dscore = prob * (dprob[c] * dropout_factor(p, rng, bh, e0 + c) - row_delta);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dq[i] = fmaf(dscore, kk[c][i], dq[i]);
#pragma unroll
        for (int s = 0; s < kTypeSlots; ++s)
          type_sum[s] += type[c] - type_base == s * kWarpSize + lane ? dscore : 0.f;
      }
    }
  }
  if (type_dst != nullptr) {  // one plain, coalesced store per (piece, type)
#pragma unroll
    for (int s = 0; s < kTypeSlots; ++s) {
      const int t = type_base + s * kWarpSize + lane;
      if (t < p.num_edge_types) type_dst[t] = type_sum[s];
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) dq[i] *= p.scale;
  if (piece.slot >= 0) {
    float* dst = partial + slot_offset(s, bh, piece.slot, D);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[lane * VEC + i] = dq[i];
    return;
  }
  store_vec<T, VEC>(grad_q + row * D + lane * VEC, dq);
}

// dK and dV for one key piece, over its out-edges (transposed CSR). A piece of a split key
// row writes dK then dV to `partial` ([batch_heads, num_slots, 2 D]).
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    backward_key_kernel(const Params<T> p, const Schedule s, const int32_t* __restrict__ t_query,
                        const int32_t* __restrict__ t_edge, const T* __restrict__ grad_out,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        T* __restrict__ grad_k, T* __restrict__ grad_v,
                        float* __restrict__ partial) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  int item, bh;
  if (!warp_item(s.num_pieces, p.batch_heads, item, bh)) return;
  const Piece piece = load_piece(s, item);
  const int key = piece.row;
  const int b = bh / p.heads;
  const int64_t row_base = static_cast<int64_t>(bh) * p.num_nodes;
  const RngState rng = load_rng(p);

  float dk[VEC], dv[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) dk[i] = dv[i] = 0.f;

  if (key_present(p, b, key)) {
    float kbase[VEC], val[VEC];
    load_vec<T, VEC>(p.k + (row_base + key) * D + lane * VEC, kbase);
    load_vec<T, VEC>(p.v + (row_base + key) * D + lane * VEC, val);

    for (int j0 = piece.begin; j0 < piece.end; j0 += kEdgesPerStep) {
      float score[kEdgesPerStep], dprob[kEdgesPerStep];
      float q[kEdgesPerStep][VEC], dout[kEdgesPerStep][VEC];
      float row_lse[kEdgesPerStep], row_delta[kEdgesPerStep];
      int edge[kEdgesPerStep];
      bool valid[kEdgesPerStep];
#pragma unroll
      for (int c = 0; c < kEdgesPerStep; ++c) {
        const int j = j0 + c;
        valid[c] = j < piece.end;
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
        const float keep = dropout_factor(p, rng, bh, edge[c]);
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
  if (piece.slot >= 0) {
    float* dst = partial + slot_offset(s, bh, piece.slot, 2 * D);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      dst[lane * VEC + i] = dk[i];
      dst[D + lane * VEC + i] = dv[i];
    }
    return;
  }
  const int64_t out_row = row_base + key;
  store_vec<T, VEC>(grad_k + out_row * D + lane * VEC, dk);
  store_vec<T, VEC>(grad_v + out_row * D + lane * VEC, dv);
}

// Sums the slots of each split row into its gradient row(s), in slot order: one vector
// (dQ, with the type sums G when given) or two (dK then dV).
template <typename T, int D>
__global__ void __launch_bounds__(kWarpSize * kWarpsPerBlock)
    backward_merge_kernel(const Params<T> p, const Schedule s, const float* __restrict__ partial,
                          T* __restrict__ first, T* __restrict__ second,
                          const float* __restrict__ type_partial,
                          float* __restrict__ type_grad_sums) {
  constexpr int VEC = D / kWarpSize;
  const int lane = threadIdx.x;
  int item, bh;
  if (!warp_item(s.num_merges, p.batch_heads, item, bh)) return;
  const Merge merge = load_merge(s, item);
  const int64_t row = static_cast<int64_t>(bh) * p.num_nodes + merge.row;
  const int vectors = second == nullptr ? 1 : 2;
  for (int which = 0; which < vectors; ++which) {
    float sum[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) sum[i] = 0.f;
    for (int j = 0; j < merge.num_slots; ++j) {
      const float* src = partial + slot_offset(s, bh, merge.first_slot + j, vectors * D) +
                         which * D + lane * VEC;
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum[i] += src[i];
    }
    store_vec<T, VEC>((which == 0 ? first : second) + row * D + lane * VEC, sum);
  }
  if (type_grad_sums != nullptr && merge.multi_type) {
    for (int t = lane; t < p.num_edge_types; t += kWarpSize) {
      float sum = 0.f;
      for (int j = 0; j < merge.num_slots; ++j)
        sum += type_partial[slot_offset(s, bh, merge.first_slot + j, p.num_edge_types) + t];
      type_grad_sums[row * p.num_edge_types + t] = sum;
    }
  }
}

template <typename T>
Params<T> make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& rel_key, const at::Tensor& indices,
                      const at::Tensor& edge_type,
                      const c10::optional<at::Tensor>& key_padding_mask, double scale,
                      double dropout_p, const int64_t* rng) {
  Params<T> p;
  p.q = q.const_data_ptr<T>();
  p.k = k.const_data_ptr<T>();
  p.v = v.const_data_ptr<T>();
  p.rel_key = rel_key.has_value() ? rel_key->const_data_ptr<T>() : nullptr;
  p.indices = indices.const_data_ptr<int32_t>();
  p.edge_type = edge_type.const_data_ptr<int32_t>();
  p.key_padding_mask =
      key_padding_mask.has_value() ? key_padding_mask->const_data_ptr<bool>() : nullptr;
  p.batch_heads = static_cast<int>(q.size(0) * q.size(1));
  p.heads = static_cast<int>(q.size(1));
  p.num_nodes = static_cast<int>(q.size(2));
  p.num_edges = static_cast<int>(indices.numel());
  p.num_edge_types = rel_key.has_value() ? static_cast<int>(rel_key->size(0)) : 0;
  p.scale = static_cast<float>(scale);
  p.dropout = dropout_p > 0.0;
  // keep iff bits >= p * 2^32; dropout_p < 1 is checked by the caller
  p.drop_threshold = static_cast<uint32_t>(dropout_p * 4294967296.0);
  p.keep_scale = p.dropout ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.f;
  p.rng = rng;
  return p;
}

Schedule make_schedule(const WorkSchedule& w) {
  return {w.pieces.const_data_ptr<int32_t>(), w.merges.const_data_ptr<int32_t>(),
          static_cast<int>(w.pieces.size(0)), static_cast<int>(w.merges.size(0)),
          static_cast<int>(w.num_slots)};
}

// blocks for one warp per (item, batch * head); the binding bounds this below 2^31
dim3 grid_for(int64_t items, int64_t batch_heads) {
  return dim3(static_cast<unsigned>((items * batch_heads + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

const dim3 kBlock(kWarpSize, kWarpsPerBlock);

const int64_t* rng_pointer(const c10::optional<at::Tensor>& rng) {
  return rng.has_value() ? rng->const_data_ptr<int64_t>() : nullptr;
}

// float32 workspace of `width` floats per (batch * head, slot); zero-filled when asked
at::Tensor workspace(const at::Tensor& q, const WorkSchedule& w, int64_t width, bool zero) {
  const auto options = q.options().dtype(at::kFloat);
  const std::vector<int64_t> shape{q.size(0) * q.size(1), w.num_slots, width};
  return zero ? at::zeros(shape, options) : at::empty(shape, options);
}

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
                    const c10::optional<at::Tensor>& rel_key, const at::Tensor& indices,
                    const at::Tensor& edge_type, const WorkSchedule& by_query,
                    const c10::optional<at::Tensor>& key_padding_mask, double scale,
                    double dropout_p, const c10::optional<at::Tensor>& rng, at::Tensor& out,
                    at::Tensor& lse) {
  GA_DEVICE_GUARD(q);
  if (q.numel() == 0) return;
  const int64_t batch_heads = q.size(0) * q.size(1);
  const at::Tensor partial = workspace(q, by_query, q.size(3) + 2, false);
  GRAPH_ATTENTION_DISPATCH_DTYPE(q.scalar_type(), "graph_attention_forward", [&] {
    const auto p = make_params<scalar_t>(q, k, v, rel_key, indices, edge_type, key_padding_mask,
                                         scale, dropout_p, rng_pointer(rng));
    const Schedule s = make_schedule(by_query);
    GRAPH_ATTENTION_DISPATCH_HEAD_DIM(q.size(3), [&] {
      auto* forward = &forward_kernel<scalar_t, kHeadDim>;
      GA_LAUNCH(forward, grid_for(s.num_pieces, batch_heads), kBlock, p, s,
                out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<float>(),
                partial.mutable_data_ptr<float>());
      if (s.num_merges > 0) {
        auto* merge = &forward_merge_kernel<scalar_t, kHeadDim>;
        GA_LAUNCH(merge, grid_for(s.num_merges, batch_heads), kBlock, p, s,
                  out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<float>(),
                  partial.const_data_ptr<float>());
      }
    });
  });
}

void launch_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const c10::optional<at::Tensor>& rel_key,
                     const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& indices,
                     const at::Tensor& edge_type, const WorkSchedule& by_query,
                     const at::Tensor& t_query, const at::Tensor& t_edge,
                     const WorkSchedule& by_key,
                     const c10::optional<at::Tensor>& key_padding_mask, double scale,
                     double dropout_p, const c10::optional<at::Tensor>& rng, at::Tensor& grad_q,
                     at::Tensor& grad_k, at::Tensor& grad_v,
                     const c10::optional<at::Tensor>& type_grad_sums) {
  GA_DEVICE_GUARD(q);
  if (q.numel() == 0) return;
  const int64_t batch_heads = q.size(0) * q.size(1), head_dim = q.size(3);
  const at::Tensor query_partial = workspace(q, by_query, head_dim, false);
  const at::Tensor key_partial = workspace(q, by_key, 2 * head_dim, false);
  const bool types = type_grad_sums.has_value();
  const at::Tensor type_partial =
      workspace(q, by_query, types ? rel_key->size(0) : 0, types);
  float* sums = types ? type_grad_sums->mutable_data_ptr<float>() : nullptr;
  GRAPH_ATTENTION_DISPATCH_DTYPE(q.scalar_type(), "graph_attention_backward", [&] {
    const auto p = make_params<scalar_t>(q, k, v, rel_key, indices, edge_type, key_padding_mask,
                                         scale, dropout_p, rng_pointer(rng));
    const Schedule sq = make_schedule(by_query), sk = make_schedule(by_key);
    GRAPH_ATTENTION_DISPATCH_HEAD_DIM(head_dim, [&] {
      auto* by_query_kernel = &backward_query_kernel<scalar_t, kHeadDim>;
      GA_LAUNCH(by_query_kernel, grid_for(sq.num_pieces, batch_heads), kBlock, p, sq,
                grad_out.const_data_ptr<scalar_t>(), lse.const_data_ptr<float>(),
                delta.const_data_ptr<float>(), grad_q.mutable_data_ptr<scalar_t>(), sums,
                query_partial.mutable_data_ptr<float>(), type_partial.mutable_data_ptr<float>());
      auto* by_key_kernel = &backward_key_kernel<scalar_t, kHeadDim>;
      GA_LAUNCH(by_key_kernel, grid_for(sk.num_pieces, batch_heads), kBlock, p, sk,
                t_query.const_data_ptr<int32_t>(), t_edge.const_data_ptr<int32_t>(),
                grad_out.const_data_ptr<scalar_t>(), lse.const_data_ptr<float>(),
                delta.const_data_ptr<float>(), grad_k.mutable_data_ptr<scalar_t>(),
                grad_v.mutable_data_ptr<scalar_t>(), key_partial.mutable_data_ptr<float>());
      auto* merge = &backward_merge_kernel<scalar_t, kHeadDim>;
      if (sq.num_merges > 0) {
        GA_LAUNCH(merge, grid_for(sq.num_merges, batch_heads), kBlock, p, sq,
                  query_partial.const_data_ptr<float>(), grad_q.mutable_data_ptr<scalar_t>(),
                  static_cast<scalar_t*>(nullptr), type_partial.const_data_ptr<float>(), sums);
      }
      if (sk.num_merges > 0) {
        GA_LAUNCH(merge, grid_for(sk.num_merges, batch_heads), kBlock, p, sk,
                  key_partial.const_data_ptr<float>(), grad_k.mutable_data_ptr<scalar_t>(),
                  grad_v.mutable_data_ptr<scalar_t>(), static_cast<const float*>(nullptr),
                  static_cast<float*>(nullptr));
      }
    });
  });
}

}  // namespace graph_attention_cuda
