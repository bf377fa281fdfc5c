"""The tile plan of the flash-style Triton graph-attention kernels, built once per graph from
its edges.

Flash attention needs dense tiles; a tree graph is sparse but local. The plan finds dense
enough tiles in three steps:

* query order: tokens in order, then the spans in tiers of log2(BLOCK_M) levels, ordered
  block by block, where a block is one span of the tier's top level; the spans under one
  block read the same tokens, so a block's rows share their keys (the torch tree path's
  grouping). Any other graph keeps its node order.
* forward tiles: each block of ``BLOCK_M`` query slots covers the key nodes it reads with
  the fewest windows of ``BLOCK_N`` consecutive nodes (greedy from the first uncovered key,
  which is optimal for covering points with equal intervals); a tile holds the edge type of
  every (row, column), -1 where there is no edge, and the list of the types it holds (the
  dQ kernel sums d(score) per (row, type) one listed type at a time: no atomics). A BPT
  level's band is one or two tiles.
* key windows (key-major backward), the transposed tiles: each aligned block of ``BLOCK_M``
  key nodes covers the query slots that read it with the fewest windows of ``BLOCK_N``
  consecutive slots (so that the products of both sides have ``BLOCK_M`` rows: 64 for
  fp16/bf16, the height of an sm_90 warpgroup MMA).

Work items are (block, tile range, part), longest first: blocks with more than
``TILES_PER_ITEM`` tiles are split into parts (the root reads every token), merged after the kernel by log-sum-exp
(forward) or by sums (gradients) in the plan's part order, so results do not depend on
scheduling (the merge kernels of ``triton_kernels``).
Exact for every graph: tiles come from the edges, the tree only makes them few.
"""

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

from fairseq_plugins.graphs.attention_graph import AttentionGraph

TILES_PER_ITEM = 16  # tiles one GPU program walks at most; longer blocks are split into parts
MAX_EDGE_TYPES = 2**15 - 1  # edge types are stored as int16 (-1 = no edge)


@dataclass(frozen=True)
class WorkItems:
    """Programs of one kernel: ``items`` int32 [I, 4] = (block, first tile, end tile, part),
    part = -1 for a block done by one program; ``part_index`` int32 [split blocks, max parts]
    lists each split block's parts in the order they are merged (``num_parts`` = padding),
    ``split_nodes`` int32 [split blocks, BLOCK_M] the graph node of each of their rows (-1 =
    none): what the merge kernels read, one program per split block (a grid fixed by the
    plan: no host sync, a CUDA graph can capture it)."""

    items: torch.Tensor
    num_parts: int
    part_index: torch.Tensor
    split_nodes: torch.Tensor


@dataclass(frozen=True)
class TilePlan:
    """Everything the kernels read about the graph, on one device."""

    block_m: int
    block_n: int
    num_nodes: int
    slot_node: torch.Tensor  # int32 [query blocks * BLOCK_M], graph node of each slot or -1
    tile_start: torch.Tensor  # int32 [tiles], first key node of each forward tile
    tile_types: torch.Tensor  # int16 [tiles, BLOCK_M, BLOCK_N]
    # the types present in tile i: tile_type_ids[tile_type_start[i]:tile_type_start[i + 1]]
    tile_type_start: torch.Tensor  # int32 [tiles + 1]
    tile_type_ids: torch.Tensor  # int32 [(tile, type) pairs], ascending per tile
    query_work: WorkItems  # blocks = query blocks, tiles = forward tiles
    window_start: torch.Tensor  # int32 [windows], first query slot of each window
    window_types: torch.Tensor  # int16 [windows, BLOCK_M keys, BLOCK_N query slots]
    key_work: WorkItems  # blocks = aligned blocks of BLOCK_M keys, tiles = windows

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """The plan's tensors, in the order ``from_tensors`` reads them: what the
        ``torch.library`` ops take in place of the plan object."""
        return (self.slot_node, self.tile_start, self.tile_types, self.tile_type_start, self.tile_type_ids,
                *_work_tensors(self.query_work),
                self.window_start, self.window_types, *_work_tensors(self.key_work))

    def sizes(self) -> Tuple[int, int, int, int]:
        """(block_m, block_n, query parts, key parts): the integers ``from_tensors`` needs."""
        return self.block_m, self.block_n, self.query_work.num_parts, self.key_work.num_parts

    @staticmethod
    def from_tensors(tensors: Sequence[torch.Tensor], sizes: Sequence[int], num_nodes: int) -> "TilePlan":
        """The plan of ``tensors()`` and ``sizes()`` (no copies)."""
        first = 5  # the query side's tensors before its work items
        window_start, window_types = tensors[first + WORK_TENSORS:first + 2 + WORK_TENSORS]
        query, key = tensors[first:first + WORK_TENSORS], tensors[first + 2 + WORK_TENSORS:]
        block_m, block_n, query_parts, key_parts = sizes
        return TilePlan(block_m, block_n, num_nodes, *tensors[:first], _work_from(query, query_parts),
                        window_start, window_types, _work_from(key, key_parts))

    @property
    def num_tiles(self) -> int:
        return self.tile_start.numel()

    @property
    def num_windows(self) -> int:
        return self.window_start.numel()


WORK_TENSORS = 3  # the tensors of one WorkItems


def _work_tensors(work: WorkItems) -> Tuple[torch.Tensor, ...]:
    return work.items, work.part_index, work.split_nodes


def _work_from(tensors: Sequence[torch.Tensor], num_parts: int) -> WorkItems:
    items, part_index, split_nodes = tensors
    return WorkItems(items, num_parts, part_index, split_nodes)


def query_order(graph: AttentionGraph, block_m: int) -> torch.Tensor:
    """Graph node of every query slot (-1 = empty), in blocks of ``block_m`` slots."""
    tree = graph.tree
    if tree is None:
        return F.pad(torch.arange(graph.num_nodes), (0, -graph.num_nodes % block_m), value=-1)
    sizes, offsets = tree.level_sizes, tree.level_offsets
    per_tier = max(block_m.bit_length() - 1, 1)
    parts = [torch.arange(sizes[0])]
    for first in range(1, len(sizes), per_tier):
        levels = range(first, min(first + per_tier, len(sizes)))
        top = levels[-1]
        blocks = -(-tree.num_tokens // (1 << top))
        slots = []
        for level in levels:  # per block: its 2^(top - level) spans of this level
            per_block = 1 << (top - level)
            index = torch.arange(blocks * per_block).view(blocks, per_block)
            slots.append(torch.where(index < sizes[level], offsets[level] + index, -1))
        slots = torch.cat(slots, 1)
        # 2^levels - 1 rows per block: pad to 2^levels, so that blocks never straddle a query
        # block (the power of two divides block_m)
        parts.append(F.pad(slots, (0, 1), value=-1).flatten())
    parts = [F.pad(p, (0, -p.numel() % block_m), value=-1) for p in parts]
    return torch.cat(parts)


def _greedy_windows(owner: torch.Tensor, position: torch.Tensor, width: int):
    """Fewest windows [start, start + width) covering every (owner, position) pair, per owner.

    Returns (owner, start) of the windows, sorted by owner then start."""
    span = int(position.max()) + width + 1
    points = torch.unique(owner * span + position)  # sorted
    first = torch.ones_like(points, dtype=torch.bool)
    first[1:] = points[1:] // span != points[:-1] // span
    starts, current = [], points[first]
    while current.numel():
        starts.append(current)
        following = torch.searchsorted(points, current + width)
        inside = following < points.numel()
        following = points[following[inside]]
        current = following[following // span == current[inside] // span]
    starts = torch.sort(torch.cat(starts)).values
    return starts // span, starts % span


def _type_tiles(owner, start, edge_owner, edge_position, edge_row, edge_type, rows, cols):
    """int16 [windows, rows, cols] types of the edges (-1 = none) placed in their windows.

    Edge e sits at (edge_row, edge_position - start) of the last window of its owner that
    starts at or before its position (the greedy cover guarantees it lies inside)."""
    span = int(max(int(start.max()), int(edge_position.max()))) + 1
    window = torch.searchsorted(owner * span + start, edge_owner * span + edge_position,
                                right=True) - 1
    tiles = torch.full((owner.numel(), rows, cols), -1, dtype=torch.int16)
    tiles[window, edge_row, edge_position - start[window]] = edge_type.to(torch.int16)
    return tiles


def _types_per_tile(tile_types: torch.Tensor, num_types: int):
    """(start int32 [tiles + 1], ids int32): the edge types present in each tile, ascending."""
    tile = torch.arange(tile_types.size(0)).view(-1, 1, 1).expand_as(tile_types)
    edge = tile_types >= 0
    pairs = torch.unique(tile[edge] * num_types + tile_types[edge].long())  # sorted by tile, type
    counts = torch.bincount(pairs // num_types, minlength=tile_types.size(0))
    start = F.pad(torch.cumsum(counts, 0), (1, 0))
    return start.to(torch.int32), (pairs % num_types).to(torch.int32)


def _work_items(owner: torch.Tensor, block_nodes: torch.Tensor, tiles_per_item: int) -> WorkItems:
    """Split the tile lists (tiles sorted by owner block) into items of <= tiles_per_item;
    ``block_nodes`` [blocks, BLOCK_M]: the graph node of each block's rows (-1 = none)."""
    num_blocks = block_nodes.size(0)
    counts = torch.bincount(owner, minlength=num_blocks)
    first = torch.cumsum(counts, 0) - counts
    parts = torch.clamp(-(-counts // tiles_per_item), min=1)  # an empty block: one empty item
    block = torch.repeat_interleave(torch.arange(num_blocks), parts)
    part_in_block = torch.arange(block.numel()) - (torch.cumsum(parts, 0) - parts)[block]
    # near-equal parts: part i of p takes tiles [i * c // p, (i + 1) * c // p)
    begin = first[block] + part_in_block * counts[block] // parts[block]
    end = first[block] + (part_in_block + 1) * counts[block] // parts[block]
    split = parts[block] > 1
    part_id = torch.full_like(block, -1)
    part_id[split] = torch.arange(int(split.sum()))
    split_blocks = torch.nonzero(parts > 1).flatten()
    num_parts = int(split.sum())
    max_parts = int(parts.max()) if split_blocks.numel() else 0
    part_index = torch.full((split_blocks.numel(), max_parts), num_parts, dtype=torch.int32)
    split_block_of = torch.full((num_blocks,), -1)
    split_block_of[split_blocks] = torch.arange(split_blocks.numel())
    part_index[split_block_of[block[split]], part_in_block[split]] = part_id[split].to(torch.int32)
    items = torch.stack([block, begin, end, part_id], 1).to(torch.int32)
    # longest first: the GPU starts programs in grid order, so the long ones (the top spans)
    # do not run alone at the end of the kernel
    items = items[torch.sort(end - begin, descending=True, stable=True).indices]
    return WorkItems(items, num_parts, part_index, block_nodes[split_blocks].to(torch.int32))


def build_plan(graph: AttentionGraph, block_m: int, block_n: int) -> TilePlan:
    """The plan of ``graph`` (with at least one edge) for these block sizes, on CPU; work
    items of at most ``TILES_PER_ITEM`` tiles."""
    if graph.num_edge_types > MAX_EDGE_TYPES:
        raise ValueError(f"the tiled graph attention stores edge types as int16: "
                         f"{graph.num_edge_types} types exceed {MAX_EDGE_TYPES}")
    if graph.num_edges == 0:
        raise ValueError("a tile plan needs a graph with at least one edge")
    slot_node = query_order(graph, block_m)
    slot_of = torch.full((graph.num_nodes,), -1)
    present = slot_node >= 0
    slot_of[slot_node[present]] = torch.nonzero(present).flatten()
    row_slot, key, types = slot_of[graph.rows()], graph.indices, graph.edge_type

    tile_block, tile_start = _greedy_windows(row_slot // block_m, key, block_n)
    tile_types = _type_tiles(tile_block, tile_start, row_slot // block_m, key,
                             row_slot % block_m, types, block_m, block_n)
    window_block, window_start = _greedy_windows(key // block_m, row_slot, block_n)
    window_types = _type_tiles(window_block, window_start, key // block_m, row_slot,
                               key % block_m, types, block_m, block_n)
    keys = torch.arange(-(-graph.num_nodes // block_m) * block_m)
    key_nodes = torch.where(keys < graph.num_nodes, keys, -1).view(-1, block_m)
    return TilePlan(
        block_m, block_n, graph.num_nodes, slot_node.to(torch.int32),
        tile_start.to(torch.int32), tile_types, *_types_per_tile(tile_types, graph.num_edge_types),
        _work_items(tile_block, slot_node.view(-1, block_m), TILES_PER_ITEM),
        window_start.to(torch.int32), window_types, _work_items(window_block, key_nodes, TILES_PER_ITEM))


def plan_on(graph: AttentionGraph, block_m: int, block_n: int, device) -> TilePlan:
    """``build_plan`` moved to ``device``, cached on the graph."""
    if torch.device(device).type == "cpu":
        return graph.derived("tile_plan", "cpu", lambda: build_plan(graph, block_m, block_n),
                             block_m, block_n)
    return graph.derived("tile_plan", device,
                         lambda: _to(plan_on(graph, block_m, block_n, "cpu"), device), block_m, block_n)


def _to(plan: TilePlan, device) -> TilePlan:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, WorkItems):
            return WorkItems(*(move(getattr(x, f)) for f in WorkItems.__dataclass_fields__))
        return x
    return TilePlan(*(move(getattr(plan, f)) for f in TilePlan.__dataclass_fields__))
