"""The fast exact path of the graph attention for graphs laid out over a binary-partition tree.

``tree_block_attention`` computes exactly what ``graph_attention.graph_attention`` specifies, for
any ``AttentionGraph`` whose ``tree`` layout is set; the tree's shape (BPT, SegTree) only decides
how little of the work is wasted. How: queries are grouped so that the keys a group reads at each
level form one short band of that level; the bands of all levels side by side are the group's
score columns, so each product is one batched GEMM (see ``_tree_plan`` and ``_TreeAttention``).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

if TYPE_CHECKING:
    from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout


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


def _tree_plan(graph: "AttentionGraph", group_tokens: int, device) -> Tuple[_QuerySet, ...]:
    """Place every edge in a score column of its query set (cached per graph and device).

    The rows of a set are cut into groups covering ``group_tokens`` tokens (or one unit of
    the set, if larger). The keys a group reads at one level then form one short band of
    that level (or the whole level, when the band would be as wide), and the bands of all
    levels side by side are the columns of the group's scores: one GEMM per group. Bands are
    measured from the edges, so any graph laid out as a tree is computed exactly; the tree's
    shape only decides how little is wasted."""
    key = ("tree_plan", group_tokens, str(device))
    if key in graph._cache:
        return graph._cache[key]
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
            int((nodes >= 0).sum()), runs, blocks))
    graph._cache[key] = tuple(plan)
    return graph._cache[key]


def _nodes(x: torch.Tensor, band: _KeyBand) -> torch.Tensor:
    """The [C, size, ...] slice of one key level of [C, N, ...] node values."""
    return x[:, band.offset:band.offset + band.size]


def _pad_level(x: torch.Tensor, band: _KeyBand, groups: int, fill=0.0) -> torch.Tensor:
    """[C, size, ...] key-level values, padded so that every group's band lies inside."""
    if band.full:
        return x
    num_bands = -(-groups // band.share)
    right = max((num_bands - 1) * band.stride + band.width - band.left - x.size(1), 0)
    if band.left or right:  # F.pad would fill the whole result first: fill only the pads
        padded = x.new_empty(x.size(0), band.left + x.size(1) + right, *x.shape[2:])
        padded[:, :band.left].fill_(fill)
        padded[:, band.left:band.left + x.size(1)] = x
        padded[:, band.left + x.size(1):].fill_(fill)
        x = padded
    return x


def _windows(padded: torch.Tensor, band: _KeyBand, groups: int) -> torch.Tensor:
    """Padded [C, L, ...] level -> [C, groups, width, ...] view: the band of every group."""
    num_bands = -(-groups // band.share)
    windows = padded.unfold(1, band.width, band.stride)[:, :num_bands].movedim(-1, 2)
    if band.share > 1:  # levels coarser than a group: consecutive groups read one band
        windows = windows.repeat_interleave(band.share, dim=1)[:, :groups]
    return windows


def _add_unbanded(target: torch.Tensor, bands: torch.Tensor, band: _KeyBand) -> None:
    """Adjoint of ``_windows``: add [C, groups, width, D] band gradients onto [C, size, D] nodes.

    Column c of band b is node b * stride - left + c, so one stride-wide slice of the columns
    of consecutive bands is a run of consecutive nodes: the fold is ceil(width / stride) adds
    through strided views of the target (far faster than ``unfold``'s generic backward, and
    no copy), plus a few clipped adds for the bands that overhang either end of the level."""
    chunk, groups, width, dim = bands.shape
    if band.share > 1:  # groups that read one band: sum them first
        num_bands = -(-groups // band.share)
        bands = F.pad(bands, (0, 0, 0, 0, 0, num_bands * band.share - groups))
        bands = bands.view(chunk, num_bands, band.share, width, dim).sum(2)
        groups = num_bands
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


def _key_levels(x: torch.Tensor, queries: _QuerySet):
    """The key levels of [C, N, D] node values that the set reads, each padded once for all
    chunks (padding inside the chunk loop would copy every level once more per chunk)."""
    return [_pad_level(_nodes(x, band), band, queries.groups) for band in queries.keys]


def _gather_keys(levels, chunk: slice, queries: _QuerySet, out: torch.Tensor) -> torch.Tensor:
    """out [C, groups, W, D]: every group's keys (or values) of the chunk, levels side by side."""
    groups = queries.groups
    return torch.cat([level[chunk].unsqueeze(1).expand(-1, groups, -1, -1) if band.full
                      else _windows(level[chunk], band, groups)
                      for band, level in zip(queries.keys, levels)], 2, out=out)


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
        return None, (None if bool(queries.has_edge.all()) else queries.has_edge.unsqueeze(0))
    bsz, groups = key_padding_mask.size(0), queries.groups
    absent = torch.cat([_nodes(key_padding_mask, band)[:, None].expand(bsz, groups, band.size)
                        if band.full else _windows(_pad_level(_nodes(key_padding_mask, band), band,
                                                              groups, True), band, groups)
                        for band in queries.keys], 2)  # [B, groups, W]
    absent = absent.unsqueeze(2).expand(-1, -1, queries.group, -1).reshape(bsz, queries.padded, -1)
    return absent, queries.has_edge & ~(absent | queries.no_edge).all(-1)


def _set_rows(x: torch.Tensor, queries: _QuerySet) -> torch.Tensor:
    """[R, P, D] rows of the set: a view for one run (the tokens), else one copy of the runs
    side by side (a parallel copy; ``index_select`` on this axis runs on one thread). A slot
    past the end of its level reads a node of the next level (a level of ceil(n / 2^j)
    nodes, as ``TreeLayout`` requires, keeps it in range); such slots have no edges, so their
    output and gradient are zeroed."""
    blocks = queries.blocks
    runs = [x[:, first:first + blocks * per_block].unflatten(1, (blocks, per_block))
            for first, per_block, _ in queries.runs]
    rows = (runs[0] if len(runs) == 1 else torch.cat(runs, 2)).flatten(1, 2)
    missing = queries.padded - rows.size(1)
    return F.pad(rows, (0, 0, 0, missing)) if missing else rows


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


FLOATS_PER_CHUNK = 1 << 23  # scores + gathered keys handled at once (32 MB in fp32), measured


def _chunks(rows: int, queries: _QuerySet, dim: int):
    """(Row slices of about FLOATS_PER_CHUNK scores and gathered keys each, rows per slice).

    The chunk buffers are allocated once at that size: on CPU a fresh large allocation
    costs page faults on first touch."""
    per_row = queries.num_columns * (queries.padded + queries.groups * dim)
    step = min(max(1, FLOATS_PER_CHUNK // per_row), rows)
    return [slice(start, start + step) for start in range(0, rows, step)], step


def _grouped(x: torch.Tensor, queries: _QuerySet) -> torch.Tensor:
    """[C, P, X] -> [C, groups, group, X] (a view)."""
    return x.view(x.size(0), queries.groups, queries.group, x.size(-1))


class _TreeAttention(torch.autograd.Function):
    """All queries of a tree graph, set by set: per row group one GEMM against its key bands,
    one softmax per row, and a hand-written backward.

    Sentences x heads are processed in chunks of about ``FLOATS_PER_CHUNK`` floats, through
    buffers reused from chunk to chunk: on CPU this op is bound by memory traffic, not FLOPs.
    The backward reuses the saved probabilities and gathers the keys again instead of letting
    autograd keep every intermediate."""

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
        saved = []
        for queries in plan:
            q_rows = _set_rows(query, queries)
            absent, has_key = _presence(key_padding_mask, queries)
            probs = query.new_empty(rows, queries.padded, queries.num_columns)
            keep = (None if dropout_p == 0
                    else torch.empty_like(probs, dtype=torch.bool).bernoulli_(1 - dropout_p))
            set_out = query.new_empty(rows, queries.padded, dim)
            chunks, step = _chunks(rows, queries, dim)
            key_levels, value_levels = _key_levels(key, queries), _key_levels(value, queries)
            gathered = query.new_empty(step, queries.groups, queries.num_columns, dim)
            scaled = query.new_empty(step, queries.padded, dim)
            for chunk in chunks:
                q = torch.mul(q_rows[chunk], scale, out=scaled[:q_rows[chunk].size(0)])
                buffer = gathered[:q.size(0)]
                scores = probs[chunk]  # the scores become the probabilities in place
                keys = _gather_keys(key_levels, chunk, queries, buffer).flatten(0, 1)
                keys = keys.transpose(1, 2)
                q_groups = q.view(-1, queries.group, dim)
                score_groups = scores.view(keys.size(0), queries.group, -1)
                if rel_key is not None:
                    # q . rel_key[type] (-inf off the graph) gathered into the scores, then q . k
                    # added by the GEMM itself
                    table = F.pad(q @ rel_key.transpose(0, 1), (0, 1), value=float("-inf"))
                    torch.gather(table, -1, queries.column_type.expand_as(scores), out=scores)
                    score_groups.baddbmm_(q_groups, keys)
                else:
                    torch.bmm(q_groups, keys, out=score_groups)
                    scores.masked_fill_(queries.no_edge, float("-inf"))
                if absent is not None or has_key is not None:
                    sentence = torch.arange(rows, device=query.device)[chunk] // heads
                if absent is not None:
                    scores.masked_fill_(absent[sentence], float("-inf"))
                if has_key is not None:  # no present key: any finite row, its output is zeroed
                    scores.masked_fill_(~has_key[sentence % has_key.size(0)].unsqueeze(-1), 0.0)
                p = torch._softmax(scores, -1, False, out=scores)
                if keep is not None:
                    p = p * keep[chunk] / (1 - dropout_p)
                values = _gather_keys(value_levels, chunk, queries, buffer)
                torch.matmul(_grouped(p, queries), values, out=_grouped(set_out[chunk], queries))
            if has_key is not None:
                set_out.unflatten(0, (-1, heads)).mul_(has_key[:, None, :, None].to(set_out.dtype))
            _scatter_rows(out, set_out, queries)
            saved += [probs, keep, has_key]
        ctx.save_for_backward(query, key, value, rel_key, *saved)
        ctx.plan, ctx.scale, ctx.dropout_p, ctx.heads = plan, scale, dropout_p, heads
        ctx.covered = covered
        return out.view(bsz, heads, num_nodes, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, rel_key, *saved = ctx.saved_tensors
        scale, dropout_p, heads = ctx.scale, ctx.dropout_p, ctx.heads
        rows, num_nodes, dim = query.shape
        grad_out = grad_out.reshape(rows, num_nodes, dim)
        grad_query = (query.new_empty if ctx.covered else query.new_zeros)(rows, num_nodes, dim)
        grad_key, grad_value = (query.new_zeros(rows, num_nodes, dim) for _ in range(2))
        grad_rel = None if rel_key is None else torch.zeros_like(rel_key)
        for index, queries in enumerate(ctx.plan):
            probs, keep, has_key = saved[3 * index:3 * index + 3]
            q_rows = _set_rows(query, queries)
            d_out = _set_rows(grad_out, queries)
            if has_key is not None:
                d_out = (d_out.unflatten(0, (-1, heads))
                         * has_key[:, None, :, None].to(d_out.dtype)).flatten(0, 1)
            d_query = query.new_empty(rows, queries.padded, dim)
            chunks, step = _chunks(rows, queries, dim)
            key_levels, value_levels = _key_levels(key, queries), _key_levels(value, queries)
            gathered, d_gathered = (query.new_empty(step, queries.groups, queries.num_columns, dim)
                                    for _ in range(2))
            d_scores_buffer = probs.new_empty(step, queries.padded, queries.num_columns)
            scaled = query.new_empty(step, queries.padded, dim)
            for chunk in chunks:
                p, d_o = probs[chunk], _grouped(d_out[chunk], queries)
                size = p.size(0)
                q_scaled = torch.mul(q_rows[chunk], scale, out=scaled[:size])
                q = _grouped(q_scaled, queries)
                buffer, d_buffer = gathered[:size], d_gathered[:size]
                d_scores = d_scores_buffer[:size]
                dropped = p if keep is None else p * keep[chunk] / (1 - dropout_p)
                values = _gather_keys(value_levels, chunk, queries, buffer)
                torch.matmul(d_o, values.transpose(-1, -2), out=_grouped(d_scores, queries))
                torch.matmul(_grouped(dropped, queries).transpose(-1, -2), d_o, out=d_buffer)
                _scatter_keys(d_buffer, grad_value[chunk], queries)
                if keep is not None:
                    d_scores.mul_(keep[chunk]).div_(1 - dropout_p)
                torch._softmax_backward_data(d_scores, p, -1, p.dtype, grad_input=d_scores)
                d_grouped = _grouped(d_scores, queries)
                d_q = d_query[chunk]
                torch.matmul(d_grouped, _gather_keys(key_levels, chunk, queries, buffer),
                             out=_grouped(d_q, queries))
                torch.matmul(d_grouped.transpose(-1, -2), q, out=d_buffer)
                _scatter_keys(d_buffer, grad_key[chunk], queries)
                if rel_key is not None:
                    num_types = rel_key.size(0)
                    d_table = d_scores.new_zeros(*d_scores.shape[:2], num_types + 1)
                    d_table.scatter_add_(-1, queries.column_type.expand_as(d_scores), d_scores)
                    d_table = d_table[..., :num_types].reshape(-1, num_types)
                    d_q.view(-1, dim).addmm_(d_table, rel_key)
                    grad_rel.addmm_(d_table.transpose(0, 1), q_scaled.reshape(-1, dim))
                d_q.mul_(scale)
            _scatter_rows(grad_query, d_query, queries)
        shape = (rows // heads, heads, num_nodes, dim)
        return (grad_query.view(shape), grad_key.view(shape), grad_value.view(shape), grad_rel,
                None, None, None, None)


def tree_block_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                         dropout_p=0.0, scale=None, group_tokens: int = 32) -> torch.Tensor:
    """Fast exact path for graphs laid out as a tree (``graph.tree``; see the module docstring).

    group_tokens: tokens covered by one query group (see ``_tree_plan``); the default is the
    fastest measured on CPU."""
    if scale is None:
        scale = query.size(-1) ** -0.5
    plan = _tree_plan(graph, group_tokens, query.device)
    return _TreeAttention.apply(query, key, value, rel_key, key_padding_mask, plan, scale,
                                dropout_p)
