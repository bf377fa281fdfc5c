"""fairseq transformer layers whose self-attention runs over a graph of nodes.

Only ``build_self_attention`` changes: the layers use ``GraphSelfAttention`` and bind the graph
for the duration of fairseq's own forward (see ``GraphSelfAttention.attending``). Residuals,
layer norms, FFN, cross-attention and dropout are fairseq's, unchanged, except that with
``cross_attention_from="tokens"`` (BPT section 4.3) only the token nodes, which come first,
go through the encoder-attention sublayer and span nodes pass it unchanged.

``out_rows=n`` (a model's last layer) makes a layer return only its first ``n`` nodes: the
self-attention still reads every node as a key, but the rows nobody reads skip the output
projection, residuals, layer norms, cross-attention and FFN. The residual connection takes
the first rows of its shortcut for that.
"""

import contextlib

import torch
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from fairseq_plugins.modules.bpt.graph_self_attention import GraphSelfAttention


def first_rows_residual(x, residual):
    """fairseq's residual connection when the sublayer returned only the first rows."""
    return x + residual[: x.size(0)]


class GraphEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, num_edge_types: int, backend: str = "auto"):
        self._num_edge_types = num_edge_types  # read by build_self_attention in super().__init__
        self._backend = backend
        super().__init__(cfg)

    def build_self_attention(self, embed_dim, cfg):
        return GraphSelfAttention(embed_dim, cfg.encoder.attention_heads, self._num_edge_types,
                                  dropout=cfg.attention_dropout, backend=self._backend)

    def residual_connection(self, x, residual):
        return first_rows_residual(x, residual)

    def forward(self, x, encoder_padding_mask, graph, out_rows=None):
        """x: [N, B, C] node states; encoder_padding_mask: [B, N] absent nodes."""
        with self.self_attn.attending(graph, out_rows):
            return super().forward(x, encoder_padding_mask)


CROSS_ATTENTION_FROM = ("tokens", "nodes")


class GraphDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, num_edge_types: int, no_encoder_attn: bool = False, backend: str = "auto",
                 cross_attention_from: str = "nodes"):
        if cross_attention_from not in CROSS_ATTENTION_FROM:
            raise ValueError(f"cross_attention_from {cross_attention_from!r}: choose from {CROSS_ATTENTION_FROM}")
        self._num_edge_types = num_edge_types
        self._backend = backend
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        self.cross_attention_from = cross_attention_from

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("graph self-attention supports neither bias_kv/zero_attn nor "
                             "cross_self_attention")
        return GraphSelfAttention(embed_dim, cfg.decoder.attention_heads, self._num_edge_types,
                                  dropout=cfg.attention_dropout, backend=self._backend)

    def residual_connection(self, x, residual):
        return first_rows_residual(x, residual)

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                graph=None, self_attn_padding_mask=None, need_attn=False, need_head_weights=False,
                num_tokens=None, out_rows=None):
        """x: [N, B, C] node states (or this step's new nodes), the ``num_tokens`` token nodes
        first; graph: AttentionGraph or DecoderStep (with incremental_state)."""
        restrict = self.cross_attention_from == "tokens" and self.encoder_attn is not None \
            and encoder_out is not None
        if restrict and num_tokens is None:
            raise ValueError("cross-attention from token nodes only needs num_tokens")
        restrict = restrict and (out_rows is None or out_rows > num_tokens)  # else: tokens only already
        if out_rows is not None and encoder_padding_mask is not None and encoder_padding_mask.dim() == 3:
            encoder_padding_mask = encoder_padding_mask[:, :out_rows]  # a per-query mask (bpt_document)
        with self.self_attn.attending(graph, out_rows), \
                (self._cross_attention_from_first(num_tokens) if restrict else contextlib.nullcontext()):
            return super().forward(
                x, encoder_out, encoder_padding_mask, incremental_state,
                self_attn_padding_mask=self_attn_padding_mask, need_attn=need_attn,
                need_head_weights=need_head_weights,
            )

    @contextlib.contextmanager
    def _cross_attention_from_first(self, rows: int):
        """During fairseq's forward, the encoder attention takes only the first ``rows``
        queries and gives the other rows zeros, so their residual passes unchanged; the
        post-norm layer norm after it leaves those rows as they are (a pre-norm one feeds
        the attention, which drops them)."""

        total = []

        def first_rows(_module, args, kwargs):
            total.append(kwargs["query"].size(0))
            return args, dict(kwargs, query=kwargs["query"][:rows])

        def zero_rows(_module, args, kwargs, output):
            out, attn = output
            return torch.cat([out, out.new_zeros(total.pop() - rows, *out.shape[1:])]), attn

        def keep_rows(_module, args, output):
            return torch.cat([output[:rows], args[0][rows:]])

        hooks = [
            self.encoder_attn.register_forward_pre_hook(first_rows, with_kwargs=True),
            self.encoder_attn.register_forward_hook(zero_rows, with_kwargs=True),
            self.encoder_attn_layer_norm.register_forward_hook(keep_rows),
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
