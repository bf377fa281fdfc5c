"""fairseq transformer layers whose self-attention runs over a graph of nodes.

``build_self_attention`` makes a ``GraphSelfAttention``, and ``forward`` is fairseq's layer
forward with the graph passed to it as an argument (fairseq's own forward has no place for
one). Residuals, layer norms (pre or post), FFN, cross-attention, dropout and fairseq's
NormFormer-style scalings (``scale_heads``, ``scale_attn``, ``scale_fc``, ``scale_resids``)
are fairseq's modules, applied in fairseq's order, except that with
``cross_attention_from="tokens"`` (BPT section 4.3) only the token nodes, which come first,
go through the encoder-attention sublayer and span nodes pass it unchanged.

``out_rows=n`` (a model's last layer) makes a layer return only its first ``n`` nodes: the
self-attention still reads every node as a key, but the rows nobody reads skip the output
projection, residuals, layer norms, cross-attention and FFN. The residual connection takes
the first rows of its shortcut for that.

``recompute_norms_ffn`` (``--graph-recompute-norms-ffn``) recomputes the FFN's layer norm and
hidden states in the backward, a chunk of rows at a time, and the self-attention's pre-norm
output (``recompute``): about half the saved activation memory of a pre-norm layer, for
one more first FFN product per row.
"""

from functools import partial

import torch
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from fairseq_plugins.modules.bpt.graph_self_attention import GraphSelfAttention
from fairseq_plugins.modules.common.recompute import recompute_rows


def first_rows_residual(x, residual):
    """fairseq's residual connection when the sublayer returned only the first rows."""
    return x + residual[: x.size(0)]


def _sublayer_output(layer, x, residual, norm):
    """Dropout, residual and (post-norm) layer norm after a sublayer, as fairseq does."""
    x = layer.residual_connection(layer.dropout_module(x), residual)
    return x if layer.normalize_before else norm(x)


def _self_attention(layer, x, graph, padding_mask, incremental_state, out_rows, equal_rows_from):
    """The graph self-attention over ``x``, the layer's pre-norm (if any) applied inside it
    (recomputed in the backward with ``layer.recompute_norms_ffn``)."""
    return layer.self_attn(x, graph, padding_mask, incremental_state, out_rows, equal_rows_from,
                           norm=layer.self_attn_layer_norm if layer.normalize_before else None,
                           recompute_norm=layer.recompute_norms_ffn)


def _feed_forward_rows(layer, ffn_layernorm, x):
    """The FFN sublayer's row-wise part: (pre-norm) layer norm, fc1, activation, fc2."""
    if layer.normalize_before:
        x = layer.final_layer_norm(x)
    x = layer.activation_dropout_module(layer.activation_fn(layer.fc1(x)))
    if ffn_layernorm is not None:
        x = ffn_layernorm(x)
    return layer.fc2(x)


def _feed_forward(layer, x, ffn_layernorm=None, w_resid=None):
    """fairseq's FFN sublayer (``ffn_layernorm``/``w_resid``: the decoder's scalings), its
    inner activations recomputed in the backward with ``layer.recompute_norms_ffn``."""
    residual = x
    rows = partial(_feed_forward_rows, layer, ffn_layernorm)
    x = recompute_rows(rows, x, layer.fc1.out_features) if layer.recompute_norms_ffn else rows(x)
    if w_resid is not None:
        residual = torch.mul(w_resid, residual)
    return _sublayer_output(layer, x, residual, layer.final_layer_norm)


class GraphEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, num_edge_types: int, backend: str = "auto",
                 recompute_norms_ffn: bool = False):
        self._num_edge_types = num_edge_types  # read by build_self_attention in super().__init__
        self._backend = backend
        super().__init__(cfg)
        self.recompute_norms_ffn = recompute_norms_ffn

    def build_self_attention(self, embed_dim, cfg):
        return GraphSelfAttention(embed_dim, cfg.encoder.attention_heads, self._num_edge_types,
                                  dropout=cfg.attention_dropout, backend=self._backend)

    def residual_connection(self, x, residual):
        return first_rows_residual(x, residual)

    def forward(self, x, encoder_padding_mask, graph, out_rows=None, equal_rows_from=None):
        """x: [N, B, C] node states; encoder_padding_mask: [B, N] absent nodes; graph: the
        ``AttentionGraph`` over the N nodes; ``equal_rows_from``: see ``GraphSelfAttention``.
        Returns [out_rows or N, B, C]."""
        residual = x
        x = _self_attention(self, x, graph, encoder_padding_mask, None, out_rows, equal_rows_from)
        x = _sublayer_output(self, x, residual, self.self_attn_layer_norm)
        return _feed_forward(self, x)


CROSS_ATTENTION_FROM = ("tokens", "nodes")


class GraphDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, num_edge_types: int, no_encoder_attn: bool = False, backend: str = "auto",
                 cross_attention_from: str = "nodes", recompute_norms_ffn: bool = False):
        if cross_attention_from not in CROSS_ATTENTION_FROM:
            raise ValueError(f"cross_attention_from {cross_attention_from!r}: choose from {CROSS_ATTENTION_FROM}")
        self._num_edge_types = num_edge_types
        self._backend = backend
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        self.cross_attention_from = cross_attention_from
        self.recompute_norms_ffn = recompute_norms_ffn

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
                num_tokens=None, out_rows=None, equal_rows_from=None):
        """x: [N, B, C] node states (or this step's new nodes), the ``num_tokens`` token nodes
        first; graph: the ``AttentionGraph`` over them (with ``incremental_state``: the
        decoding step's graph over the cache). Returns (x, cross-attention weights, None)."""
        if graph is None:
            raise ValueError("a graph decoder layer needs the graph to attend over")
        residual = x
        x = _self_attention(self, x, graph, self_attn_padding_mask, incremental_state, out_rows, equal_rows_from)
        if self.c_attn is not None:  # fairseq's scale_heads
            rows, bsz = x.size(0), x.size(1)
            x = torch.einsum("tbhd,h->tbhd", x.view(rows, bsz, self.nh, self.head_dim), self.c_attn)
            x = x.reshape(rows, bsz, self.embed_dim)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        x = _sublayer_output(self, x, residual, self.self_attn_layer_norm)

        attn = None
        if self.encoder_attn is not None and encoder_out is not None:
            rows = x.size(0)
            if self.cross_attention_from == "tokens":
                if num_tokens is None:
                    raise ValueError("cross-attention from token nodes only needs num_tokens")
                rows = min(rows, num_tokens)
            if encoder_padding_mask is not None and encoder_padding_mask.dim() == 3:
                encoder_padding_mask = encoder_padding_mask[:, :rows]  # a per-query mask (bpt_document)
            # split, not two slices: the backward then concatenates the two gradients instead of
            # zero-filling and adding two full-size buffers
            queries, spans = x.split([rows, x.size(0) - rows])
            attended, attn = self._cross_attention(queries, encoder_out, encoder_padding_mask,
                                                   incremental_state, need_attn, need_head_weights)
            x = torch.cat([attended, spans]) if spans.size(0) else attended
        x = _feed_forward(self, x, self.ffn_layernorm, self.w_resid)
        return x, attn, None

    def _cross_attention(self, x, encoder_out, encoder_padding_mask, incremental_state, need_attn,
                         need_head_weights):
        """fairseq's encoder-attention sublayer over the rows ``x``."""
        residual = x
        if self.normalize_before:
            x = self.encoder_attn_layer_norm(x)
        x, attn = self.encoder_attn(
            query=x, key=encoder_out, value=encoder_out, key_padding_mask=encoder_padding_mask,
            incremental_state=incremental_state, static_kv=True,
            need_weights=need_attn or need_head_weights or (not self.training and self.need_attn),
            need_head_weights=need_head_weights,
        )
        return _sublayer_output(self, x, residual, self.encoder_attn_layer_norm), attn
