"""BP-Transformer for translation (Ye et al., 2019): binary-partition graph attention.

Each side (encoder, decoder, or both; ``--graph-sides``) runs over the nodes of a tree built on
its sentence: token nodes (word embeddings; fairseq's positions only with
``--graph-token-positions absolute``) then span nodes (zeros), laid out tokens first. The
encoder hands only its token nodes to the decoder (fairseq's ``encoder_out``); the decoder's
cross-attention is fairseq's, from its token nodes (``--graph-cross-attention nodes``: every
node) to the source tokens, and its output projection reads target token nodes only. The
decoder graph is causal: a token sees its left context and itself; a span is only ever read
once complete.

Incremental decoding keeps, per layer, the keys/values of every node created so far (in
creation order, see ``causal_step_graph``); a step runs the new token and the spans it
completes through all layers, each attending to O(k log t) cached nodes (spans: their tokens).
"""

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase, TransformerEncoderBase, TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture, transformer_iwslt_de_en

from fairseq_plugins.graphs.binary_partition import TreeGraphSpec, causal_step_graph, node_present, root_rows
from fairseq_plugins.models.model_options import (
    PluginTransformerConfig, add_config_args, check_at_least, check_choice, set_default_options,
)
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.bpt.graph_transformer_layers import (
    CROSS_ATTENTION_FROM, GraphDecoderLayer, GraphEncoderLayer,
)
from fairseq_plugins.modules.common.layer_wrapping import wrap_layer

GRAPH_SIDES = ("encoder", "decoder", "both")
TOKEN_POSITIONS = ("none", "absolute")
GRAPH_ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "cuda", "flex")
# what the plugin did before the paper's choices became options; configs built then lack them
PLUGIN_V1 = dict(graph_token_positions="absolute", graph_cross_attention="nodes")


@dataclass
class GraphTransformerConfig(PluginTransformerConfig):
    """fairseq's transformer options plus those of the tree-graph models (BPT, SegTree)."""

    graph_k: int = field(default=4, metadata={"help": "context nodes per level and side (BPT's k; SegTree: 1)"})
    graph_rel_clip: int = field(
        default=2, metadata={"help": "levels >= L share their relative-position embeddings (>= 1)"})
    graph_sides: ChoiceEnum(GRAPH_SIDES) = field(
        default="both", metadata={"help": "which side(s) use graph attention; the other is a stock transformer"})
    graph_token_positions: ChoiceEnum(TOKEN_POSITIONS) = field(
        default="none", metadata={"help": "what token nodes start from on a graph side: none = word embeddings "
                                          "only, order from the tree's relative positions (the papers); "
                                          "absolute = plus fairseq's positional embeddings (plugin v1)"})
    graph_cross_attention: ChoiceEnum(CROSS_ATTENTION_FROM) = field(
        default="tokens", metadata={"help": "which decoder nodes attend to the encoder: tokens (BPT sec. 4.3) "
                                            "or nodes = tokens and spans (plugin v1)"})
    graph_attention_backend: ChoiceEnum(GRAPH_ATTENTION_BACKENDS) = field(
        default="auto", metadata={"help": "graph attention implementation (see docs/cuda_ext.md)"})


def graph_spec(cfg, causal: bool) -> TreeGraphSpec:
    return TreeGraphSpec(cfg.graph_kind, cfg.graph_k, cfg.graph_rel_clip, causal)


def built_by_plugin_v1(args) -> bool:
    """A model config saved before the paper options existed: those builds wrote the graph
    kind into it (``graph_kind``); builds now keep it off the config they are given."""
    return getattr(args, "graph_kind", None) is not None


def graph_side_config(cfg):
    """The config a graph side builds with: without fairseq's positional embeddings unless
    ``--graph-token-positions absolute``."""
    if cfg.graph_token_positions == "absolute":
        return cfg
    cfg = copy.copy(cfg)
    cfg.no_token_positional_embeddings = True
    return cfg


def _nodes(tokens: Tensor, num_nodes: int) -> Tensor:
    """[B, T, C] token states -> [N, B, C] node states, span nodes starting at zero."""
    spans = tokens.new_zeros(tokens.size(0), num_nodes - tokens.size(1), tokens.size(2))
    return torch.cat([tokens, spans], 1).transpose(0, 1)


class GraphTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg: GraphTransformerConfig, dictionary, embed_tokens):
        self._spec = graph_spec(cfg, causal=False)
        super().__init__(graph_side_config(cfg), dictionary, embed_tokens)

    def build_encoder_layer(self, cfg):
        return wrap_layer(GraphEncoderLayer(cfg, self._spec.types.num_types, backend=cfg.graph_attention_backend),
                          cfg)

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
    def __init__(self, cfg: GraphTransformerConfig, dictionary, embed_tokens, no_encoder_attn=False):
        self._spec = graph_spec(cfg, causal=True)
        self.cross_attention_from = cfg.graph_cross_attention
        super().__init__(graph_side_config(cfg), dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = GraphDecoderLayer(cfg, self._spec.types.num_types, no_encoder_attn=no_encoder_attn,
                                  backend=cfg.graph_attention_backend,
                                  cross_attention_from=self.cross_attention_from)
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
            absent = ~node_present(lengths, length).to(tokens.device)
            num_new = length
        else:
            graph = causal_step_graph(self._spec, length - 1)  # the new nodes over the cache
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


@register_model("bpt_transformer")
class BPTTransformerModel(PluginModel, TransformerModel):
    """Transformer whose self-attention runs over a binary-partition graph (BPT)."""

    graph_kind = "bpt"

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, GraphTransformerConfig)

    @classmethod
    def build_model(cls, args, task):
        cfg = GraphTransformerConfig.from_namespace(args)
        if cls.graph_kind == "segtree" and built_by_plugin_v1(args):
            cfg.graph_k = 1  # SegTree's k is 1; those versions ignored --graph-k
        cfg.graph_kind = cls.graph_kind
        validate_graph_options(cfg)
        return super().build_model(cfg, task)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        if cfg.graph_sides in ("encoder", "both"):
            return GraphTransformerEncoder(cfg, src_dict, embed_tokens)
        return super().build_encoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        if cfg.graph_sides in ("decoder", "both"):
            return GraphTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)
        return super().build_decoder(cfg, tgt_dict, embed_tokens)


def validate_graph_options(cfg) -> None:
    """Clear errors for values no graph can have (nothing is replaced by a default here)."""
    check_at_least(cfg, "graph_k", 1)
    check_at_least(cfg, "graph_rel_clip", 1)
    if cfg.graph_kind == "segtree" and cfg.graph_k != 1:
        raise ValueError(f"--graph-k {cfg.graph_k}: SegTree's graph has k = 1 by definition (use bpt_transformer "
                         f"for other k)")
    check_choice(cfg, "graph_sides", GRAPH_SIDES)
    check_choice(cfg, "graph_token_positions", TOKEN_POSITIONS)
    check_choice(cfg, "graph_cross_attention", CROSS_ATTENTION_FROM)
    check_choice(cfg, "graph_attention_backend", GRAPH_ATTENTION_BACKENDS)
    check_graph_k_helps(cfg)  # after the choices: it reads --graph-sides


def check_graph_k_helps(cfg) -> None:
    """k past the longest sequence is dense attention that only grows the relative-position
    table (``k + 1`` slots per side and level: ``head_dim`` parameters per type and graph layer)."""
    sides = {"encoder": (cfg.encoder, cfg.max_source_positions), "decoder": (cfg.decoder, cfg.max_target_positions)}
    graph_sides = [side for side in sides if cfg.graph_sides in (side, "both")]
    bound = max(sides[side][1] for side in graph_sides) - 1
    if cfg.graph_k <= bound:
        return
    per_type = sum(sides[side][0].layers * sides[side][0].embed_dim // sides[side][0].attention_heads
                   for side in graph_sides)

    def table(k):
        return TreeGraphSpec(cfg.graph_kind, k, cfg.graph_rel_clip, False).types.num_types * per_type

    raise ValueError(
        f"--graph-k {cfg.graph_k} is beyond what can help: at k = {bound} (the longest sequence, "
        f"--max-source/target-positions, minus one) every token already sees all the others at level 0, i.e. "
        f"dense attention; a larger k only grows the relative-position embeddings, to {table(cfg.graph_k):,} "
        f"parameters here ({table(bound):,} at k {bound}, {table(4):,} at the paper's k 4). Use --graph-k <= {bound}"
    )


def graph_defaults(args, k: int, clip: int):
    """Unset graph options: this architecture's k and clip, the papers' choices for the rest
    (plugin v1's for a config saved by it, so that its checkpoints keep their behaviour)."""
    set_default_options(args, GraphTransformerConfig, graph_k=k, graph_rel_clip=clip,
                        **(PLUGIN_V1 if built_by_plugin_v1(args) else {}))


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
