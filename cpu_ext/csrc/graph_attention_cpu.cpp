// Graph attention on CPU, edge by edge over the CSR graph (the Python glue is
// fairseq_plugins/graph_attention/cpu_backend.py).
//
// A CPU has no tensor cores to fill, and a key row of a 64-dim head is four cache lines that
// the neighbouring query rows read again (a tree graph's keys of nearby queries are nearby):
// so every edge costs a few vector operations over the head dim on rows already in cache,
// and no work is spent on the non-edges that fill a dense tile (three quarters of the
// entries of BPT's 32 x 32 tiles). Per query row u of batch x head bh:
//   forward   s_e = scale q_u . (k_v + rel[t_e]) over u's present keys v, softmax, O_u, and
//             one log-sum-exp saved (two passes over the row's edges: scores, then O)
//   backward  recompute p_e = exp(s_e - lse_u); dp_e = dO_u . v_v; dS = p (dp - delta_u);
//             dQ_u = scale sum dS (k_v + rel), and dK_v, dV_v, d rel[t] added edge by edge
// No [rows x keys] probabilities are stored. The forward runs over blocks of rows on all
// threads; the backward's dK and dV rows are shared by the query rows of one batch x head,
// so it runs over fixed chunks of batch x heads, each adding to its own d rel sum, summed in
// order: the results do not depend on the number of threads. Dropout keeps an edge when a
// hash of (seed, batch x head, query node, key node) is at least p: the backward regenerates
// the forward's mask.
//
// Layout: q, k, v, the output and every gradient are node-major, [N, BH, D] contiguous, which
// is fairseq's time-first [N, B, H * D] projection output as it is: the projections' outputs
// are read, and the gradients written, in place (no per-head transposed copies); lse is
// [BH, N].

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// exp for the softmax: float uses a Cephes-style polynomial (relative error ~2e-7, like
// expf) without the call; below -87.3 it is exactly 0. double (the tests) uses std::exp.
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
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : poly * scale;
}
inline double softmax_exp(double x) { return std::exp(x); }

// Keep (query node, key node) of batch x head bh: splitmix64 of the counter, top 24 bits.
inline bool keep_edge(uint64_t seed, int64_t bh, int64_t n, int64_t row, int64_t key,
                      uint32_t threshold) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + (static_cast<uint64_t>(bh * n + row) * n + key);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<uint32_t>(x >> 40) >= threshold;
}

// What every pass reads: inputs, the graph, scalars.
template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  const T* rel;           // [types, D] or nullptr
  const uint8_t* pad;     // [B, N], 1 = absent key, or nullptr
  const int32_t* indptr;  // CSR over query nodes
  const int32_t* indices;
  const int32_t* types;
  int64_t heads, n, d;
  int64_t batch_heads;  // BH: the stride of a node is BH * D
  T scale;
  double dropout_p;
  uint64_t seed;
  uint32_t threshold;  // dropout keeps a hash >= threshold (of 2^24)
  T keep_scale;        // 1 / (1 - p)

  // row (node, bh) of a node-major [N, BH, D] tensor
  int64_t offset(int64_t bh, int64_t node) const { return (node * batch_heads + bh) * d; }
  const T* row(const T* x, int64_t bh, int64_t node) const { return x + offset(bh, node); }
  bool absent(int64_t bh, int64_t key) const { return pad && pad[(bh / heads) * n + key]; }
  // the factor dropout puts on edge (row, key): 0 or 1 / (1 - p)
  T keep(int64_t bh, int64_t row, int64_t key) const {
    if (dropout_p <= 0) return T(1);
    return keep_edge(seed, bh, n, row, key, threshold) ? keep_scale : T(0);
  }
};

// The vector operations over the head dim. Dim > 0 fixes it at compile time (the common head
// dims: fully unrolled), 0 reads it at run time. Reductions run in a fixed lane order.
template <typename T, int Dim>
struct Head {
  int64_t d;
  int64_t size() const { return Dim > 0 ? Dim : d; }

  // a . (b + c), c may be nullptr
  T dot(const T* a, const T* b, const T* c) const {
    T sum = 0;
    const int64_t n = size();
    if (c) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += a[i] * (b[i] + c[i]);
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    }
    return sum;
  }
  // y += alpha x
  void axpy(T alpha, const T* x, T* y) const {
    const int64_t n = size();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  }
  // y += alpha (x + z), z may be nullptr
  void axpy2(T alpha, const T* x, const T* z, T* y) const {
    if (!z) return axpy(alpha, x, y);
    const int64_t n = size();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * (x[i] + z[i]);
  }
  void scaled(T alpha, const T* x, T* y) const {
    const int64_t n = size();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = alpha * x[i];
  }
};

template <typename T>
const T* rel_row(const Problem<T>& p, int64_t edge) {
  return p.rel ? p.rel + static_cast<int64_t>(p.types[edge]) * p.d : nullptr;
}

// ------------------------------------------------------------------------------ forward

// Rows [begin, end) of flat (batch x head, node) index: out, lse (+inf for a row without a
// present key, whose output is 0). scratch: max degree + 2 D values.
template <typename T, int Dim>
void forward_rows(const Problem<T>& p, int64_t begin, int64_t end, T* out, T* lse, T* scratch) {
  const Head<T, Dim> head{p.d};
  T* qs = scratch;
  T* acc = scratch + p.d;
  T* scores = scratch + 2 * p.d;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t flat = begin; flat < end; ++flat) {
    const int64_t bh = flat / p.n, u = flat % p.n;
    const int64_t first = p.indptr[u], last = p.indptr[u + 1];
    head.scaled(p.scale, p.row(p.q, bh, u), qs);
    T row_max = neg_inf;
    for (int64_t e = first; e < last; ++e) {
      const int64_t key = p.indices[e];
      const T s = p.absent(bh, key) ? neg_inf : head.dot(qs, p.row(p.k, bh, key), rel_row(p, e));
      scores[e - first] = s;
      row_max = std::max(row_max, s);
    }
    T* o = out + p.offset(bh, u);
    std::fill_n(acc, p.d, T(0));
    if (row_max == neg_inf) {  // no present key
      std::fill_n(o, p.d, T(0));
      lse[flat] = std::numeric_limits<T>::infinity();
      continue;
    }
    T sum = 0;
    for (int64_t e = first; e < last; ++e) {
      const T w = softmax_exp(scores[e - first] - row_max);
      sum += w;
      const int64_t key = p.indices[e];
      const T weight = w * p.keep(bh, u, key);
      if (weight != 0) head.axpy(weight, p.row(p.v, bh, key), acc);
    }
    head.scaled(T(1) / sum, acc, o);
    lse[flat] = row_max + std::log(sum);
  }
}

// ----------------------------------------------------------------------------- backward

// Every query row of batch x head bh: dQ rows, and dK, dV rows (zeroed before) and d rel
// (this chunk's sum) added edge by edge. scratch: 2 D values.
template <typename T, int Dim>
void backward_head(const Problem<T>& p, int64_t bh, const T* grad_out, const T* out,
                   const T* lse, T* grad_q, T* grad_k, T* grad_v, T* grad_rel, T* scratch) {
  const Head<T, Dim> head{p.d};
  T* qs = scratch;
  T* dq = scratch + p.d;
  for (int64_t u = 0; u < p.n; ++u) {
    const int64_t flat = bh * p.n + u;
    T* dq_row = grad_q + p.offset(bh, u);
    const T row_lse = lse[flat];
    if (std::isinf(row_lse)) {  // no present key: zero output, zero gradients
      std::fill_n(dq_row, p.d, T(0));
      continue;
    }
    const T* go = grad_out + p.offset(bh, u);
    const T delta = head.dot(go, out + p.offset(bh, u), nullptr);  // rowsum(dO * O)
    head.scaled(p.scale, p.row(p.q, bh, u), qs);
    std::fill_n(dq, p.d, T(0));
    for (int64_t e = p.indptr[u]; e < p.indptr[u + 1]; ++e) {
      const int64_t key = p.indices[e];
      if (p.absent(bh, key)) continue;
      const T* k = p.row(p.k, bh, key);
      const T* rel = rel_row(p, e);
      const T prob = softmax_exp(head.dot(qs, k, rel) - row_lse);
      const T keep = p.keep(bh, u, key);
      const T d_prob = keep * head.dot(go, p.row(p.v, bh, key), nullptr);
      if (keep != 0) head.axpy(prob * keep, go, grad_v + p.offset(bh, key));
      const T d_score = prob * (d_prob - delta);
      head.axpy2(d_score, k, rel, dq);
      head.axpy(d_score, qs, grad_k + p.offset(bh, key));
      if (rel) head.axpy(d_score, qs, grad_rel + p.types[e] * p.d);
    }
    head.scaled(p.scale, dq, dq_row);
  }
}

// -------------------------------------------------------------------------------- glue

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
              "graph_attention_cpu: q, k, v must be [N, BH, D] of one shape");
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "graph_attention_cpu: q, k, v must be contiguous CPU tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "graph_attention_cpu: q, k, v must all be float32 or all float64");
}

template <typename T>
Problem<T> make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& rel, const c10::optional<at::Tensor>& pad,
                        const std::vector<at::Tensor>& graph, int64_t heads, double scale,
                        double dropout_p, int64_t seed) {
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "graph_attention_cpu: dropout_p must be in [0, 1)");
  const int64_t n = q.size(0), batch_heads = q.size(1);
  TORCH_CHECK(graph.size() == 3, "graph_attention_cpu: the graph is (indptr, indices, types)");
  for (const auto& t : graph) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kInt,
                "graph_attention_cpu: the graph's tensors must be contiguous int32 CPU tensors");
  }
  TORCH_CHECK(graph[0].numel() == n + 1 && graph[1].numel() == graph[2].numel(),
              "graph_attention_cpu: indptr must have N + 1 entries and one type per edge");
  TORCH_CHECK(heads > 0 && batch_heads % heads == 0, "graph_attention_cpu: bad head count");
  if (rel) {
    TORCH_CHECK(rel->dim() == 2 && rel->size(1) == q.size(2) && rel->is_contiguous() &&
                    rel->scalar_type() == q.scalar_type(),
                "graph_attention_cpu: rel_key must be a contiguous [types, D] tensor of q's dtype");
  }
  if (pad) {
    TORCH_CHECK(pad->scalar_type() == at::kByte && pad->is_contiguous() &&
                    pad->numel() * heads == batch_heads * n,
                "graph_attention_cpu: key padding must be a contiguous uint8 [B, N] tensor");
  }
  return Problem<T>{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                    rel ? rel->data_ptr<T>() : nullptr,
                    pad ? pad->data_ptr<uint8_t>() : nullptr, graph[0].data_ptr<int32_t>(),
                    graph[1].data_ptr<int32_t>(), graph[2].data_ptr<int32_t>(), heads, n,
                    q.size(2), batch_heads, static_cast<T>(scale), dropout_p,
                    static_cast<uint64_t>(seed),
                    static_cast<uint32_t>(std::llround(dropout_p * (1 << 24))),
                    static_cast<T>(1.0 / (1.0 - dropout_p))};
}

// fn.template operator()<Dim>() with Dim the head dim where it is a common one, else 0.
template <typename Fn>
void dispatch_head_dim(int64_t d, const Fn& fn) {
  switch (d) {
    case 32: return fn(std::integral_constant<int, 32>());
    case 64: return fn(std::integral_constant<int, 64>());
    case 128: return fn(std::integral_constant<int, 128>());
    default: return fn(std::integral_constant<int, 0>());
  }
}

int64_t max_degree(const at::Tensor& indptr) {
  const int32_t* ptr = indptr.data_ptr<int32_t>();
  int64_t most = 0;
  for (int64_t u = 0; u + 1 < indptr.numel(); ++u) {
    most = std::max<int64_t>(most, ptr[u + 1] - ptr[u]);
  }
  return most;
}

// Query rows per parallel task of the forward: enough edges to outweigh the task's cost.
constexpr int64_t kForwardGrain = 64;

// forward(q, k, v, rel, pad, (indptr, indices, types), heads, scale, dropout_p, seed)
//   -> out [N, BH, D], lse [BH, N]
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& rel,
                                const c10::optional<at::Tensor>& pad,
                                const std::vector<at::Tensor>& graph, int64_t heads, double scale,
                                double dropout_p, int64_t seed) {
  check_qkv(q, k, v);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(1), q.size(0)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "graph_attention_cpu_forward", [&] {
    using T = scalar_t;
    const auto p = make_problem<T>(q, k, v, rel, pad, graph, heads, scale, dropout_p, seed);
    const int64_t scratch_size = max_degree(graph[0]) + 2 * p.d;
    dispatch_head_dim(p.d, [&](auto dim) {
      at::parallel_for(0, p.batch_heads * p.n, kForwardGrain, [&](int64_t begin, int64_t end) {
        std::vector<T> scratch(scratch_size);
        forward_rows<T, decltype(dim)::value>(p, begin, end, out.data_ptr<T>(),
                                               lse.data_ptr<T>(), scratch.data());
      });
    });
  });
  return {out, lse};
}

// Fixed chunks of batch x heads, each with its own d rel_key sum: fixed, so that the sums
// (chunk by chunk, then over chunks in order) do not depend on the thread count.
constexpr int64_t kRelChunks = 64;

// backward(grad_out, q, k, v, out, lse, rel, pad, graph, heads, scale, dropout_p, seed)
//   -> dq, dk, dv, d rel (empty without rel)
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, const c10::optional<at::Tensor>& rel,
                                 const c10::optional<at::Tensor>& pad,
                                 const std::vector<at::Tensor>& graph, int64_t heads,
                                 double scale, double dropout_p, int64_t seed) {
  check_qkv(q, k, v);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  grad_out.is_contiguous() && out.is_contiguous() && lse.is_contiguous() &&
                  grad_out.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && lse.scalar_type() == q.scalar_type() &&
                  lse.numel() * q.size(2) == q.numel(),
              "graph_attention_cpu: grad_out, out and lse must match q");
  const int64_t batch_heads = q.size(1), d = q.size(2);
  auto grad_q = at::empty_like(q), grad_k = at::zeros_like(q), grad_v = at::zeros_like(q);
  const int64_t num_types = rel ? rel->size(0) : 0;
  at::Tensor grad_rel = at::empty({num_types, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "graph_attention_cpu_backward", [&] {
    using T = scalar_t;
    const auto p = make_problem<T>(q, k, v, rel, pad, graph, heads, scale, dropout_p, seed);
    const int64_t chunks = std::max<int64_t>(std::min(batch_heads, kRelChunks), 1);
    auto chunk_rel = at::zeros({rel ? chunks : 0, num_types, d}, q.options());
    dispatch_head_dim(d, [&](auto dim) {
      at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> scratch(2 * d);
        for (int64_t c = begin; c < end; ++c) {
          for (int64_t bh = c * batch_heads / chunks; bh < (c + 1) * batch_heads / chunks; ++bh) {
            backward_head<T, decltype(dim)::value>(
                p, bh, grad_out.data_ptr<T>(), out.data_ptr<T>(), lse.data_ptr<T>(),
                grad_q.data_ptr<T>(), grad_k.data_ptr<T>(), grad_v.data_ptr<T>(),
                rel ? chunk_rel.data_ptr<T>() + c * num_types * d : nullptr, scratch.data());
          }
        }
      });
    });
    if (rel) {  // sum the chunks in order, element by element
      T* total = grad_rel.data_ptr<T>();
      const T* per_chunk = chunk_rel.data_ptr<T>();
      const int64_t size = num_types * d;
      for (int64_t i = 0; i < size; ++i) {
        T sum = 0;
        for (int64_t c = 0; c < chunks; ++c) sum += per_chunk[c * size + i];
        total[i] = sum;
      }
    }
  });
  return {grad_q, grad_k, grad_v, grad_rel};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "graph attention forward over a CSR graph (CPU)");
  m.def("backward", &backward, "graph attention backward over a CSR graph (CPU)");
}
