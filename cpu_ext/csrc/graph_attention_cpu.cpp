// Flash-style graph attention on CPU over the tiles of a TilePlan
// (fairseq_plugins/graph_attention/tile_plan.py; the Python glue is cpu_backend.py).
//
// A query block (block_m query slots, in tree order) reads a few tiles of block_n
// consecutive key nodes; a tile's int16 types say which (row, key) pairs are edges and which
// relative key they add (-1 = no edge). Keys of a tile are contiguous rows of K and V, so the
// products run on pointers into the inputs (keys transposed into a tile buffer where a
// product needs them so): no [rows x keys] storage. Only the
// log-sum-exp per row is saved; the backward recomputes the probabilities (FA2):
//   forward      per (batch x head, query work item): online softmax, O, lse
//   backward dQ  per (batch x head, query work item): dS = P (dP - Delta), dQ = dS K, and the
//                dS summed per (row, type) for the relative keys
//   backward dKV per (batch x head, key work item): the transposed tiles ("windows"),
//                dV = P^T dO, dK = dS^T Q
// Work items write disjoint rows (parts of split blocks go to part buffers that the glue
// merges in a fixed order) and d rel_key sums per fixed chunk of work, so the results do not
// depend on the number of threads. Dropout keeps an edge when a hash of (seed, batch x head,
// query node, key node) is at least p: the backward regenerates the forward's mask.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

namespace {

// Every product (tiles of 32 x 32 x 64 and alike): a register-blocked kernel, C[m, n] (+)=
// alpha A[m, k] B[k, n], row-major with leading dimensions. MKL's sgemm packs both operands
// on every call at these sizes (a third of its time, on the AMD EPYC measured) and its
// results changed with the thread count; this kernel keeps kRows x 2 vectors of C in
// registers, reads A and B in place, and sums in one fixed order.
// 32-byte GCC vectors (attributes on a dependent type would be ignored, hence one typedef
// per scalar type), loaded and stored unaligned through memcpy
typedef float VecFloat __attribute__((vector_size(32)));
typedef double VecDouble __attribute__((vector_size(32)));
template <typename T>
using Vec = std::conditional_t<std::is_same_v<T, float>, VecFloat, VecDouble>;

template <typename T>
inline Vec<T> load(const T* from) {
  Vec<T> v;
  std::memcpy(&v, from, sizeof(v));
  return v;
}

template <typename T>
inline void store(T* to, const Vec<T>& v) {
  std::memcpy(to, &v, sizeof(v));
}
constexpr int kRows = 6;  // 6 x 2 accumulators + 2 of B + 1 of A: 15 of the 16 AVX2 registers

template <typename T, int Rows>
inline void gemm_rows(int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                      int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  constexpr int64_t lanes = 32 / sizeof(T), width = 2 * lanes;
  int64_t j = 0;
  for (; j + width <= n; j += width) {
    Vec<T> acc[Rows][2] = {};
    for (int64_t p = 0; p < k; ++p) {
      const Vec<T> b0 = load(b + p * ldb + j), b1 = load(b + p * ldb + j + lanes);
      for (int r = 0; r < Rows; ++r) {
        const T x = a[r * lda + p];
        acc[r][0] += x * b0;
        acc[r][1] += x * b1;
      }
    }
    for (int r = 0; r < Rows; ++r) {
      for (int h = 0; h < 2; ++h) {
        T* out = c + r * ldc + j + h * lanes;
        store(out, accumulate ? load(out) + alpha * acc[r][h] : alpha * acc[r][h]);
      }
    }
  }
  for (; j + lanes <= n; j += lanes) {  // one vector of columns left over
    Vec<T> acc[Rows] = {};
    for (int64_t p = 0; p < k; ++p) {
      const Vec<T> b0 = load(b + p * ldb + j);
      for (int r = 0; r < Rows; ++r) acc[r] += a[r * lda + p] * b0;
    }
    for (int r = 0; r < Rows; ++r) {
      T* out = c + r * ldc + j;
      store(out, accumulate ? load(out) + alpha * acc[r] : alpha * acc[r]);
    }
  }
  for (; j < n; ++j) {  // the columns left over
    for (int r = 0; r < Rows; ++r) {
      T sum = 0;
      for (int64_t p = 0; p < k; ++p) sum += a[r * lda + p] * b[p * ldb + j];
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + alpha * sum : alpha * sum;
    }
  }
}

template <typename T>
void tile_gemm(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    gemm_rows<T, kRows>(n, k, alpha, a + i * lda, lda, b, ldb, accumulate, c + i * ldc, ldc);
  }
  a += i * lda;
  c += i * ldc;
  switch (m - i) {  // the rows left over
    case 5: return gemm_rows<T, 5>(n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
    case 4: return gemm_rows<T, 4>(n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
    case 3: return gemm_rows<T, 3>(n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
    case 2: return gemm_rows<T, 2>(n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
    case 1: return gemm_rows<T, 1>(n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
}

// dst[d, rows] (leading dimension ld) = src[rows, d]^T: the B operand of A src^T.
template <typename T>
void transpose_rows(const T* src, int64_t rows, int64_t d, T* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < d; ++j) dst[j * ld + r] = src[r * d + j];
  }
}

// exp for the softmax: float uses a Cephes-style polynomial (relative error ~2e-7, like
// expf) that the compiler vectorizes, where a call to expf per score entry dominated the
// kernel; below -87.3 (masked entries: -inf) it is exactly 0. double (the tests) uses std::exp.
inline float softmax_exp(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &poly, 4);
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, 4);
  return x < -87.3f ? 0.0f : result;
}
inline double softmax_exp(double x) { return std::exp(x); }

// A work item's buffers, 64-byte aligned (whole cache lines: no false sharing between threads).
template <typename T>
struct Scratch {
  std::unique_ptr<T, decltype(&std::free)> data{nullptr, &std::free};
  explicit Scratch(int64_t n) {
    size_t bytes = ((std::max<int64_t>(n, 1) * sizeof(T) + 63) / 64) * 64;
    data.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(data, "graph_attention_cpu: out of memory");
  }
  T* get() const { return data.get(); }
};

// Keep (query node, key node) of batch x head bh: splitmix64 of the counter, top 24 bits.
inline bool keep_edge(uint64_t seed, int64_t bh, int64_t n, int64_t row, int64_t key,
                      uint32_t threshold) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + (static_cast<uint64_t>(bh * n + row) * n + key);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<uint32_t>(x >> 40) >= threshold;
}

// What every pass reads: inputs, the plan, scalars.
template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  const T* rel;          // [types, D] or nullptr
  const uint8_t* pad;    // [B, N], 1 = absent key, or nullptr
  const int32_t* slot_node;
  int64_t num_slots, heads, n, d, bm, bn;
  T scale;
  double dropout_p;
  uint64_t seed;
  uint32_t threshold;  // dropout keeps a hash >= threshold (of 2^24)
  T keep_scale;        // 1 / (1 - p)

  bool absent(int64_t bh, int64_t key) const { return pad && pad[(bh / heads) * n + key]; }
  bool keep(int64_t bh, int64_t row, int64_t key) const {
    return dropout_p <= 0 || keep_edge(seed, bh, n, row, key, threshold);
  }
};

// One side of the tiles: items [I, 4] = (block, first tile, end tile, part), each tile's first
// column and its [bm, bn] types.
struct Tiles {
  const int32_t* items;
  int64_t num_items;
  const int32_t* start;
  const int16_t* types;
};

// The type range [lo, hi] used by tiles [t0, t1) (lo > hi when none): the relative-key
// products of a block only span it.
inline std::pair<int64_t, int64_t> type_range(const Tiles& tiles, int64_t t0, int64_t t1,
                                              int64_t tile_size) {
  // as unsigned, no edge (-1) is the largest value: min skips it, max is taken over signed
  uint16_t lo = 0xFFFF;
  int16_t hi = -1;
  const int16_t* types = tiles.types + t0 * tile_size;
  const int64_t count = (t1 - t0) * tile_size;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t i = 0; i < count; ++i) {
    lo = std::min(lo, static_cast<uint16_t>(types[i]));
    hi = std::max(hi, types[i]);
  }
  return {lo, hi};
}

// Rows of query slots [first, first + rows) of batch x head bh gathered into dst (zeros for
// empty slots), with their graph nodes.
template <typename T>
void gather_slots(const Problem<T>& p, const T* src, int64_t bh, int64_t first, int64_t rows,
                  T* dst, int64_t* node) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t slot = first + r;
    node[r] = slot < p.num_slots ? p.slot_node[slot] : -1;
    if (node[r] >= 0) {
      std::copy_n(src + (bh * p.n + node[r]) * p.d, p.d, dst + r * p.d);
    } else {
      std::fill_n(dst + r * p.d, p.d, T(0));
    }
  }
}

// scale * q_r . rel_key[t] for the block's rows and types [lo, lo + width).
template <typename T>
void relative_scores(const Problem<T>& p, const T* rows, int64_t count, int64_t lo,
                     int64_t width, T* out) {
  Scratch<T> rel_t(p.d * width);
  transpose_rows(p.rel + lo * p.d, width, p.d, rel_t.get(), width);
  tile_gemm<T>(count, width, p.d, p.scale, rows, p.d, rel_t.get(), width, false, out, width);
}

// Scores of a tile in place: scale * q . k (already in s) + relative term, -inf off the graph
// (no edge, or an absent key). keys_are_rows: the key-major (transposed) tiles.
template <typename T>
void finish_scores(const Problem<T>& p, int64_t bh, const int16_t* types, int64_t rows,
                   int64_t cols, int64_t first_key, const T* rel_scores, int64_t rel_lo,
                   int64_t rel_width, T* s, bool keys_are_rows) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  bool column_absent[1024];  // block sizes are at most 1024 (checked in make_problem)
  for (int64_t c = 0; c < cols; ++c) column_absent[c] = !keys_are_rows && p.absent(bh, first_key + c);
  for (int64_t r = 0; r < rows; ++r) {
    T* x = s + r * p.bn;
    const int16_t* type = types + r * p.bn;
    const bool row_absent = keys_are_rows && p.absent(bh, first_key + r);
    if (p.rel) {
      const T* rel_row = rel_scores + r * rel_width - rel_lo;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const bool off = type[c] < 0 || row_absent || column_absent[c];
        const T rel = off ? T(0)
                          : (keys_are_rows ? rel_scores[c * rel_width + type[c] - rel_lo]
                                           : rel_row[type[c]]);
        x[c] = off ? neg_inf : x[c] + rel;
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        x[c] = (type[c] < 0 || row_absent || column_absent[c]) ? neg_inf : x[c];
      }
    }
  }
}

// ------------------------------------------------------------------------------ forward

template <typename T>
void forward_item(const Problem<T>& p, const Tiles& tiles, int64_t bh, int64_t item, T* out,
                  T* lse, T* part_out, T* part_lse, int64_t bh_total) {
  const int32_t* it = tiles.items + 4 * item;
  const int64_t block = it[0], t0 = it[1], t1 = it[2], part = it[3];
  const int64_t bm = p.bm, bn = p.bn, d = p.d;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  Scratch<T> q_rows(bm * d), acc(bm * d), s(bm * bn), packed(d * bn), row_max(bm), row_sum(bm);
  std::unique_ptr<int64_t[]> node(new int64_t[bm]);
  gather_slots(p, p.q, bh, block * bm, bm, q_rows.get(), node.get());
  auto [lo, hi] = p.rel ? type_range(tiles, t0, t1, bm * bn) : std::pair<int64_t, int64_t>{0, -1};
  const int64_t width = p.rel && hi >= lo ? hi - lo + 1 : 0;
  Scratch<T> rel_scores(bm * width);
  if (width) relative_scores(p, q_rows.get(), bm, lo, width, rel_scores.get());
  std::fill_n(acc.get(), bm * d, T(0));
  std::fill_n(row_max.get(), bm, neg_inf);
  std::fill_n(row_sum.get(), bm, T(0));
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t first = tiles.start[t], cols = std::min(bn, p.n - first);
    const T* keys = p.k + (bh * p.n + first) * d;
    transpose_rows(keys, cols, d, packed.get(), bn);
    tile_gemm<T>(bm, cols, d, p.scale, q_rows.get(), d, packed.get(), bn, false, s.get(), bn);
    finish_scores(p, bh, tiles.types + t * bm * bn, bm, cols, first, rel_scores.get(), lo,
                  width, s.get(), false);
    for (int64_t r = 0; r < bm; ++r) {
      T* x = s.get() + r * bn;
      T m = row_max.get()[r];
#pragma omp simd reduction(max : m)
      for (int64_t c = 0; c < cols; ++c) m = std::max(m, x[c]);
      if (m == neg_inf) {  // no key yet
        std::fill_n(x, cols, T(0));
        continue;
      }
      const T alpha = softmax_exp(row_max.get()[r] - m);
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        x[c] = softmax_exp(x[c] - m);
        sum += x[c];
      }
      if (p.dropout_p > 0) {
        for (int64_t c = 0; c < cols; ++c) {
          x[c] = p.keep(bh, node[r], first + c) ? x[c] * p.keep_scale : T(0);
        }
      }
      row_sum.get()[r] = row_sum.get()[r] * alpha + sum;
      row_max.get()[r] = m;
      if (alpha != T(1)) {
        for (int64_t j = 0; j < d; ++j) acc.get()[r * d + j] *= alpha;
      }
    }
    tile_gemm<T>(bm, d, cols, T(1), s.get(), bn, p.v + (bh * p.n + first) * d, d, true,
                 acc.get(), d);
  }
  for (int64_t r = 0; r < bm; ++r) {
    const T l = row_sum.get()[r];
    const T inv = l > 0 ? T(1) / l : T(0);
    const T row_lse = l > 0 ? row_max.get()[r] + std::log(l)
                            : (part >= 0 ? neg_inf : std::numeric_limits<T>::infinity());
    T* o;
    if (part >= 0) {
      o = part_out + ((part * bh_total + bh) * bm + r) * d;
      part_lse[(part * bh_total + bh) * bm + r] = row_lse;
    } else if (node[r] >= 0) {
      o = out + (bh * p.n + node[r]) * d;
      lse[bh * p.n + node[r]] = row_lse;
    } else {
      continue;
    }
    for (int64_t j = 0; j < d; ++j) o[j] = acc.get()[r * d + j] * inv;
  }
}

// ---------------------------------------------------------------------- backward, dQ

// lse, delta and graph node of a tile's query rows (or columns, in the key-major tiles).
template <typename T>
struct RowStats {
  const T* lse;
  const T* delta;
  const int64_t* node;
};

// P and dS of one tile from the scores in s (in place: s becomes P) and dP in dp (becomes dS);
// with dropout, p_dropped (if given) gets P masked and scaled. Rows and columns are (query, key), or
// (key, query) in the key-major tiles. lse = +inf (a row without keys, an empty slot) gives 0.
template <typename T>
void probabilities_and_grads(const Problem<T>& p, int64_t bh, int64_t rows, int64_t cols,
                             const RowStats<T>& stats, bool query_is_row, int64_t first_key,
                             T* s, T* dp, T* p_dropped) {
  for (int64_t r = 0; r < rows; ++r) {
    T* x = s + r * p.bn;
    T* g = dp + r * p.bn;
    if (p.dropout_p > 0) {  // dP of a dropped edge is 0, of a kept one scaled
      for (int64_t c = 0; c < cols; ++c) {
        const bool keep = query_is_row ? p.keep(bh, stats.node[r], first_key + c)
                                       : p.keep(bh, stats.node[c], first_key + r);
        g[c] = keep ? g[c] * p.keep_scale : T(0);
        if (p_dropped) p_dropped[r * p.bn + c] = keep ? p.keep_scale : T(0);
      }
    }
    if (query_is_row) {
      const T lse = stats.lse[r], delta = stats.delta[r];
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        x[c] = softmax_exp(x[c] - lse);
        g[c] = x[c] * (g[c] - delta);
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        x[c] = softmax_exp(x[c] - stats.lse[c]);
        g[c] = x[c] * (g[c] - stats.delta[c]);
      }
    }
    if (p_dropped) {
      for (int64_t c = 0; c < cols; ++c) p_dropped[r * p.bn + c] *= x[c];
    }
  }
}

// lse and delta of the slots' rows ([rows]); an empty slot gets lse = +inf (P = 0).
template <typename T>
void gather_row_stats(const Problem<T>& p, const T* lse, const T* delta, int64_t bh,
                      const int64_t* node, int64_t rows, T* lse_out, T* delta_out) {
  for (int64_t r = 0; r < rows; ++r) {
    lse_out[r] = node[r] >= 0 ? lse[bh * p.n + node[r]] : std::numeric_limits<T>::infinity();
    delta_out[r] = node[r] >= 0 ? delta[bh * p.n + node[r]] : T(0);
  }
}

template <typename T>
void backward_query_item(const Problem<T>& p, const Tiles& tiles, int64_t bh, int64_t item,
                         const T* grad_out, const T* lse, const T* delta, T* grad_q,
                         T* part_grad_q, T* grad_rel, int64_t bh_total) {
  const int32_t* it = tiles.items + 4 * item;
  const int64_t block = it[0], t0 = it[1], t1 = it[2], part = it[3];
  const int64_t bm = p.bm, bn = p.bn, d = p.d;
  Scratch<T> q_rows(bm * d), go_rows(bm * d), acc(bm * d), s(bm * bn), dp(bm * bn);
  Scratch<T> packed(d * bn), row_lse(bm), row_delta(bm);
  std::unique_ptr<int64_t[]> node(new int64_t[bm]);
  gather_slots(p, p.q, bh, block * bm, bm, q_rows.get(), node.get());
  gather_slots(p, grad_out, bh, block * bm, bm, go_rows.get(), node.get());
  gather_row_stats(p, lse, delta, bh, node.get(), bm, row_lse.get(), row_delta.get());
  auto [lo, hi] = p.rel ? type_range(tiles, t0, t1, bm * bn) : std::pair<int64_t, int64_t>{0, -1};
  const int64_t width = p.rel && hi >= lo ? hi - lo + 1 : 0;
  Scratch<T> rel_scores(bm * width), type_grad(bm * width);
  if (width) relative_scores(p, q_rows.get(), bm, lo, width, rel_scores.get());
  std::fill_n(type_grad.get(), bm * width, T(0));
  std::fill_n(acc.get(), bm * d, T(0));
  const RowStats<T> stats{row_lse.get(), row_delta.get(), node.get()};
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t first = tiles.start[t], cols = std::min(bn, p.n - first);
    const T* keys = p.k + (bh * p.n + first) * d;
    const int16_t* types = tiles.types + t * bm * bn;
    transpose_rows(keys, cols, d, packed.get(), bn);
    tile_gemm<T>(bm, cols, d, p.scale, q_rows.get(), d, packed.get(), bn, false, s.get(), bn);
    finish_scores(p, bh, types, bm, cols, first, rel_scores.get(), lo, width, s.get(), false);
    transpose_rows(p.v + (bh * p.n + first) * d, cols, d, packed.get(), bn);
    tile_gemm<T>(bm, cols, d, T(1), go_rows.get(), d, packed.get(), bn, false, dp.get(), bn);
    probabilities_and_grads(p, bh, bm, cols, stats, true, first, s.get(), dp.get(),
                            static_cast<T*>(nullptr));
    if (width) {
      for (int64_t r = 0; r < bm; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const int16_t type = types[r * bn + c];
          if (type >= 0) type_grad.get()[r * width + type - lo] += dp.get()[r * bn + c];
        }
      }
    }
    tile_gemm<T>(bm, d, cols, p.scale, dp.get(), bn, keys, d, true, acc.get(), d);
  }
  if (width) {  // dQ += scale G rel_key, d rel_key += scale G^T Q
    tile_gemm<T>(bm, d, width, p.scale, type_grad.get(), width, p.rel + lo * d, d, true,
                 acc.get(), d);
    Scratch<T> type_grad_t(width * bm);
    transpose_rows(type_grad.get(), bm, width, type_grad_t.get(), bm);
    tile_gemm<T>(width, d, bm, p.scale, type_grad_t.get(), bm, q_rows.get(), d, true,
                 grad_rel + lo * d, d);
  }
  for (int64_t r = 0; r < bm; ++r) {
    T* g;
    if (part >= 0) {
      g = part_grad_q + ((part * bh_total + bh) * bm + r) * d;
    } else if (node[r] >= 0) {
      g = grad_q + (bh * p.n + node[r]) * d;
    } else {
      continue;
    }
    std::copy_n(acc.get() + r * d, d, g);
  }
}

// --------------------------------------------------------------------- backward, dK dV

template <typename T>
void backward_key_item(const Problem<T>& p, const Tiles& windows, int64_t bh, int64_t item,
                       const T* grad_out, const T* lse, const T* delta, T* grad_k, T* grad_v,
                       T* part_grad_k, T* part_grad_v, int64_t bh_total) {
  const int32_t* it = windows.items + 4 * item;
  const int64_t block = it[0], w0 = it[1], w1 = it[2], part = it[3];
  const int64_t bm = p.bm, bn = p.bn, d = p.d;
  const int64_t first_key = block * bm, keys = std::min(bm, p.n - first_key);
  const T* k_rows = p.k + (bh * p.n + first_key) * d;
  const T* v_rows = p.v + (bh * p.n + first_key) * d;
  Scratch<T> q_rows(bn * d), go_rows(bn * d), acc_k(bm * d), acc_v(bm * d);
  Scratch<T> s(bm * bn), dp(bm * bn), p_dropped(bm * bn), packed(d * bn), row_lse(bn),
      row_delta(bn);
  std::unique_ptr<int64_t[]> node(new int64_t[bn]);
  std::fill_n(acc_k.get(), bm * d, T(0));
  std::fill_n(acc_v.get(), bm * d, T(0));
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t first_slot = windows.start[w];
    const int16_t* types = windows.types + w * bm * bn;
    gather_slots(p, p.q, bh, first_slot, bn, q_rows.get(), node.get());
    gather_slots(p, grad_out, bh, first_slot, bn, go_rows.get(), node.get());
    gather_row_stats(p, lse, delta, bh, node.get(), bn, row_lse.get(), row_delta.get());
    auto [lo, hi] = p.rel ? type_range(windows, w, w + 1, bm * bn) : std::pair<int64_t, int64_t>{0, -1};
    const int64_t width = p.rel && hi >= lo ? hi - lo + 1 : 0;
    Scratch<T> rel_scores(bn * width);
    if (width) relative_scores(p, q_rows.get(), bn, lo, width, rel_scores.get());
    // S^T [keys, slots] = scale K Q^T (+ relative term), dP^T = V dO^T
    transpose_rows(q_rows.get(), bn, d, packed.get(), bn);
    tile_gemm<T>(keys, bn, d, p.scale, k_rows, d, packed.get(), bn, false, s.get(), bn);
    finish_scores(p, bh, types, keys, bn, first_key, rel_scores.get(), lo, width, s.get(), true);
    transpose_rows(go_rows.get(), bn, d, packed.get(), bn);
    tile_gemm<T>(keys, bn, d, T(1), v_rows, d, packed.get(), bn, false, dp.get(), bn);
    const RowStats<T> stats{row_lse.get(), row_delta.get(), node.get()};
    T* dropped = p.dropout_p > 0 ? p_dropped.get() : s.get();
    probabilities_and_grads(p, bh, keys, bn, stats, false, first_key, s.get(), dp.get(),
                            p.dropout_p > 0 ? p_dropped.get() : static_cast<T*>(nullptr));
    tile_gemm<T>(keys, d, bn, T(1), dropped, bn, go_rows.get(), d, true, acc_v.get(), d);
    tile_gemm<T>(keys, d, bn, p.scale, dp.get(), bn, q_rows.get(), d, true, acc_k.get(), d);
  }
  for (int64_t r = 0; r < keys; ++r) {
    T *gk, *gv;
    if (part >= 0) {
      gk = part_grad_k + ((part * bh_total + bh) * bm + r) * d;
      gv = part_grad_v + ((part * bh_total + bh) * bm + r) * d;
    } else {
      gk = grad_k + (bh * p.n + first_key + r) * d;
      gv = grad_v + (bh * p.n + first_key + r) * d;
    }
    std::copy_n(acc_k.get() + r * d, d, gk);
    std::copy_n(acc_v.get() + r * d, d, gv);
  }
}

// ------------------------------------------------------------------------------ bindings

struct Plan {
  at::Tensor slot_node, tile_start, tile_types, query_items, window_start, window_types,
      key_items;
  int64_t block_m, block_n;
};

Plan read_plan(const std::vector<at::Tensor>& tensors, int64_t block_m, int64_t block_n) {
  TORCH_CHECK(tensors.size() == 7, "graph_attention_cpu: the plan has 7 tensors");
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
                "graph_attention_cpu: plan tensors must be contiguous CPU tensors");
  }
  Plan plan{tensors[0], tensors[1], tensors[2], tensors[3], tensors[4], tensors[5], tensors[6],
            block_m, block_n};
  TORCH_CHECK(plan.slot_node.scalar_type() == at::kInt && plan.tile_start.scalar_type() == at::kInt &&
                  plan.query_items.scalar_type() == at::kInt &&
                  plan.window_start.scalar_type() == at::kInt &&
                  plan.key_items.scalar_type() == at::kInt &&
                  plan.tile_types.scalar_type() == at::kShort &&
                  plan.window_types.scalar_type() == at::kShort,
              "graph_attention_cpu: plan dtypes must be int32 (indices) and int16 (types)");
  return plan;
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
              "graph_attention_cpu: q, k, v must be [BH, N, D] of one shape");
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "graph_attention_cpu: q, k, v must be contiguous CPU tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "graph_attention_cpu: q, k, v must all be float32 or all float64");
}

template <typename T>
Problem<T> make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& rel, const c10::optional<at::Tensor>& pad,
                        const Plan& plan, int64_t heads, double scale, double dropout_p,
                        int64_t seed) {
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "graph_attention_cpu: dropout_p must be in [0, 1)");
  const int64_t n = q.size(1);
  if (rel) {
    TORCH_CHECK(rel->dim() == 2 && rel->size(1) == q.size(2) && rel->is_contiguous() &&
                    rel->scalar_type() == q.scalar_type(),
                "graph_attention_cpu: rel_key must be a contiguous [types, D] tensor of q's dtype");
  }
  if (pad) {
    TORCH_CHECK(pad->scalar_type() == at::kByte && pad->is_contiguous() &&
                    pad->numel() * heads == q.size(0) * n,
                "graph_attention_cpu: key padding must be a contiguous uint8 [B, N] tensor");
  }
  TORCH_CHECK(plan.block_m <= 1024 && plan.block_n <= 1024,
              "graph_attention_cpu: tiles are at most 1024 x 1024");
  TORCH_CHECK(plan.slot_node.numel() % plan.block_m == 0,
              "graph_attention_cpu: slots must fill whole blocks");
  return Problem<T>{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                    rel ? rel->data_ptr<T>() : nullptr,
                    pad ? pad->data_ptr<uint8_t>() : nullptr,
                    plan.slot_node.data_ptr<int32_t>(), plan.slot_node.numel(), heads, n,
                    q.size(2), plan.block_m, plan.block_n, static_cast<T>(scale), dropout_p,
                    static_cast<uint64_t>(seed),
                    static_cast<uint32_t>(std::llround(dropout_p * (1 << 24))),
                    static_cast<T>(1.0 / (1.0 - dropout_p))};
}

Tiles query_tiles(const Plan& plan) {
  return Tiles{plan.query_items.data_ptr<int32_t>(), plan.query_items.size(0),
               plan.tile_start.data_ptr<int32_t>(), plan.tile_types.data_ptr<int16_t>()};
}

Tiles key_tiles(const Plan& plan) {
  return Tiles{plan.key_items.data_ptr<int32_t>(), plan.key_items.size(0),
               plan.window_start.data_ptr<int32_t>(), plan.window_types.data_ptr<int16_t>()};
}

// Runs fn(bh, item) for every (batch x head, item) on torch's intra-op threads.
template <typename Fn>
void for_each_item(int64_t batch_heads, int64_t items, const Fn& fn) {
  at::parallel_for(0, batch_heads * items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) fn(u / items, u % items);
  });
}

// forward(q, k, v, rel, pad, plan, block_m, block_n, heads, parts, scale, dropout_p, seed)
//   -> out [BH, N, D], lse [BH, N], part_out [parts, BH, block_m, D], part_lse
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& rel,
                                const c10::optional<at::Tensor>& pad,
                                const std::vector<at::Tensor>& plan_tensors, int64_t block_m,
                                int64_t block_n, int64_t heads, int64_t parts, double scale,
                                double dropout_p, int64_t seed) {
  check_qkv(q, k, v);
  const Plan plan = read_plan(plan_tensors, block_m, block_n);
  const int64_t bh = q.size(0);
  auto out = at::empty_like(q);
  auto lse = at::empty({bh, q.size(1)}, q.options());
  auto part_out = at::empty({parts, bh, block_m, q.size(2)}, q.options());
  auto part_lse = at::empty({parts, bh, block_m}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "graph_attention_cpu_forward", [&] {
    const auto p = make_problem<scalar_t>(q, k, v, rel, pad, plan, heads, scale, dropout_p, seed);
    const Tiles tiles = query_tiles(plan);
    for_each_item(bh, tiles.num_items, [&](int64_t b, int64_t item) {
      forward_item(p, tiles, b, item, out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                   part_out.data_ptr<scalar_t>(), part_lse.data_ptr<scalar_t>(), bh);
    });
  });
  return {out, lse, part_out, part_lse};
}

// Number of fixed chunks of dQ work, each with its own d rel_key sum: fixed, so that the
// sums (chunk by chunk, then over chunks in order) do not depend on the thread count.
constexpr int64_t kRelChunks = 64;

// backward(grad_out, q, k, v, rel, pad, lse, delta, plan, ..., need_rel)
//   -> dq, dk, dv, d rel (or empty), part_dq, part_dk, part_dv
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v,
                                 const c10::optional<at::Tensor>& rel,
                                 const c10::optional<at::Tensor>& pad, const at::Tensor& lse,
                                 const at::Tensor& delta,
                                 const std::vector<at::Tensor>& plan_tensors, int64_t block_m,
                                 int64_t block_n, int64_t heads, int64_t query_parts,
                                 int64_t key_parts, double scale, double dropout_p, int64_t seed) {
  check_qkv(q, k, v);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && grad_out.is_contiguous() &&
                  grad_out.scalar_type() == q.scalar_type() && lse.is_contiguous() &&
                  delta.is_contiguous() && lse.scalar_type() == q.scalar_type() &&
                  delta.scalar_type() == q.scalar_type() && lse.numel() * q.size(2) == q.numel() &&
                  delta.numel() == lse.numel(),
              "graph_attention_cpu: grad_out, lse and delta must match q");
  const Plan plan = read_plan(plan_tensors, block_m, block_n);
  const int64_t bh = q.size(0), d = q.size(2);
  auto grad_q = at::empty_like(q), grad_k = at::empty_like(q), grad_v = at::empty_like(q);
  auto part_q = at::empty({query_parts, bh, block_m, d}, q.options());
  auto part_k = at::empty({key_parts, bh, block_m, d}, q.options());
  auto part_v = at::empty({key_parts, bh, block_m, d}, q.options());
  const int64_t num_types = rel ? rel->size(0) : 0;
  at::Tensor grad_rel = at::empty({num_types, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "graph_attention_cpu_backward", [&] {
    using T = scalar_t;
    const auto p = make_problem<T>(q, k, v, rel, pad, plan, heads, scale, dropout_p, seed);
    const T *go = grad_out.data_ptr<T>(), *l = lse.data_ptr<T>(), *dl = delta.data_ptr<T>();
    const Tiles tiles = query_tiles(plan);
    const int64_t units = bh * tiles.num_items;
    const int64_t chunks = std::max<int64_t>(std::min(units, kRelChunks), 1);
    auto chunk_rel = at::zeros({rel ? chunks : 0, num_types, d}, q.options());
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        for (int64_t u = c * units / chunks; u < (c + 1) * units / chunks; ++u) {
          backward_query_item(p, tiles, u / tiles.num_items, u % tiles.num_items, go, l, dl,
                              grad_q.data_ptr<T>(), part_q.data_ptr<T>(),
                              rel ? chunk_rel.data_ptr<T>() + c * num_types * d : nullptr, bh);
        }
      }
    });
    if (rel) {  // sum the chunks in order, element by element
      T* total = grad_rel.data_ptr<T>();
      const T* per_chunk = chunk_rel.data_ptr<T>();
      const int64_t size = num_types * d;
      at::parallel_for(0, size, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          T sum = 0;
          for (int64_t c = 0; c < chunks; ++c) sum += per_chunk[c * size + i];
          total[i] = sum;
        }
      });
    }
    const Tiles windows = key_tiles(plan);
    for_each_item(bh, windows.num_items, [&](int64_t b, int64_t item) {
      backward_key_item(p, windows, b, item, go, l, dl, grad_k.data_ptr<T>(),
                        grad_v.data_ptr<T>(), part_k.data_ptr<T>(), part_v.data_ptr<T>(), bh);
    });
  });
  return {grad_q, grad_k, grad_v, grad_rel, part_q, part_k, part_v};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "graph attention forward over a tile plan (CPU)");
  m.def("backward", &backward, "graph attention backward over a tile plan (CPU)");
}
