"""The ``"torch"`` backend of ``graph_attention``: exact PyTorch paths, CPU and GPU.

It picks, per call, the path that suits the graph:

* ``dense_graph_attention``: graphs of at most ``DENSE_MAX_NODES`` nodes (short sentences);
  the full [N, N] score matrix with -inf off the graph, one fused SDPA call. O(N^2), but a few
  large kernels beat the other paths' many small ones at this size.
* ``tree_block_attention`` (``torch_tree``): graphs laid out over a binary-partition tree
  (``graph.tree`` is set); the path for every sentence longer than a few dozen tokens, in
  eager mode (an ``autograd.Function`` over a Python plan: under ``torch.compile`` the CSR
  path below is traced instead).
* ``csr_attention``: any other graph; gathers one key/value per edge and does a segment softmax
  with scatter ops. Memory is linear in the number of edges (times the head dim). It is also
  the reference the other backends are tested against.
"""

from typing import Tuple

import torch
import torch.nn.functional as F

from fairseq_plugins.graph_attention.registry import Backend
from fairseq_plugins.graph_attention.torch_tree import GROUP_TOKENS, tree_block_attention, tree_plan
from fairseq_plugins.graphs.attention_graph import AttentionGraph

DENSE_MAX_NODES = 96  # sentences up to 48 tokens: the measured CPU crossover (docs/bpt.md)


def _path(graph: AttentionGraph) -> str:
    if graph.num_nodes <= DENSE_MAX_NODES and graph.num_keys <= DENSE_MAX_NODES:
        return "dense"
    if graph.tree is not None and not torch.compiler.is_compiling():  # square by construction
        return "tree"
    return "csr"


def torch_graph_attention(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale):
    """The ``"torch"`` backend: the exact path that suits the graph's size and layout."""
    path = _path(graph)
    if path == "dense":
        return dense_graph_attention(query, key, value, graph, rel_key, key_padding_mask,
                                     dropout_p, scale)
    if path == "tree":
        return tree_block_attention(query, key, value, graph, rel_key, key_padding_mask,
                                    dropout_p, scale)
    indptr, indices, edge_type = graph.on(query.device)
    return csr_attention(query, key, value, indptr, indices, edge_type, rel_key,
                         key_padding_mask, dropout_p, scale)


def prepare(query: torch.Tensor, graph: AttentionGraph) -> None:
    """The graph's data every path may read on the query's device (see ``Backend.prepare``)."""
    graph.on(query.device)
    if _path(graph) == "dense":
        _dense_layout(graph, query.device, query.dtype)
    elif graph.tree is not None:
        tree_plan(graph, GROUP_TOKENS, query.device)


BACKEND = Backend("torch", torch_graph_attention, prepare=prepare)


def _dense_layout(graph: AttentionGraph, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """([N, M] additive mask, 0 on edges and -inf elsewhere; [N, M] edge type, 0 off the graph)."""
    def build():
        shape = (graph.num_nodes, graph.num_keys)
        mask = torch.full(shape, float("-inf"), dtype=dtype)
        mask[graph.rows(), graph.indices] = 0.0
        types = torch.zeros(shape, dtype=torch.int64)
        types[graph.rows(), graph.indices] = graph.edge_type
        return mask.to(device), types.to(device)
    return graph.derived("dense", device, build, dtype)


def dense_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                          dropout_p=0.0, scale=None) -> torch.Tensor:
    """Small graphs: all [N, N] scores with -inf off the graph, through one fused SDPA call.

    Wasteful in FLOPs but a handful of large kernels, which beats the structured paths' many
    small ones for the short sentences of MT. The relative term q . rel_key[type] is computed as
    q @ rel_key.T ([B, H, N, T], small) gathered by the cached [N, M] type index.
    """
    bsz, heads, num_nodes, dim = query.shape
    num_keys = key.size(2)
    if scale is None:
        scale = dim ** -0.5
    mask, types = _dense_layout(graph, query.device, query.dtype)
    mask = mask.expand(bsz, 1, num_nodes, num_keys)
    if key_padding_mask is not None:
        mask = mask.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    # rows with no present key: attend anywhere (finite), then zero the output below
    has_key = torch.isfinite(mask).any(-1, keepdim=True)  # [B, 1, N, 1]
    mask = mask.masked_fill(~has_key, 0.0)
    if rel_key is not None:
        q_rel = query @ rel_key.to(query.dtype).transpose(0, 1)  # [B, H, N, T]
        bias = torch.gather(q_rel, -1, types.expand(bsz, heads, num_nodes, num_keys))
        mask = mask + bias * scale
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                         dropout_p=dropout_p if dropout_p > 0 else 0.0, scale=scale)
    return out * has_key.to(out.dtype)


def csr_attention(query, key, value, indptr, indices, edge_type, rel_key=None,
                  key_padding_mask=None, dropout_p=0.0, scale=None) -> torch.Tensor:
    """Generic path: query [B, H, R, D] rows of a CSR (indptr [R + 1]) over key/value [B, H, M, D].

    Also used for rectangular graphs (incremental decoding: R new nodes against M cached ones).
    """
    bsz, heads, num_rows, dim = query.shape
    if scale is None:
        scale = dim ** -0.5
    rows = torch.repeat_interleave(torch.arange(num_rows, device=query.device), indptr.diff(),
                                   output_size=indices.numel())
    scores = (query[:, :, rows] * key[:, :, indices]).sum(-1)  # [B, H, E]
    if rel_key is not None:
        scores = scores + (query @ rel_key.to(query.dtype).transpose(0, 1))[:, :, rows, edge_type]
    scores = scores * scale
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, indices].unsqueeze(1), float("-inf"))
    index = rows.expand(bsz, heads, -1)
    row_max = torch.full((bsz, heads, num_rows), float("-inf"), dtype=scores.dtype,
                         device=scores.device)
    row_max = row_max.scatter_reduce(2, index, scores.detach(), "amax")
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    exp = torch.exp(scores - row_max[:, :, rows])
    denom = exp.new_zeros(bsz, heads, num_rows).index_add(2, rows, exp)
    probs = exp / denom.clamp_min(torch.finfo(exp.dtype).tiny)[:, :, rows]
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    out = query.new_zeros(bsz, heads, num_rows, dim)
    return out.index_add(2, rows, probs.unsqueeze(-1) * value[:, :, indices])
