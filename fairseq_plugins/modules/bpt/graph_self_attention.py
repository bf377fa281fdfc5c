"""Multi-head graph self-attention (the GSA of BP-Transformer / SegTree), as an nn.Module.

It is a drop-in ``self_attn`` for fairseq's transformer layers: same projections
(``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``), same call signature, same incremental-state
hooks. The one extra input, which graph to attend over, goes through a small seam:

    with layer.self_attn.attending(graph_or_step):
        layer(x, ...)          # fairseq's own layer forward, unchanged

``graph_or_step`` is an ``AttentionGraph`` over the N nodes of ``x`` (full-sequence pass), or a
``DecoderStep`` (incremental decoding: the rows of the nodes added this step, as a CSR over
the slots of the key/value cache). Other models (document-level attention, multi-scale
windows) reuse the seam by binding their own graphs.

``attending(graph, out_rows=n)`` returns only the first ``n`` nodes' outputs (every node
still serves as a key): a model's last layer, whose span nodes nobody reads, then skips their
output projection, and fairseq's layer (see ``graph_transformer_layers``) their FFN.

Relative positions (Eq. 13 of the BPT paper): one learned vector per edge type, per layer,
shared by heads and added to keys.
"""

import contextlib
import uuid
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from fairseq_plugins.graph_attention import AttentionGraph, csr_attention, graph_attention
from fairseq_plugins.modules.common.heads import merge_heads, split_heads


@dataclass(frozen=True)
class DecoderStep:
    """Rows of the nodes created in one decoding step, over the key/value cache slots.

    The new nodes' keys/values are appended to the cache first, so their slots are
    ``cache_size .. cache_size + num_new - 1``."""

    indptr: Tensor  # [num_new + 1]
    indices: Tensor  # cache slot of each key
    edge_type: Tensor


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
        self._bound = None
        self._out_rows = None
        self.reset_parameters()

    def reset_parameters(self):
        for proj in (self.q_proj, self.k_proj, self.v_proj):  # as fairseq's MultiheadAttention
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)
        nn.init.normal_(self.rel_key, std=self.head_dim ** -0.5)

    @contextlib.contextmanager
    def attending(self, over, out_rows: Optional[int] = None):
        """Bind the graph (or decoding step) the next forward calls attend over, and how many
        of the first nodes they return (None: all)."""
        if not isinstance(over, (AttentionGraph, DecoderStep)):
            raise TypeError(f"expected an AttentionGraph or DecoderStep, got {type(over)}")
        previous = self._bound, self._out_rows
        self._bound, self._out_rows = over, out_rows
        try:
            yield self
        finally:
            self._bound, self._out_rows = previous

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                need_weights: bool = False, attn_mask=None, **unused):
        """query: [N, B, C] node states (key/value must be the same tensor or None).

        key_padding_mask: [B, N], True = absent node. Returns (output [N, B, C], None)."""
        if self._bound is None:
            raise RuntimeError("GraphSelfAttention needs a graph: call it inside "
                               "`with module.attending(graph):`")
        if attn_mask is not None:
            raise ValueError("graph self-attention takes its pattern from the graph, not attn_mask")
        for other in (key, value):
            if other is not None and other is not query:
                raise ValueError("graph self-attention attends over the query nodes themselves")
        q, k, v = (split_heads(proj(query), self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        dropout = self.dropout if self.training else 0.0
        if incremental_state is None:
            if not isinstance(self._bound, AttentionGraph):
                raise RuntimeError("a DecoderStep is only valid with an incremental_state")
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.bool()
            out = graph_attention(q, k, v, self._bound, self.rel_key, key_padding_mask,
                                  dropout_p=dropout, backend=self.backend)
        else:
            step = self._bound
            if not isinstance(step, DecoderStep):
                raise RuntimeError("incremental decoding needs a DecoderStep bound")
            state = self._get_input_buffer(incremental_state)
            if "prev_key" in state:
                k = torch.cat([state["prev_key"], k], 2)
                v = torch.cat([state["prev_value"], v], 2)
            self._set_input_buffer(incremental_state, {"prev_key": k, "prev_value": v})
            out = csr_attention(q, k, v, step.indptr, step.indices, step.edge_type, self.rel_key,
                                None, dropout)
        if self._out_rows is not None:
            out = out[:, :, : self._out_rows]
        return self.out_proj(merge_heads(out)), None

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
        if buffer:
            self._set_input_buffer(incremental_state, {
                name: t.index_select(0, new_order) for name, t in buffer.items()})
        return incremental_state
