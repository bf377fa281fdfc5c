"""Triton kernels of the relative-key term around the tile kernels (``triton_kernels``).

The tile kernels read the relative-key term as a table, scale * log2(e) * q_u . rel_key[t]
for every node u and edge type t (fp32 [B*H, N, T]: a gather per edge), and the dQ kernel
sums d(score) per (row, type) into grad_rel [B*H, N, T] (scaled). These kernels make the
table and turn the sums into d rel_key = sum over rows of grad_rel[row, t] * q_row, in a
fixed order (partial sums over fixed chunks of rows, then the chunks in order): the same
bits on every run, and no PyTorch op around the kernels (q is read in place, through its
strides, in its dtype; rel_key is fp32 [T, D]).

Products are fp32 (``PRECISION``: tf32x3, about fp32 accuracy, on tensor cores). Rows are
the flat (sentence x head, node) index; types go ``BLOCK_T`` at a time.
"""

import triton
import triton.language as tl

from fairseq_plugins.graph_attention.triton_kernels import LOG2E

REL_SCALARS = ["num_nodes", "num_types", "heads", "scale", "num_rows"]


@triton.jit
def _flat_rows(q_ptr, first_row, num_rows, num_nodes, heads, stride_qb, stride_qh, stride_qn,
               D: tl.constexpr, BLOCK_R: tl.constexpr):
    """(q rows first_row + [0, BLOCK_R) of the flat [B*H*N] row space as fp32 [BLOCK_R, D],
    zeros past ``num_rows``; the rows' flat indices (int64); which exist)."""
    row = first_row + tl.arange(0, BLOCK_R).to(tl.int64)
    exists = row < num_rows
    bh, node = row // num_nodes, row % num_nodes
    offsets = ((bh // heads) * stride_qb + (bh % heads) * stride_qh + node * stride_qn)[:, None]
    q = tl.load(q_ptr + offsets + tl.arange(0, D)[None, :], mask=exists[:, None], other=0.0)
    return q.to(tl.float32), row, exists


@triton.jit(do_not_specialize=REL_SCALARS)
def rel_table_kernel(
    q_ptr, rel_key_ptr, table_ptr, stride_qb: tl.int64, stride_qh: tl.int64, stride_qn: tl.int64,
    num_nodes, num_types, heads, scale, num_rows,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):
    """table[row, t] = scale * log2(e) * q_row . rel_key[t] of ``BLOCK_R`` rows (one program)."""
    q, row, exists = _flat_rows(q_ptr, tl.program_id(0).to(tl.int64) * BLOCK_R, num_rows,
                                num_nodes, heads, stride_qb, stride_qh, stride_qn, D, BLOCK_R)
    d = tl.arange(0, D)
    for first_type in range(0, num_types, BLOCK_T):
        rel_type = first_type + tl.arange(0, BLOCK_T)
        known = rel_type < num_types
        rel_key = tl.load(rel_key_ptr + rel_type[:, None] * D + d[None, :], mask=known[:, None],
                          other=0.0)
        scores = tl.dot(q, tl.trans(rel_key), input_precision=PRECISION) * (scale * LOG2E)
        tl.store(table_ptr + row[:, None] * num_types + rel_type[None, :], scores,
                 mask=exists[:, None] & known[None, :])


@triton.jit(do_not_specialize=["num_nodes", "num_types", "heads", "num_rows"])
def rel_grad_partial_kernel(
    q_ptr, grad_rel_ptr, partial_ptr, stride_qb: tl.int64, stride_qh: tl.int64,
    stride_qn: tl.int64, num_nodes, num_types, heads, num_rows,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
    CHUNK_STEPS: tl.constexpr,
):
    """partial[chunk, t] = sum over the chunk's rows of grad_rel[row, t] * q_row, for
    ``BLOCK_T`` types (program (chunk, type block)); a chunk is ``CHUNK_STEPS`` x ``BLOCK_R``
    rows, summed in row order."""
    chunk = tl.program_id(0).to(tl.int64)
    rel_type = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    known = rel_type < num_types
    total = tl.zeros([BLOCK_T, D], tl.float32)
    for step in range(CHUNK_STEPS):
        q, row, exists = _flat_rows(q_ptr, (chunk * CHUNK_STEPS + step) * BLOCK_R, num_rows,
                                    num_nodes, heads, stride_qb, stride_qh, stride_qn, D, BLOCK_R)
        sums = tl.load(grad_rel_ptr + row[None, :] * num_types + rel_type[:, None],
                       mask=known[:, None] & exists[None, :], other=0.0)
        total += tl.dot(sums, q, input_precision=PRECISION)
    d = tl.arange(0, D)
    tl.store(partial_ptr + (chunk * num_types + rel_type[:, None]) * D + d[None, :], total,
             mask=known[:, None])


@triton.jit(do_not_specialize=["num_types", "num_chunks"])
def rel_grad_sum_kernel(
    partial_ptr, grad_rel_key_ptr, num_types, num_chunks, D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """d rel_key[t] (fp32) = the chunks' partial sums, in chunk order, for ``BLOCK_T`` types."""
    rel_type = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    known = rel_type < num_types
    d = tl.arange(0, D)
    total = tl.zeros([BLOCK_T, D], tl.float32)
    for chunk in range(num_chunks):
        total += tl.load(partial_ptr + (chunk * num_types + rel_type[:, None]).to(tl.int64) * D + d[None, :],
                         mask=known[:, None], other=0.0)
    tl.store(grad_rel_key_ptr + rel_type[:, None] * D + d[None, :], total, mask=known[:, None])
