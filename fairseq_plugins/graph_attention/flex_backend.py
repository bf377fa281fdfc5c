"""The ``"flex"`` backend of ``graph_attention``: ``torch.nn.attention.flex_attention``.

Kept for comparison with the fused kernels (``benchmarks/``). The graph becomes

* a ``BlockMask`` whose non-empty blocks are the (query block, key block) pairs holding at
  least one edge, built directly from the CSR (no N x N evaluation);
* a dense edge-type tile per non-empty block (-1 = no edge), read by ``mask_mod`` (is there an
  edge? is the key present?) and by ``score_mod``, which adds the relative-position term
  ``scale * q_u . rel_key[type]`` from a precomputed [B, H, N, num_edge_types] table.

Limits: no attention dropout (flex has none); on CPU flex runs forward only (torch 2.13), and
eagerly; on CUDA the compiled kernel is used. Rows without a present key return zeros.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from fairseq_plugins.graph_attention.registry import register_backend
from fairseq_plugins.graphs.attention_graph import AttentionGraph

BLOCK_SIZE = 128
_compiled_flex_attention = None


@dataclass(frozen=True)
class GraphBlocks:
    """Block-sparse form of an ``AttentionGraph`` on one device."""

    block_size: int
    kv_num_blocks: torch.Tensor  # int32 [1, 1, q_blocks]
    kv_indices: torch.Tensor  # int32 [1, 1, q_blocks, kv_blocks], key blocks of each query block
    tile_of_block: torch.Tensor  # int64 [q_blocks, kv_blocks], tile id or -1
    type_tiles: torch.Tensor  # int64 [tiles, block, block], edge type or -1


def graph_blocks(graph: AttentionGraph, device, block_size: int = BLOCK_SIZE) -> GraphBlocks:
    """The block structure of ``graph`` (cached on the graph per device and block size)."""
    return graph.derived("flex_blocks", device, lambda: _graph_blocks(graph, device, block_size),
                         block_size)


def _graph_blocks(graph: AttentionGraph, device, block_size: int) -> GraphBlocks:
    n, bs = graph.num_nodes, block_size
    num_blocks = -(-n // bs)
    rows, cols = graph.rows(), graph.indices
    pair = (rows // bs) * num_blocks + cols // bs
    pairs, tile_id = torch.unique(pair, sorted=True, return_inverse=True)
    tile_of_block = torch.full((num_blocks * num_blocks,), -1, dtype=torch.int64)
    tile_of_block[pairs] = torch.arange(pairs.numel())
    type_tiles = torch.full((pairs.numel(), bs, bs), -1, dtype=torch.int64)
    type_tiles[tile_id, rows % bs, cols % bs] = graph.edge_type
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
    blocks = graph_blocks(graph, query.device)
    bs, padded = blocks.block_size, blocks.tile_of_block.size(0) * blocks.block_size
    n = graph.num_nodes

    def edge_type_at(q_idx, kv_idx):
        tile = blocks.tile_of_block[q_idx // bs, kv_idx // bs]
        return torch.where(tile >= 0, blocks.type_tiles[tile.clamp_min(0), q_idx % bs, kv_idx % bs], -1)

    if key_padding_mask is not None:
        absent = torch.nn.functional.pad(key_padding_mask.to(query.device, torch.bool), (0, padded - n))

        def mask_mod(b, h, q_idx, kv_idx):
            return (edge_type_at(q_idx, kv_idx) >= 0) & ~absent[b, kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return edge_type_at(q_idx, kv_idx) >= 0

    score_mod = None
    if rel_key is not None:
        # scale * q_u . rel_key[t] for every node and type, padded to whole blocks
        query_rel = torch.nn.functional.pad(
            (query @ rel_key.to(query.dtype).transpose(0, 1)) * scale, (0, 0, 0, padded - n))

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + query_rel[b, h, q_idx, edge_type_at(q_idx, kv_idx).clamp_min(0)]

    block_mask = BlockMask.from_kv_blocks(blocks.kv_num_blocks, blocks.kv_indices,
                                          BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(n, n))
    return _flex(query.device)(query, key, value, score_mod=score_mod, block_mask=block_mask,
                               scale=scale)


def _flex(device: torch.device):
    """Eager flex on CPU (forward only there), the compiled kernel on CUDA."""
    global _compiled_flex_attention
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def refuses(query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0):
    """Why flex cannot run these inputs (None: it can): no attention dropout, square graphs."""
    if dropout_p > 0:
        return "flex_attention has no attention dropout"
    if not graph.square:
        return "square graphs only (a decoding step's graph runs on the torch backend)"
    return None


def prepare(query: torch.Tensor, graph: AttentionGraph) -> None:
    """The graph's block structure on the query's device."""
    graph_blocks(graph, query.device)


register_backend("flex", flex_graph_attention, refuses, prepare)
