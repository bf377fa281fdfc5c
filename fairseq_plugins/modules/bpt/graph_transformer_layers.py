"""fairseq transformer layers whose self-attention runs over a graph of nodes.

Only ``build_self_attention`` changes: the layers use ``GraphSelfAttention`` and bind the graph
for the duration of fairseq's own forward (see ``GraphSelfAttention.attending``). Residuals,
layer norms, FFN, cross-attention and dropout are fairseq's, unchanged.
"""

from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from fairseq_plugins.modules.bpt.graph_self_attention import GraphSelfAttention


class GraphEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, num_edge_types: int):
        self._num_edge_types = num_edge_types  # read by build_self_attention in super().__init__
        super().__init__(cfg)

    def build_self_attention(self, embed_dim, cfg):
        return GraphSelfAttention(embed_dim, cfg.encoder.attention_heads, self._num_edge_types,
                                  dropout=cfg.attention_dropout)

    def forward(self, x, encoder_padding_mask, graph):
        """x: [N, B, C] node states; encoder_padding_mask: [B, N] absent nodes."""
        with self.self_attn.attending(graph):
            return super().forward(x, encoder_padding_mask)


class GraphDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, num_edge_types: int, no_encoder_attn: bool = False):
        self._num_edge_types = num_edge_types
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("graph self-attention supports neither bias_kv/zero_attn nor "
                             "cross_self_attention")
        return GraphSelfAttention(embed_dim, cfg.decoder.attention_heads, self._num_edge_types,
                                  dropout=cfg.attention_dropout)

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                graph=None, self_attn_padding_mask=None, need_attn=False, need_head_weights=False):
        """x: [N, B, C] node states (or this step's new nodes); graph: AttentionGraph or
        DecoderStep (with incremental_state)."""
        with self.self_attn.attending(graph):
            return super().forward(
                x, encoder_out, encoder_padding_mask, incremental_state,
                self_attn_padding_mask=self_attn_padding_mask, need_attn=need_attn,
                need_head_weights=need_head_weights,
            )
