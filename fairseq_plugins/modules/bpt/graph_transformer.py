"""The BP-Transformer / SegTree encoder and decoder: fairseq's transformer sides over the nodes
of a tree built on each sentence.

Each side runs over token nodes (word embeddings; fairseq's positions only with
``--graph-token-positions absolute``) then span nodes (zeros), laid out tokens first. The
encoder hands only its token nodes on (fairseq's ``encoder_out``); the decoder's
cross-attention is fairseq's, from its token nodes (``--graph-cross-attention nodes``: every
node) to the source tokens, and its output projection reads target token nodes only. The
decoder graph is causal: a token sees its left context and itself; a span is only ever read
once complete.

A decoder may also run over a graph of its tokens alone (``graph_kind`` "sparse": the Sparse
Transformer's strided pattern, ``graphs/strided.py``); the graph spec says which nodes exist
and what a decoding step attends to.

Incremental decoding keeps, per layer, the keys/values of every node created so far (in
creation order, see ``causal_step_graph``); a step runs the new token and the spans it
completes through all layers, each attending to O(k log t) cached nodes (spans: their tokens).
The sides read their options (``graph_kind``, ``graph_k``, ``graph_rel_clip``,
``graph_token_positions``, ``graph_cross_attention``, ``graph_attention_backend``,
``graph_recompute_norms_ffn``) from the config they are built with
(``models/bpt_transformer.GraphTransformerConfig``).
"""

import copy
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import utils
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase

from fairseq_plugins.graphs.binary_partition import TreeGraphSpec, node_present, root_rows
from fairseq_plugins.graphs.strided import StridedGraphSpec
from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphDecoderLayer, GraphEncoderLayer
from fairseq_plugins.modules.common.layer_wrapping import wrap_layer


def graph_spec(cfg, causal: bool):
    """The graph family of ``cfg.graph_kind``: the trees (bpt, segtree) or the Sparse
    Transformer's strided pattern (sparse, decoders only)."""
    if cfg.graph_kind == "sparse":
        return StridedGraphSpec(cfg.sparse_stride, cfg.sparse_summary, causal)
    return TreeGraphSpec(cfg.graph_kind, cfg.graph_k, cfg.graph_rel_clip, causal)


def graph_side_config(cfg):
    """The config a graph side builds with: without fairseq's positional embeddings unless
    ``--graph-token-positions absolute``."""
    if cfg.graph_token_positions == "absolute":
        return cfg
    cfg = copy.copy(cfg)
    cfg.no_token_positional_embeddings = True
    return cfg


def _nodes(tokens: Tensor, num_nodes: int) -> Tensor:
    """[B, T, C] token states -> contiguous [N, B, C] node states, span nodes starting at zero
    (time-first in memory too: the layers' element-wise ops and layer norms then run on
    contiguous rows)."""
    spans = tokens.new_zeros(num_nodes - tokens.size(1), tokens.size(0), tokens.size(2))
    return torch.cat([tokens.transpose(0, 1), spans])


class GraphTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens):
        self._spec = graph_spec(cfg, causal=False)
        super().__init__(graph_side_config(cfg), dictionary, embed_tokens)

    def build_encoder_layer(self, cfg):
        return wrap_layer(GraphEncoderLayer(cfg, self._spec.num_edge_types, backend=cfg.graph_attention_backend,
                                            recompute_norms_ffn=cfg.graph_recompute_norms_ffn), cfg)

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None,
                return_all_hiddens: bool = False, token_embeddings: Optional[Tensor] = None,
                return_root: bool = False):
        """fairseq's encoder output (token nodes only); ``return_root`` adds ``encoder_root``
        ([B x C], each sentence's root node after the last layer: the classifiers' readout)."""
        if src_tokens.size(1) > self.max_source_positions:
            raise ValueError(f"source length {src_tokens.size(1)} exceeds "
                             f"--max-source-positions {self.max_source_positions}")
        # the tree is anchored at token 0: move left padding to the right
        src_tokens = utils.convert_padding_direction(src_tokens, self.padding_idx,
                                                     left_to_right=True)
        padding = src_tokens.eq(self.padding_idx)
        lengths = (~padding).sum(1)
        if bool((lengths == 0).any()):
            raise ValueError("empty source sentence: the BPT encoder needs at least one token")
        x, embedding = self.forward_embedding(src_tokens, token_embeddings)
        x = x * (1 - padding.unsqueeze(-1).type_as(x))
        length = src_tokens.size(1)
        graph = self._spec.build(length)
        absent = ~node_present(lengths, length).to(x.device)
        x = _nodes(x, graph.num_nodes)
        states = []
        for idx, layer in enumerate(self.layers):
            # the last layer's span nodes are read by nobody, unless the root is asked for
            last = idx == len(self.layers) - 1
            x = layer(x, absent, graph, out_rows=length if last and not return_root else None,
                      equal_rows_from=length if idx == 0 else None)  # the span nodes start equal
            if return_all_hiddens:
                states.append(x[:length])
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        root = []
        if return_root:
            root = [x[root_rows(lengths, length).to(x.device), torch.arange(x.size(1), device=x.device)]]
        return {
            "encoder_out": [x[:length]],  # T x B x C, token nodes only
            "encoder_root": root,
            "encoder_padding_mask": [padding],
            "encoder_embedding": [embedding],
            "encoder_states": states,
            "fc_results": [],
            "src_tokens": [src_tokens],
            "src_lengths": [lengths.unsqueeze(1)],
        }


class GraphTransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False):
        self._spec = graph_spec(cfg, causal=True)
        self.cross_attention_from = cfg.graph_cross_attention
        super().__init__(graph_side_config(cfg), dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = GraphDecoderLayer(cfg, self._spec.num_edge_types, no_encoder_attn=no_encoder_attn,
                                  backend=cfg.graph_attention_backend,
                                  cross_attention_from=self.cross_attention_from,
                                  recompute_norms_ffn=cfg.graph_recompute_norms_ffn)
        return wrap_layer(layer, cfg)

    def _embed(self, prev_output_tokens, incremental_state):
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens.contiguous())
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x = x + positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return self.dropout_module(x)

    def extract_features_scriptable(
        self, prev_output_tokens, encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        if full_context_alignment:
            raise ValueError("the BPT decoder is causal by construction (no full-context alignment)")
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
        enc = padding_mask = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]
        length = prev_output_tokens.size(1)
        tokens = self._embed(prev_output_tokens, incremental_state)
        if incremental_state is None:
            padding = prev_output_tokens.eq(self.padding_idx)
            lengths = (~padding).sum(1)
            positions = torch.arange(length, device=padding.device)
            if not torch.equal(padding, positions >= lengths.unsqueeze(1)) or bool((lengths == 0).any()):
                raise ValueError("the BPT decoder needs non-empty, right-padded targets")
            graph = self._spec.build(length)
            absent = ~self._spec.present(lengths, length).to(tokens.device)
            num_new = length
        else:
            graph = self._spec.step_graph(length - 1)  # the new nodes over the cache
            absent = None
            num_new = 1
        x = _nodes(tokens, graph.num_nodes)
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x[:num_new]]
        for idx, layer in enumerate(self.layers):
            x, layer_attn, _ = layer(
                x, enc, padding_mask, incremental_state, graph=graph,
                self_attn_padding_mask=absent, need_attn=idx == alignment_layer,
                need_head_weights=idx == alignment_layer, num_tokens=num_new,
                out_rows=num_new if idx == self.num_layers - 1 else None,
                equal_rows_from=num_new if idx == 0 and incremental_state is None else None,
            )
            inner_states.append(x[:num_new])
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:alignment_heads]
            attn = attn.mean(dim=0)[:, :num_new]  # heads x B x nodes x S -> B x T x S
        x = x[:num_new]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}
