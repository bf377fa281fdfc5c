"""The fast exact path of the graph attention for graphs laid out over a binary-partition tree.

``tree_block_attention`` computes exactly what ``graph_attention.graph_attention`` specifies, for
any ``AttentionGraph`` whose ``tree`` layout is set; the tree's shape (BPT, SegTree) only decides
how little of the work is wasted. How: queries are grouped so that the keys a group reads at each
level form one short band of that level; the bands of all levels side by side are the group's
score columns, so each product is one batched GEMM (see ``tree_plan`` and ``_TreeAttention``).
"""

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fairseq_plugins.graph_attention.precision import backward_without_autocast

if TYPE_CHECKING:
    from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout


GROUP_TOKENS = 32  # tokens per query group: the fastest measured on CPU


@dataclass(frozen=True)
class _KeyBand:
    """Where the keys of one tree level sit among the score columns of a query set."""

    offset: int  # first node of the key level in the graph
    size: int  # nodes in the key level
    full: bool  # every row group reads the whole key level
    share: int  # band mode: consecutive row groups that read the same band
    stride: int  # band mode: key nodes between consecutive bands
    left: int  # band mode: a band starts this many key nodes before its groups' first one
    width: int  # score columns of this key level (band width, or the level size)
    column: int  # first score column


@dataclass(frozen=True)
class _QuerySet:
    """Query nodes handled together: row slots in groups, and the keys each group reads."""

    nodes: torch.Tensor  # [padded] graph node of every row slot, -1 for an empty slot
    group: int  # rows per group; a group's keys at every level are one band of that level
    keys: Tuple[_KeyBand, ...]
    column_type: torch.Tensor  # [padded, W] edge type of every score column; num_edge_types = none
    no_edge: torch.Tensor  # [padded, W] bool
    has_edge: torch.Tensor  # [padded] bool; rows without one get a dummy column and zero output
    every_row_has_edge: bool  # has_edge.all(), known when planning (no device sync per call)
    filled: int  # row slots that hold a node
    # the slots as runs of consecutive nodes, block by block: (first node, nodes per block,
    # nodes of the run) per level (the last block of a run may overhang its level)
    runs: Tuple[Tuple[int, int, int], ...]
    blocks: int

    @property
    def padded(self) -> int:
        return self.nodes.numel()

    @property
    def groups(self) -> int:
        return self.padded // self.group

    @property
    def num_columns(self) -> int:
        return self.column_type.size(1)


def _query_sets(tree: "TreeLayout", group_tokens: int):
    """Row slots of the query sets: (nodes [padded], rows per unit, tokens per unit, blocks,
    runs: (first node, nodes per block, nodes) per level).

    Tokens form one set. Spans form tiers of log2(group_tokens) consecutive levels; a tier's
    spans are ordered block by block, where a block is the span of the tier's top level, so
    the spans under one block read the same tokens and a whole tier costs one pass over the
    keys instead of one pass per level."""
    offsets, sizes = tree.level_offsets, tree.level_sizes
    sets = [(torch.arange(sizes[0]), 1, 1, 1, ((0, sizes[0], sizes[0]),))]
    per_tier = max(group_tokens.bit_length() - 1, 1)
    for first in range(1, len(sizes), per_tier):
        levels = range(first, min(first + per_tier, len(sizes)))
        top = levels[-1]
        blocks = -(-tree.num_tokens // (1 << top))
        slots, runs = [], []
        for i in levels:  # per block: the 2^(top - i) spans of level i under it
            per_block = 1 << (top - i)
            index = torch.arange(blocks * per_block).view(blocks, per_block)
            slots.append(torch.where(index < sizes[i], offsets[i] + index, -1))
            runs.append((offsets[i], per_block, sizes[i]))
        slots = torch.cat(slots, 1)
        sets.append((slots.flatten(), slots.size(1), 1 << top, blocks, tuple(runs)))
    return sets


def tree_plan(graph: "AttentionGraph", group_tokens: int, device) -> Tuple[_QuerySet, ...]:
    """Place every edge in a score column of its query set (cached per graph and device).

    The rows of a set are cut into groups covering ``group_tokens`` tokens (or one unit of
    the set, if larger). The keys a group reads at one level then form one short band of
    that level (or the whole level, when the band would be as wide), and the bands of all
    levels side by side are the columns of the group's scores: one GEMM per group. Bands are
    measured from the edges, so any graph laid out as a tree is computed exactly; the tree's
    shape only decides how little is wasted."""
    return graph.derived("tree_plan", device, lambda: _build_tree_plan(graph, group_tokens, device),
                         group_tokens)


def _build_tree_plan(graph: "AttentionGraph", group_tokens: int, device) -> Tuple[_QuerySet, ...]:
    tree = graph.tree
    offsets, sizes = tree.level_offsets, tree.level_sizes
    node_level = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    node_index = torch.arange(graph.num_nodes) - torch.tensor(offsets)[node_level]
    rows, cols, types = graph.rows(), graph.indices, graph.edge_type
    key_level, key_index = node_level[cols], node_index[cols]
    plan = []
    for nodes, unit_rows, unit_tokens, blocks, runs in _query_sets(tree, group_tokens):
        tokens = max(unit_tokens, group_tokens)
        group = unit_rows * tokens // unit_tokens
        slot_of = torch.full((graph.num_nodes,), -1)
        slot_of[nodes[nodes >= 0]] = torch.nonzero(nodes >= 0).flatten()
        edge_slot = slot_of[rows]
        specs = []  # (edges, offset, size, full, share, stride, left, width)
        for j, key_size in enumerate(sizes):
            at = (edge_slot >= 0) & (key_level == j)
            if not bool(at.any()):
                continue
            share, stride = (1, tokens >> j) if (1 << j) <= tokens else ((1 << j) // tokens, 1)
            first = (edge_slot[at] // group // share) * stride
            left = int((first - key_index[at]).clamp_min(0).max())
            width = int((key_index[at] - first).max()) + left + 1
            if width < key_size:
                specs.append((at, offsets[j], key_size, False, share, stride, left, width))
            else:
                specs.append((at, offsets[j], key_size, True, 1, 0, 0, key_size))
        if not specs:
            continue  # no edges out of these nodes: their output stays zero
        nodes = F.pad(nodes, (0, -(-nodes.numel() // group) * group - nodes.numel()), value=-1)
        column_type = torch.full((nodes.numel(), sum(spec[-1] for spec in specs)),
                                 graph.num_edge_types)
        has_edge = torch.zeros(nodes.numel(), dtype=torch.bool)
        bands, column = [], 0
        for at, offset, size, full, share, stride, left, width in specs:
            slot, k = edge_slot[at], key_index[at]
            start = 0 if full else (slot // group // share) * stride - left
            column_type[slot, column + k - start] = types[at]
            has_edge[slot] = True
            bands.append(_KeyBand(offset, size, full, share, stride, left, width, column))
            column += width
        column_type[~has_edge, 0] = 0  # keeps the softmax of edgeless and empty rows finite
        plan.append(_QuerySet(
            nodes.to(device), group, tuple(bands), column_type.to(device),
            (column_type == graph.num_edge_types).to(device), has_edge.to(device),
            bool(has_edge.all()), int((nodes >= 0).sum()), runs, blocks))
    return tuple(plan)


def _nodes(x: torch.Tensor, band: _KeyBand) -> torch.Tensor:
    """The [C, size, ...] slice of one key level of [C, N, ...] node values."""
    return x[:, band.offset:band.offset + band.size]


def _padding(band: _KeyBand, groups: int) -> Tuple[int, int]:
    """(left, right): key nodes to add before and after a level so that every band lies inside."""
    if band.full:
        return 0, 0
    num_bands = -(-groups // band.share)
    return band.left, max((num_bands - 1) * band.stride + band.width - band.left - band.size, 0)


def _pad_level(x: torch.Tensor, band: _KeyBand, groups: int, fill=0.0) -> torch.Tensor:
    """[C, size, ...] key-level values, padded with ``fill`` so that every group's band lies inside."""
    left, right = _padding(band, groups)
    return torch.cat([x.new_full((x.size(0), left, *x.shape[2:]), fill), x,
                      x.new_full((x.size(0), right, *x.shape[2:]), fill)], 1)


def _windows(padded: torch.Tensor, band: _KeyBand, groups: int) -> torch.Tensor:
    """Padded [C, L, ...] level -> [C, groups, width, ...] view: the band of every group."""
    num_bands = -(-groups // band.share)
    windows = padded.unfold(1, band.width, band.stride)[:, :num_bands].movedim(-1, 2)
    if band.share > 1:  # levels coarser than a group: consecutive groups read one band
        windows = windows.repeat_interleave(band.share, dim=1)[:, :groups]
    return windows


MAX_SHIFTED_ADDS = 4  # more (coarse levels: narrow strides, small levels) cost more in calls


@functools.lru_cache(maxsize=1024)
def _fold_index(band: _KeyBand, num_bands: int, device: torch.device):
    """(positions, nodes): the band columns of ``num_bands`` bands (flattened [bands x width])
    that lie inside the level, and the key node of each."""
    node = ((torch.arange(num_bands) * band.stride - band.left)[:, None]
            + torch.arange(band.width)).flatten()
    positions = torch.nonzero((node >= 0) & (node < band.size)).flatten()
    return positions.to(device), node[positions].to(device)


def _add_unbanded(target: torch.Tensor, bands: torch.Tensor, band: _KeyBand) -> None:
    """Adjoint of ``_windows``: add [C, groups, width, D] band gradients onto [C, size, D] nodes.

    Column c of band b is node b * stride - left + c, so one stride-wide slice of the columns
    of consecutive bands is a run of consecutive nodes: the fold is ceil(width / stride) adds
    through strided views of the target (far faster than ``unfold``'s generic backward, and
    no copy), plus a few clipped adds for the bands that overhang either end of the level. A
    coarse level (a stride of a few nodes: many narrow runs) instead takes one ``index_add_``
    over a cached index (the level is small, so its serial loop costs less than the calls)."""
    chunk, groups, width, dim = bands.shape
    if band.share > 1:  # groups that read one band: sum them first
        num_bands = -(-groups // band.share)
        bands = F.pad(bands, (0, 0, 0, 0, 0, num_bands * band.share - groups))
        bands = bands.view(chunk, num_bands, band.share, width, dim).sum(2)
        groups = num_bands
    if -(-width // band.stride) > MAX_SHIFTED_ADDS:  # a coarse level: one indexed add
        positions, nodes = _fold_index(band, groups, target.device)
        target.index_add_(1, nodes, bands.flatten(1, 2).index_select(1, positions))
        return
    stride, size = band.stride, band.size
    for low in range(0, width, stride):
        run = min(stride, width - low)
        first = low - band.left  # node of column `low` of band 0
        # bands whose run lies inside [0, size): one strided add
        inner_lo = max(0, -(first // stride))
        inner_hi = min(groups, (size - run - first) // stride + 1)
        if inner_lo < inner_hi:
            view = target.as_strided(
                (chunk, inner_hi - inner_lo, run, dim),
                (target.stride(0), stride * target.stride(1), target.stride(1), target.stride(2)),
                target.storage_offset() + (inner_lo * stride + first) * target.stride(1))
            view.add_(bands[:, inner_lo:inner_hi, low:low + run])
        for b in [*range(min(inner_lo, groups)), *range(max(inner_hi, inner_lo), groups)]:
            start = b * stride + first
            lo, hi = max(start, 0), min(start + run, size)
            if lo < hi:
                target[:, lo:hi] += bands[:, b, low + lo - start:low + hi - start]


class _Workspace:
    """Chunk buffers carved from one flat allocation that every query set reuses: the sets'
    buffers differ in shape, and separate allocations would each add to the peak memory
    (and on CPU cost page faults when first touched)."""

    def __init__(self, like: torch.Tensor, floats: int):
        self.flat, self.used = like.new_empty(floats), 0

    def take(self, *shape: int) -> torch.Tensor:
        size = math.prod(shape)
        if self.used + size > self.flat.numel():
            raise RuntimeError(f"tree attention workspace of {self.flat.numel()} floats is too "
                               f"small for a {shape} buffer (a bug in _row_floats)")
        self.used += size
        return self.flat[self.used - size:self.used].view(shape)

    def clear(self) -> None:
        self.used = 0


class _Levels:
    """The key levels of [R, N, D] node values that a query set reads, gathered chunk by chunk.

    A level that some band overhangs is copied, chunk by chunk, into a workspace buffer with
    zero pads on either side (pads filled once per set): padding all rows at once would hold
    a copy of the keys and values as large as the inputs."""

    def __init__(self, x: torch.Tensor, queries: _QuerySet, workspace: _Workspace, step: int):
        self.x, self.queries, self.padded = x, queries, []
        for band in queries.keys:
            left, right = _padding(band, queries.groups)
            buffer = None
            if left or right:
                buffer = workspace.take(step, left + band.size + right, x.size(-1))
                buffer[:, :left].zero_()
                buffer[:, left + band.size:].zero_()
            self.padded.append((buffer, left))

    @staticmethod
    def floats(queries: _QuerySet, dim: int) -> int:
        """Workspace floats per row of the level buffers."""
        return sum(sum(_padding(band, queries.groups)) + band.size for band in queries.keys
                   if any(_padding(band, queries.groups))) * dim

    def gather(self, chunk: slice, out: torch.Tensor) -> torch.Tensor:
        """out [C, groups, W, D]: every group's keys (or values) of the chunk, levels side by side."""
        groups, parts, x = self.queries.groups, [], self.x[chunk]
        for band, (buffer, left) in zip(self.queries.keys, self.padded):
            level = _nodes(x, band)
            if band.full:
                parts.append(level.unsqueeze(1).expand(-1, groups, -1, -1))
                continue
            if buffer is not None:
                buffer = buffer[:level.size(0)]
                buffer[:, left:left + band.size].copy_(level)
                level = buffer
            parts.append(_windows(level, band, groups))
        return torch.cat(parts, 2, out=out)


def _scatter_keys(d_keys: torch.Tensor, grad: torch.Tensor, queries: _QuerySet) -> None:
    """Adjoint of ``_gather_keys``: add [C, groups, W, D] gradients onto the levels of grad."""
    for band in queries.keys:
        d = d_keys[:, :, band.column:band.column + band.width]
        if band.full:
            _nodes(grad, band).add_(d.sum(1))
        else:
            _add_unbanded(_nodes(grad, band), d, band)


def _presence(key_padding_mask, queries: _QuerySet):
    """([B, P, W] bool absent key of each column or None, [B, P] bool row has a key or None)."""
    if key_padding_mask is None:
        return None, None if queries.every_row_has_edge else queries.has_edge.unsqueeze(0)
    bsz, groups = key_padding_mask.size(0), queries.groups
    absent = torch.cat([_nodes(key_padding_mask, band)[:, None].expand(bsz, groups, band.size)
                        if band.full else _windows(_pad_level(_nodes(key_padding_mask, band), band,
                                                              groups, True), band, groups)
                        for band in queries.keys], 2)  # [B, groups, W]
    absent = absent.unsqueeze(2).expand(-1, -1, queries.group, -1).reshape(bsz, queries.padded, -1)
    return absent, queries.has_edge & ~(absent | queries.no_edge).all(-1)


def _set_rows(x: torch.Tensor, queries: _QuerySet, buffer: torch.Tensor) -> torch.Tensor:
    """[C, P, D] rows of the set from [C, N, D] node values: a view when the set is one run
    with no padding slot (the tokens, mostly), else a copy of the runs side by side into
    ``buffer`` ([>= C, P, D], padding slots zeroed once; a parallel copy, where
    ``index_select`` on this axis runs on one thread). A slot past the end of its level reads
    a node of the next level (a level of ceil(n / 2^j) nodes, as ``TreeLayout`` requires,
    keeps it in range); such slots have no edges, so their output and gradient are zeroed."""
    blocks = queries.blocks
    unit_rows = sum(per_block for _, per_block, _ in queries.runs)
    runs = [x[:, first:first + blocks * per_block].unflatten(1, (blocks, per_block))
            for first, per_block, _ in queries.runs]
    if len(runs) == 1 and blocks * unit_rows == queries.padded:
        return runs[0].flatten(1, 2)
    rows = buffer[:x.size(0)]
    body = rows[:, :blocks * unit_rows].unflatten(1, (blocks, unit_rows))
    column = 0
    for run in runs:
        body[:, :, column:column + run.size(2)].copy_(run)
        column += run.size(2)
    return rows


def _row_buffer(workspace: _Workspace, queries: _QuerySet, step: int, dim: int) -> torch.Tensor:
    """A [step, P, dim] workspace buffer for ``_set_rows``, its padding slots zeroed."""
    unit_rows = sum(per_block for _, per_block, _ in queries.runs)
    buffer = workspace.take(step, queries.padded, dim)
    buffer[:, queries.blocks * unit_rows:].zero_()
    return buffer


def _scatter_rows(out: torch.Tensor, rows: torch.Tensor, queries: _QuerySet) -> None:
    """The inverse of ``_set_rows``: out[:, node of each filled slot] = that slot's row."""
    unit_rows = sum(per_block for _, per_block, _ in queries.runs)
    rows = rows[:, :queries.blocks * unit_rows].unflatten(1, (queries.blocks, unit_rows))
    column = 0
    for first, per_block, count in queries.runs:
        run = rows[:, :, column:column + per_block]
        whole = count // per_block  # blocks whose nodes all exist
        end = first + whole * per_block
        out[:, first:end].unflatten(1, (whole, per_block)).copy_(run[:, :whole])
        if count > whole * per_block:
            out[:, end:first + count] = run[:, whole, :count - whole * per_block]
        column += per_block


FLOATS_PER_CHUNK = 1 << 23  # the backward's chunk buffers on CPU (32 MB in fp32), measured
# on a GPU: big kernels over many rows at once, 512 MB of buffers (not yet measured)
FLOATS_PER_CHUNK_GPU = 1 << 27


def _row_floats(queries: _QuerySet, dim: int, types: int) -> int:
    """Workspace floats per (sentence x head) row of the backward, the larger pass: probabilities
    and score gradients, gathered keys, values and their gradients, three row buffers, the
    type table (``types`` relative-position vectors, 0 for none) and the key and value level
    buffers."""
    return (2 * queries.padded * queries.num_columns + 3 * queries.groups * queries.num_columns * dim
            + queries.padded * (3 * dim + 1 + (types + 1 if types else 0))
            + 2 * _Levels.floats(queries, dim))


def _chunks(rows: int, queries: _QuerySet, dim: int, types: int, device: torch.device):
    """(Row slices of about FLOATS_PER_CHUNK workspace floats each, rows per slice)."""
    budget = FLOATS_PER_CHUNK if device.type == "cpu" else FLOATS_PER_CHUNK_GPU
    step = min(max(1, budget // _row_floats(queries, dim, types)), rows)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)], step


def _workspace(like: torch.Tensor, plan, rows: int, types: int) -> _Workspace:
    """One workspace large enough for the chunk buffers of every query set of the plan."""
    dim = like.size(-1)
    return _Workspace(like, max(_chunks(rows, queries, dim, types, like.device)[1]
                                * _row_floats(queries, dim, types) for queries in plan))


def _dropout_keep(buffer: torch.Tensor, dropout_p: float, seed: int) -> torch.Tensor:
    """Fill ``buffer`` with a keep mask drawn from ``seed``: the backward draws the same
    mask again instead of storing it (CPU ``bernoulli_`` gives the same draw at any
    thread count)."""
    generator = None
    if buffer.device.type != "meta":  # the meta device has no generator
        generator = torch.Generator(buffer.device).manual_seed(seed)
    return buffer.bernoulli_(1 - dropout_p, generator=generator)


def _type_table(workspace: "_Workspace", queries: _QuerySet, step: int, rel_key) -> torch.Tensor:
    """A [step, P, types + 1] workspace buffer for q . rel_key[type] (the last type: columns
    off the graph)."""
    return workspace.take(step, queries.padded, rel_key.size(0) + 1)


def _masked_scores(q: torch.Tensor, keys: torch.Tensor, queries: _QuerySet, rel_key, table,
                   absent, has_key, sentence, out: torch.Tensor) -> torch.Tensor:
    """out [C, P, W]: the chunk's scores, -inf off the graph and on absent keys.

    q: [C, P, D] queries times the scale; keys: [C, groups, W, D] gathered keys; table: a
    ``_type_table`` buffer (with rel_key); sentence: [C] sentence of each row. A row without a
    present key is set to zeros (any finite row: its output is zeroed)."""
    dim = q.size(-1)
    keys = keys.flatten(0, 1).transpose(1, 2)
    q_groups = q.view(-1, queries.group, dim)
    score_groups = out.view(keys.size(0), queries.group, -1)
    if rel_key is not None:
        # q . rel_key[type] (-inf off the graph) gathered into the scores, then q . k added by
        # the GEMM itself
        table = table[:q.size(0)]
        torch.matmul(q, rel_key.transpose(0, 1), out=table[..., :-1])
        table[..., -1].fill_(float("-inf"))
        torch.gather(table, -1, queries.column_type.expand_as(out), out=out)
        score_groups.baddbmm_(q_groups, keys)
    else:
        torch.bmm(q_groups, keys, out=score_groups)
        out.masked_fill_(queries.no_edge, float("-inf"))
    if absent is not None:
        out.masked_fill_(absent[sentence], float("-inf"))
    if has_key is not None:
        out.masked_fill_(~has_key[sentence % has_key.size(0)].unsqueeze(-1), 0.0)
    return out


LOG2_E = math.log2(math.e)


def _grouped(x: torch.Tensor, queries: _QuerySet) -> torch.Tensor:
    """[C, P, X] -> [C, groups, group, X] (a view)."""
    return x.view(x.size(0), queries.groups, queries.group, x.size(-1))


class _TreeAttention(torch.autograd.Function):
    """All queries of a tree graph, set by set: per row group one GEMM against its key bands,
    one softmax per row, and a hand-written backward that keeps no probabilities.

    Sentences x heads are processed in chunks through one workspace of about
    ``FLOATS_PER_CHUNK`` floats reused from chunk to chunk and set to set: on CPU this op is
    bound by memory traffic, not FLOPs. As in flash attention, the forward saves one
    log-sum-exp per row (and the output); the backward recomputes each chunk's scores from
    it, and draws the dropout mask again from a seed. Memory beyond the inputs, output and
    gradients is the workspace."""

    @staticmethod
    def forward(ctx, query, key, value, rel_key, key_padding_mask, plan, scale, dropout_p):
        bsz, heads, num_nodes, dim = query.shape
        rows = bsz * heads
        # contiguous (sentence x head)-major rows: every chunk is one block of memory
        query, key, value = (x.reshape(rows, num_nodes, dim).contiguous()
                             for x in (query, key, value))
        # every node is a row of some set, unless a set without edges was left out of the plan
        covered = sum(queries.filled for queries in plan) == num_nodes
        out = (query.new_empty if covered else query.new_zeros)(rows, num_nodes, dim)
        seed = int(torch.randint(1 << 62, ())) if dropout_p > 0 else 0  # CPU generator: no sync
        types = 0 if rel_key is None else rel_key.size(0)
        workspace, saved = _workspace(query, plan, rows, types), []
        for index, queries in enumerate(plan):
            absent, has_key = _presence(key_padding_mask, queries)
            chunks, step = _chunks(rows, queries, dim, types, query.device)
            workspace.clear()
            keys, values = (_Levels(x, queries, workspace, step) for x in (key, value))
            gathered = workspace.take(step, queries.groups, queries.num_columns, dim)
            scores_buffer = workspace.take(step, queries.padded, queries.num_columns)
            scaled, set_out = (_row_buffer(workspace, queries, step, dim) for _ in range(2))
            table = None if rel_key is None else _type_table(workspace, queries, step, rel_key)
            keep_buffer = (None if dropout_p == 0 else
                           torch.empty_like(scores_buffer, dtype=torch.bool))
            lse = query.new_empty(rows, queries.padded)
            for chunk in chunks:
                size = chunk.stop - chunk.start
                q = torch.mul(_set_rows(query[chunk], queries, scaled), scale, out=scaled[:size])
                sentence = torch.arange(chunk.start, chunk.stop, device=query.device) // heads
                scores = _masked_scores(q, keys.gather(chunk, gathered[:size]), queries, rel_key,
                                        table, absent, has_key, sentence, scores_buffer[:size])
                row_max = scores.amax(-1)
                p = torch._softmax(scores, -1, False, out=scores)
                # the largest probability is exp(0) / sum: log-sum-exp = max - log(it), kept
                # in base 2 for the backward's exp2
                torch.sub(row_max, p.amax(-1).log_(), out=lse[chunk]).mul_(LOG2_E)
                if keep_buffer is not None:
                    keep = _dropout_keep(keep_buffer[:size], dropout_p,
                                         seed + index * rows + chunk.start)
                    p.mul_(keep).mul_(1 / (1 - dropout_p))
                o = set_out[:size]
                torch.matmul(_grouped(p, queries), values.gather(chunk, gathered[:size]),
                             out=_grouped(o, queries))
                if has_key is not None:
                    o.mul_(has_key[sentence % has_key.size(0)].unsqueeze(-1).to(o.dtype))
                _scatter_rows(out[chunk], o, queries)
            saved += [lse, absent, has_key]
        result = out.view(bsz, heads, num_nodes, dim)
        ctx.save_for_backward(query, key, value, rel_key, result, *saved)
        ctx.plan, ctx.scale, ctx.dropout_p, ctx.heads = plan, scale, dropout_p, heads
        ctx.covered, ctx.seed = covered, seed
        return result

    @staticmethod
    @backward_without_autocast
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, rel_key, out, *saved = ctx.saved_tensors
        scale, dropout_p, heads = ctx.scale, ctx.dropout_p, ctx.heads
        rows, num_nodes, dim = query.shape
        grad_out = grad_out.reshape(rows, num_nodes, dim)
        types = 0 if rel_key is None else rel_key.size(0)
        workspace = _workspace(query, ctx.plan, rows, types)
        # delta = rowsum(dO * O) = rowsum(P * dP): the softmax backward's row term, per node
        delta = query.new_empty(rows, num_nodes, 1)
        step = max(1, workspace.flat.numel() // (num_nodes * dim))
        for start in range(0, rows, step):
            chunk = slice(start, start + step)
            product = workspace.take(grad_out[chunk].numel()).view_as(grad_out[chunk])
            torch.mul(grad_out[chunk], out.reshape(rows, num_nodes, dim)[chunk], out=product)
            torch.sum(product, -1, keepdim=True, out=delta[chunk])
            workspace.clear()
        grad_query = (query.new_empty if ctx.covered else query.new_zeros)(rows, num_nodes, dim)
        grad_key, grad_value = (query.new_zeros(rows, num_nodes, dim) for _ in range(2))
        grad_rel = None if rel_key is None else torch.zeros_like(rel_key)
        for index, queries in enumerate(ctx.plan):
            lse, absent, has_key = saved[3 * index:3 * index + 3]
            chunks, step = _chunks(rows, queries, dim, types, query.device)
            workspace.clear()
            keys, values = (_Levels(x, queries, workspace, step) for x in (key, value))
            gathered_keys, gathered_values, d_gathered = (
                workspace.take(step, queries.groups, queries.num_columns, dim) for _ in range(3))
            probs_buffer, d_scores_buffer = (
                workspace.take(step, queries.padded, queries.num_columns) for _ in range(2))
            scaled, d_out_rows, d_query = (_row_buffer(workspace, queries, step, dim)
                                           for _ in range(3))
            delta_rows = _row_buffer(workspace, queries, step, 1)
            table = None if rel_key is None else _type_table(workspace, queries, step, rel_key)
            keep_buffer = (None if dropout_p == 0 else
                           torch.empty_like(probs_buffer, dtype=torch.bool))
            for chunk in chunks:
                size = chunk.stop - chunk.start
                sentence = torch.arange(chunk.start, chunk.stop, device=query.device) // heads
                q_scaled = torch.mul(_set_rows(query[chunk], queries, scaled), scale,
                                     out=scaled[:size])
                q = _grouped(q_scaled, queries)
                keys_chunk = keys.gather(chunk, gathered_keys[:size])
                p = _masked_scores(q_scaled, keys_chunk, queries, rel_key, table, absent,
                                   has_key, sentence, probs_buffer[:size])
                # exp2, not exp: ATen's vectorized exp takes a slow path on -inf (the masked
                # columns), 4x slower over these buffers; exp2 does not
                p.mul_(LOG2_E).sub_(lse[chunk].unsqueeze(-1)).exp2_()
                d_o = _set_rows(grad_out[chunk], queries, d_out_rows)
                row_delta = _set_rows(delta[chunk], queries, delta_rows)
                if has_key is not None:  # rows without a present key (or a node) output zeros
                    present = has_key[sentence % has_key.size(0)].unsqueeze(-1)
                    d_o = torch.mul(d_o, present, out=d_out_rows[:size])
                    row_delta = torch.mul(row_delta, present, out=delta_rows[:size])
                d_o = _grouped(d_o, queries)
                d_scores = d_scores_buffer[:size]
                if dropout_p > 0:
                    keep = _dropout_keep(keep_buffer[:size], dropout_p,
                                         ctx.seed + index * rows + chunk.start)
                    dropped = torch.mul(p, keep, out=d_scores).mul_(1 / (1 - dropout_p))
                else:
                    dropped = p
                d_bands = d_gathered[:size]
                torch.matmul(_grouped(dropped, queries).transpose(-1, -2), d_o, out=d_bands)
                _scatter_keys(d_bands, grad_value[chunk], queries)
                values_chunk = values.gather(chunk, gathered_values[:size])
                torch.matmul(d_o, values_chunk.transpose(-1, -2), out=_grouped(d_scores, queries))
                if dropout_p > 0:
                    d_scores.mul_(keep).mul_(1 / (1 - dropout_p))
                d_scores.sub_(row_delta).mul_(p)  # dS = P * (dP - delta)
                d_grouped = _grouped(d_scores, queries)
                d_q = d_query[:size]
                torch.matmul(d_grouped, keys_chunk, out=_grouped(d_q, queries))
                torch.matmul(d_grouped.transpose(-1, -2), q, out=d_bands)
                _scatter_keys(d_bands, grad_key[chunk], queries)
                if rel_key is not None:
                    d_table = table[:size].zero_()  # the scores are done with the table
                    d_table.scatter_add_(-1, queries.column_type.expand_as(d_scores), d_scores)
                    d_table = d_table[..., :types].reshape(-1, types)
                    d_q.view(-1, dim).addmm_(d_table, rel_key)
                    grad_rel.addmm_(d_table.transpose(0, 1), q_scaled.reshape(-1, dim))
                d_q.mul_(scale)
                _scatter_rows(grad_query[chunk], d_q, queries)
        shape = (rows // heads, heads, num_nodes, dim)
        return (grad_query.view(shape), grad_key.view(shape), grad_value.view(shape), grad_rel,
                None, None, None, None)


def tree_block_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                         dropout_p=0.0, scale=None, group_tokens: int = GROUP_TOKENS) -> torch.Tensor:
    """Fast exact path for graphs laid out as a tree (``graph.tree``; see the module docstring).

    group_tokens: tokens covered by one query group (see ``tree_plan``); the default is the
    fastest measured on CPU."""
    if scale is None:
        scale = query.size(-1) ** -0.5
    plan = tree_plan(graph, group_tokens, query.device)
    if rel_key is not None:
        rel_key = rel_key.to(query.dtype)  # autograd returns its gradient in its own dtype
    return _TreeAttention.apply(query, key, value, rel_key, key_padding_mask, plan, scale,
                                dropout_p)
