"""BP-Transformer for translation (Ye et al., 2019): binary-partition graph attention.

Each side (encoder, decoder, or both; ``--graph-sides``) runs over the nodes of a tree built on
its sentence: token nodes (embeddings) then span nodes (zeros), laid out tokens first. The
encoder hands only its token nodes to the decoder (fairseq's ``encoder_out``); the decoder's
cross-attention is fairseq's, from every target node to the source tokens, and its output
projection reads target token nodes only. The decoder graph is causal: a token sees its left
context and itself; a span is only ever read once complete.

Incremental decoding keeps, per layer, the keys/values of every node created so far (in
creation order, see ``causal_step_rows``); a step runs the new token and the spans it
completes through all layers, each attending to O(k log t) cached nodes (spans: their tokens).
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import utils
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig, TransformerDecoderBase, TransformerEncoderBase, TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture, transformer_iwslt_de_en

from fairseq_plugins.graphs.binary_partition import TreeGraphSpec, causal_step_rows, node_present
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.bpt.graph_self_attention import DecoderStep
from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphDecoderLayer, GraphEncoderLayer

GRAPH_SIDES = ("encoder", "decoder", "both")


def graph_spec(args, causal: bool) -> TreeGraphSpec:
    return TreeGraphSpec(args.graph_kind, args.graph_k, args.graph_rel_clip, causal)


def _nodes(tokens: Tensor, num_nodes: int) -> Tensor:
    """[B, T, C] token states -> [N, B, C] node states, span nodes starting at zero."""
    spans = tokens.new_zeros(tokens.size(0), num_nodes - tokens.size(1), tokens.size(2))
    return torch.cat([tokens, spans], 1).transpose(0, 1)


class GraphTransformerEncoder(TransformerEncoderBase):
    def __init__(self, args, dictionary, embed_tokens):
        self._spec = graph_spec(args, causal=False)
        super().__init__(TransformerConfig.from_namespace(args), dictionary, embed_tokens)

    def build_encoder_layer(self, cfg):
        return GraphEncoderLayer(cfg, self._spec.types.num_types)

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None,
                return_all_hiddens: bool = False, token_embeddings: Optional[Tensor] = None):
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
        for layer in self.layers:
            x = layer(x, absent, graph)
            if return_all_hiddens:
                states.append(x[:length])
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return {
            "encoder_out": [x[:length]],  # T x B x C, token nodes only
            "encoder_padding_mask": [padding],
            "encoder_embedding": [embedding],
            "encoder_states": states,
            "fc_results": [],
            "src_tokens": [src_tokens],
            "src_lengths": [lengths.unsqueeze(1)],
        }


class GraphTransformerDecoder(TransformerDecoderBase):
    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False):
        self._spec = graph_spec(args, causal=True)
        super().__init__(TransformerConfig.from_namespace(args), dictionary, embed_tokens,
                         no_encoder_attn=no_encoder_attn)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return GraphDecoderLayer(cfg, self._spec.types.num_types, no_encoder_attn=no_encoder_attn)

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

    def _step(self, t: int, device) -> DecoderStep:
        indptr, indices, types = causal_step_rows(self._spec, t)
        return DecoderStep(indptr.to(device), indices.to(device), types.to(device))

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
            absent = ~node_present(lengths, length).to(tokens.device)
            num_new = length
        else:
            graph = self._step(length - 1, tokens.device)
            absent = None
            num_new = 1
        x = _nodes(tokens, graph.num_nodes if incremental_state is None else graph.indptr.numel() - 1)
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x[:num_new]]
        for idx, layer in enumerate(self.layers):
            x, layer_attn, _ = layer(
                x, enc, padding_mask, incremental_state, graph=graph,
                self_attn_padding_mask=absent, need_attn=idx == alignment_layer,
                need_head_weights=idx == alignment_layer,
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


def add_graph_args(parser):
    parser.add_argument("--graph-k", type=int, metavar="K",
                        help="context nodes per level and side (BPT's k)")
    parser.add_argument("--graph-rel-clip", type=int, metavar="L",
                        help="levels >= L share their relative-position embeddings")
    parser.add_argument("--graph-sides", choices=GRAPH_SIDES,
                        help="which side(s) use graph attention; the other is a stock transformer")


@register_model("bpt_transformer")
class BPTTransformerModel(PluginModel, TransformerModel):
    """Transformer whose self-attention runs over a binary-partition graph (BPT)."""

    graph_kind = "bpt"

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_graph_args(parser)

    @classmethod
    def build_model(cls, args, task):
        args.graph_kind = cls.graph_kind
        if args.graph_sides not in GRAPH_SIDES:
            raise ValueError(f"--graph-sides must be one of {GRAPH_SIDES}")
        graph_spec(args, causal=False)  # validates k and the clip early
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        if args.graph_sides in ("encoder", "both"):
            return GraphTransformerEncoder(args, src_dict, embed_tokens)
        return super().build_encoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        if args.graph_sides in ("decoder", "both"):
            return GraphTransformerDecoder(args, tgt_dict, embed_tokens,
                                           no_encoder_attn=getattr(args, "no_cross_attention", False))
        return super().build_decoder(args, tgt_dict, embed_tokens)


def graph_defaults(args, k: int, clip: int):
    args.graph_k = getattr(args, "graph_k", None) or k
    args.graph_rel_clip = getattr(args, "graph_rel_clip", None) or clip
    args.graph_sides = getattr(args, "graph_sides", None) or "both"


@register_model_architecture("bpt_transformer", "bpt_transformer")
def bpt_transformer(args):
    """The paper's WMT base setting: 6+6 layers, d 512, FFN 2048, 8 heads, k 4."""
    graph_defaults(args, k=4, clip=2)
    base_architecture(args)


# the original configurations pair each k with a level clip
_WMT_CLIP = {1: 4, 2: 3, 4: 2, 8: 1}


def _register_variants():
    for k, clip in _WMT_CLIP.items():
        def wmt(args, k=k, clip=clip):
            graph_defaults(args, k, clip)
            base_architecture(args)

        def iwslt(args, k=k):
            graph_defaults(args, k, 3)
            transformer_iwslt_de_en(args)

        register_model_architecture("bpt_transformer", f"bpt_transformer_wmt_en_de_k{k}")(wmt)
        register_model_architecture("bpt_transformer", f"bpt_transformer_iwslt_de_en_k{k}")(iwslt)


_register_variants()


@register_model_architecture("bpt_transformer", "bpt_transformer_wmt_en_de")
def bpt_transformer_wmt_en_de(args):
    graph_defaults(args, k=4, clip=2)
    base_architecture(args)


@register_model_architecture("bpt_transformer", "bpt_transformer_iwslt_de_en")
def bpt_transformer_iwslt_de_en(args):
    """IWSLT size (FFN 1024, 4 heads), k 4, clip 3 as in the original IWSLT config."""
    graph_defaults(args, k=4, clip=3)
    transformer_iwslt_de_en(args)
