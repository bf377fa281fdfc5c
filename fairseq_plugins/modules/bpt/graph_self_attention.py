"""Multi-head graph self-attention (the GSA of BP-Transformer / SegTree), as an nn.Module.

Fairseq's projections (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) and incremental-state
hooks; the graph to attend over is an argument of every call:

    out = attn(x, graph, key_padding_mask)

``graph`` is an ``AttentionGraph`` over the N nodes of ``x`` (full-sequence pass), or, with an
``incremental_state``, a decoding step's graph: the rows of the nodes added this step over
the slots of the key/value cache (``binary_partition.causal_step_graph``). Both go through
the one public op, ``graph_attention``.

``out_rows=n`` returns only the first ``n`` nodes' outputs (every node still serves as a
key): a model's last layer, whose span nodes nobody reads, then skips their output
projection, and the layer (``graph_transformer_layers``) their FFN.

``equal_rows_from=n`` says that the rows from ``n`` on are equal (the span nodes entering a
model's first layer, all zero): they are projected once and repeated, which saves a third of
that layer's q/k/v projection work for every span node (about half of all rows).

Relative positions (Eq. 13 of the BPT paper): one learned vector per edge type, per layer,
shared by heads and added to keys.

The decoding cache: per layer, key and value buffers [B, H, capacity, D] written in place. A
step's graph says how many nodes exist after it (``graph.num_keys``), so the step writes its
new nodes' keys/values into the slots before that count and attends over the filled prefix (a
view): no per-step copy of the cache. The capacity doubles when it is reached (amortised O(1)
per node), and fairseq's reorder is free when the order is the identity (sampling, beam 1);
another order (beam search, a finished sentence dropped) copies the buffers, as fairseq's own
attention does.
"""

import uuid
from functools import partial
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from fairseq_plugins.graph_attention import AttentionGraph, graph_attention
from fairseq_plugins.modules.common.heads import merge_heads, split_heads
from fairseq_plugins.modules.common.recompute import recompute_norms

# nodes the decoding cache holds at first (about 32 tokens); then it doubles
INITIAL_CACHE_NODES = 64


class GraphSelfAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, num_edge_types: int, dropout: float = 0.0,
                 backend: str = "auto"):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by {num_heads} heads")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout, self.backend = dropout, backend
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.rel_key = nn.Parameter(torch.empty(num_edge_types, self.head_dim))
        self._state_key = f"graph_self_attention.{uuid.uuid4()}"
        self.reset_parameters()

    def reset_parameters(self):
        for proj in (self.q_proj, self.k_proj, self.v_proj):  # as fairseq's MultiheadAttention
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)
        nn.init.normal_(self.rel_key, std=self.head_dim ** -0.5)

    def forward(self, x: Tensor, graph: AttentionGraph, key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                out_rows: Optional[int] = None, equal_rows_from: Optional[int] = None,
                norm: Optional[nn.Module] = None, recompute_norm: bool = False) -> Tensor:
        """x: [N, B, C] node states (with ``incremental_state``: this step's new nodes);
        key_padding_mask: [B, N], True = absent node (full pass only); ``norm``: a pre-norm
        layer's layer norm, applied to x before the projections, its output recomputed in the
        backward with ``recompute_norm`` (not where ``equal_rows_from`` projects fewer rows
        than it normalises: those projections' outputs would be kept beside their repeats).

        Returns [out_rows or N, B, C]."""
        if not isinstance(graph, AttentionGraph):
            raise TypeError(f"graph self-attention needs an AttentionGraph, got {type(graph).__name__}")
        project = partial(self._projections, norm, equal_rows_from)
        recompute = recompute_norm and norm is not None and equal_rows_from is None
        q, k, v = (split_heads(t, self.num_heads) for t in (recompute_norms(project, x) if recompute else project(x)))
        if incremental_state is not None:
            if key_padding_mask is not None:
                raise ValueError("a decoding step attends over the cache: no key_padding_mask")
            k, v = self._cached_keys_values(incremental_state, k, v, graph.num_keys)
        elif key_padding_mask is not None:
            key_padding_mask = key_padding_mask.bool()
        out = graph_attention(q, k, v, graph, self.rel_key, key_padding_mask,
                              dropout_p=self.dropout if self.training else 0.0, backend=self.backend)
        out = merge_heads(out)  # a view of the kernels' time-first output
        if out_rows is not None:  # sliced time-first: its backward's zero-filled gradient is time-first too
            out = out[:out_rows]
        return self.out_proj(out)

    def _projections(self, norm: Optional[nn.Module], equal_rows_from: Optional[int], x: Tensor):
        if norm is not None:
            x = norm(x)
        return tuple(project_rows(proj, x, equal_rows_from) for proj in (self.q_proj, self.k_proj, self.v_proj))

    def _cached_keys_values(self, incremental_state, k: Tensor, v: Tensor, num_keys: int):
        """Write this step's keys/values ([B, H, new, D]) into the cache slots just before
        ``num_keys`` (growing the buffers when full); return the cache's first ``num_keys`` slots."""
        state = self._get_input_buffer(incremental_state)
        start = num_keys - k.size(2)
        if start < 0 or (start > 0 and "key_cache" not in state):
            raise ValueError(f"a decoding step over {num_keys} cached nodes with {k.size(2)} new ones "
                             f"needs the earlier steps' cache")
        buffers = [state.get("key_cache"), state.get("value_cache")]
        if buffers[0] is None or buffers[0].size(2) < num_keys:
            capacity = max(INITIAL_CACHE_NODES, num_keys, 2 * (0 if buffers[0] is None else buffers[0].size(2)))
            grown = [k.new_empty(k.size(0), k.size(1), capacity, k.size(3)) for _ in buffers]
            for old, new in zip(buffers, grown):
                if start:
                    new[:, :, :start] = old[:, :, :start]
            buffers = grown
            self._set_input_buffer(incremental_state, {"key_cache": buffers[0], "value_cache": buffers[1]})
        for buffer, new in zip(buffers, (k, v)):
            buffer[:, :, start:num_keys] = new
        return buffers[0][:, :, :num_keys], buffers[1][:, :, :num_keys]

    # fairseq incremental-state hooks (the decoder layer and beam search call these)
    def _get_input_buffer(self, incremental_state) -> Dict[str, Optional[Tensor]]:
        if incremental_state is None:
            return {}
        return incremental_state.get(self._state_key, {})

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        incremental_state[self._state_key] = buffer
        return incremental_state

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        buffer = self._get_input_buffer(incremental_state)
        if buffer and not is_identity(new_order, buffer["key_cache"].size(0)):
            self._set_input_buffer(incremental_state, {
                name: t.index_select(0, new_order) for name, t in buffer.items()})
        return incremental_state


def project_rows(proj: nn.Module, x: Tensor, equal_rows_from: Optional[int]) -> Tensor:
    """``proj(x)`` for [N, B, C] rows, the rows from ``equal_rows_from`` on (all equal to
    the first of them) projected once and repeated."""
    if equal_rows_from is None or equal_rows_from >= x.size(0) - 1:
        return proj(x)
    distinct = proj(x[: equal_rows_from + 1])
    repeated = distinct[equal_rows_from:].expand(x.size(0) - equal_rows_from - 1, -1, -1)
    return torch.cat([distinct, repeated])


def is_identity(order: Tensor, size: int) -> bool:
    """Whether reordering ``size`` rows by ``order`` leaves them as they are."""
    return order.numel() == size and bool(torch.equal(order, torch.arange(size, device=order.device)))
