"""The ``"flex"`` backend of ``graph_attention``: ``torch.nn.attention.flex_attention``.

One of the candidates ``backend="auto"`` times on a GPU, and a comparison for the fused
kernels (``benchmarks/``). The graph becomes

* a ``BlockMask`` whose non-empty blocks are the (query block, key block) pairs holding at
  least one edge, built directly from the CSR (no N x N evaluation);
* a dense edge-type tile per non-empty block (-1 = no edge), in the narrowest integer type
  that holds the graph's edge types (int8 for every BPT graph: a quarter of the tile memory
  int32 takes), read by ``mask_mod`` (is there an edge? is the key present?) and by
  ``score_mod``, which adds the relative-position term ``scale * q_u . rel_key[type]`` from a
  precomputed [B, H, N, num_edge_types] table; block indices are int32.

On CUDA the compiled kernel runs (``compiled_flex_attention``, automatic dynamic shapes).
So that a training run over varying lengths does not compile per length, a graph runs
padded to its size bucket (``compiled_length``: a power of two; the padded rows and keys
have no blocks, so they cost copies, not attention) with that length static; the batch size
and the number of edge tiles turn dynamic when they first change. That is at most three
compiles for the first bucket and one per later bucket (counted by dynamo on CPU in the
tests), where ``dynamic=False`` compiled once per length and batch size. What Inductor
builds was tried on CPU in torch 2.13: static shapes, and one size turned dynamic, build;
``dynamic=True`` (every size symbolic) and two dynamic sizes at once fail in Inductor's CPU
code generation. The CUDA build (a different, Triton template) is for ``check_gpu`` to
confirm.

Limits: no attention dropout (flex has none, and a mask drawn inside ``score_mod`` could not
be redrawn identically by its backward), so ``refuses`` names it and ``auto`` times the
other backends when dropout is on; on CPU flex runs forward only (torch 2.13) and eagerly.
Rows without a present key return zeros.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import fairseq_plugins.graph_attention.autotune as autotune
from fairseq_plugins.graph_attention.registry import Backend
from fairseq_plugins.graphs.attention_graph import AttentionGraph

BLOCK_SIZE = 128
# where the compiled kernel runs (elsewhere: eager flex), and who compiles it (tests run the
# compiled path on CPU)
COMPILED_DEVICES = ("cuda",)
COMPILER = "inductor"


@dataclass(frozen=True)
class GraphBlocks:
    """Block-sparse form of an ``AttentionGraph`` on one device."""

    block_size: int
    kv_num_blocks: torch.Tensor  # int32 [1, 1, q_blocks]
    kv_indices: torch.Tensor  # int32 [1, 1, q_blocks, kv_blocks], key blocks of each query block
    tile_of_block: torch.Tensor  # int32 [q_blocks, kv_blocks], tile id or -1
    type_tiles: torch.Tensor  # [tiles, block, block], edge type or -1, in ``edge_type_dtype``


def graph_blocks(graph: AttentionGraph, device, block_size: int = BLOCK_SIZE,
                 length: Optional[int] = None) -> GraphBlocks:
    """The block structure of ``graph`` over ``length`` nodes (default: the graph's, up to
    whole blocks; more pads it with rows and keys without edges), cached on the graph."""
    blocks = -(-(length or graph.num_nodes) // block_size)
    return graph.derived("flex_blocks", device, lambda: _graph_blocks(graph, device, block_size, blocks),
                         block_size, blocks)


def compiled_length(num_nodes: int) -> int:
    """The length the compiled kernel runs a graph of ``num_nodes`` at: its timing bucket
    (``autotune.size_bucket``, a power of two and a whole number of blocks), so that graphs
    of one bucket share one compiled kernel. The padded rows have no blocks: they cost
    copies, not attention."""
    return autotune.size_bucket(num_nodes)


def edge_type_dtype(num_edge_types: int) -> torch.dtype:
    """The narrowest signed integer type holding the edge types and -1."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if num_edge_types <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"{num_edge_types} edge types do not fit an int32 tile")


def _graph_blocks(graph: AttentionGraph, device, block_size: int, num_blocks: int) -> GraphBlocks:
    bs = block_size
    rows, cols = graph.rows(), graph.indices
    pair = (rows // bs) * num_blocks + cols // bs
    pairs, tile_id = torch.unique(pair, sorted=True, return_inverse=True)
    tile_of_block = torch.full((num_blocks * num_blocks,), -1, dtype=torch.int32)
    tile_of_block[pairs] = torch.arange(pairs.numel(), dtype=torch.int32)
    type_tiles = torch.full((pairs.numel(), bs, bs), -1, dtype=edge_type_dtype(graph.num_edge_types))
    type_tiles[tile_id, rows % bs, cols % bs] = graph.edge_type.to(type_tiles.dtype)
    q_block, kv_block = pairs // num_blocks, pairs % num_blocks
    kv_num_blocks = torch.bincount(q_block, minlength=num_blocks)
    # slot of each pair inside its query block's list (pairs are sorted by query block)
    starts = torch.cumsum(kv_num_blocks, 0) - kv_num_blocks
    slot = torch.arange(pairs.numel()) - starts[q_block]
    kv_indices = torch.zeros(num_blocks, num_blocks, dtype=torch.int32)
    kv_indices[q_block, slot] = kv_block.to(torch.int32)
    blocks = GraphBlocks(
        bs,
        kv_num_blocks.to(device=device, dtype=torch.int32).view(1, 1, -1),
        kv_indices.to(device).view(1, 1, num_blocks, num_blocks),
        tile_of_block.view(num_blocks, num_blocks).to(device),
        type_tiles.to(device),
    )
    return blocks


def flex_graph_attention(query, key, value, graph: AttentionGraph, rel_key=None,
                         key_padding_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                         scale: Optional[float] = None) -> torch.Tensor:
    """Backend function (see ``graph_attention`` for the semantics)."""
    if dropout_p > 0:
        raise ValueError("the flex graph-attention backend has no attention dropout; "
                         "use backend='cuda' or 'torch' with dropout_p > 0")
    if scale is None:
        scale = query.size(-1) ** -0.5
    compiled = query.device.type in COMPILED_DEVICES
    n = graph.num_nodes
    blocks = graph_blocks(graph, query.device, length=compiled_length(n) if compiled else n)
    bs, padded = blocks.block_size, blocks.tile_of_block.size(0) * blocks.block_size

    def edge_type_at(q_idx, kv_idx):
        tile = blocks.tile_of_block[q_idx // bs, kv_idx // bs]
        edge_type = blocks.type_tiles[tile.clamp_min(0), q_idx % bs, kv_idx % bs].to(torch.int32)
        return torch.where(tile >= 0, edge_type, -1)

    def pad(tensor, dim):  # to ``padded`` nodes along ``dim``
        return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (0, padded - n))

    if key_padding_mask is not None:
        absent = pad(key_padding_mask.to(query.device, torch.bool), 1)

        def mask_mod(b, h, q_idx, kv_idx):
            return (edge_type_at(q_idx, kv_idx) >= 0) & ~absent[b, kv_idx]
    else:
        absent = None

        def mask_mod(b, h, q_idx, kv_idx):
            return edge_type_at(q_idx, kv_idx) >= 0

    score_mod = query_rel = None
    if rel_key is not None:
        # scale * q_u . rel_key[t] for every node and type
        query_rel = pad((query @ rel_key.to(query.dtype).transpose(0, 1)) * scale, 2)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + query_rel[b, h, q_idx, edge_type_at(q_idx, kv_idx).clamp_min(0)]

    block_mask = BlockMask.from_kv_blocks(blocks.kv_num_blocks, blocks.kv_indices, BLOCK_SIZE=bs,
                                          mask_mod=mask_mod, seq_lengths=(padded, padded) if compiled else (n, n))
    if not compiled or torch.compiler.is_compiling():  # eager, or inside the caller's compile
        return flex_attention(pad(query, 2) if compiled else query, pad(key, 2) if compiled else key,
                              pad(value, 2) if compiled else value, score_mod=score_mod,
                              block_mask=block_mask, scale=scale)[:, :, :n]
    query, key, value = (pad(t, 2) for t in (query, key, value))
    # the length is the bucket's; a batch size or edge-tile count that changes turns dynamic
    for tensor in (query, key, value, absent, query_rel):
        if tensor is not None:
            torch._dynamo.mark_static(tensor, 2 if tensor.dim() == 4 else 1)
    # one compile per bucket is more than dynamo's default limit of 8 allows over all lengths
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        out = compiled_flex_attention(COMPILER)(query, key, value, score_mod=score_mod,
                                                block_mask=block_mask, scale=scale)
    return out[:, :, :n]


@functools.lru_cache(maxsize=None)
def compiled_flex_attention(backend: str = "inductor"):
    """``flex_attention`` compiled by ``backend`` (see the module docstring for its shapes)."""
    return torch.compile(flex_attention, backend=backend, dynamic=None)


def refuses(query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0):
    """Why flex cannot run these inputs (None: it can): no attention dropout, square graphs."""
    if dropout_p > 0:
        return "flex_attention has no attention dropout (auto uses another backend)"
    if not graph.square:
        return "square graphs only (a decoding step's graph runs on the torch backend)"
    return None


def prepare(query: torch.Tensor, graph: AttentionGraph) -> None:
    """The graph's block structure on the query's device, at the length the backend runs."""
    n = graph.num_nodes
    graph_blocks(graph, query.device, length=compiled_length(n) if query.device.type in COMPILED_DEVICES else n)


BACKEND = Backend("flex", flex_graph_attention, refuses, prepare)
