"""TranSFormer's encoder (Li et al., 2023): the slow and fast branches, interleaved block by block.

The slow branch is fairseq's transformer encoder over subwords with a GCN over the
subwords of each word; the fast branch is a thin encoder (width 32) over the characters of
the same sentence, derived inside the model from ``src_tokens`` (``SubwordCharacterTable``),
with a GCN over the characters of each word and boundary-wise relative positions.
Cross-granularity attention exchanges information between the branches in every
interacting block. The option names and their choices are the model's command-line options
(docs/slowfast.md).
"""

import copy
import math
import os
import re
from typing import NamedTuple, Optional, Set

import torch
from torch import nn

from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules import FairseqDropout, LayerNorm, PositionalEmbedding

from fairseq_plugins.modules.common.length_groups import length_groups, merge, take

from .boundary_relative_attention import boundary_band
from .cross_granularity_fusion import FUSION_METHODS, build_fusion
from .ode_block import ODE_SOLVERS, RK2Gate, rk2_step
from .sentencepiece_fast_input import PAD_UNIT, SentencePieceFastInput
from .slowfast_encoder_layer import FastBranchEncoderLayer, SlowFastEncoderLayer
from .subword_characters import PAD_CHAR, FastBranchInput, SubwordCharacterTable
from .word_graph_convolution import WordGraph

ENCODER_OUTPUTS = ("slow", "fast", "both")
FAST_INPUTS = ("char", "subword", "sentencepiece")
FAST_BOUNDARIES = ("word", "random", "none")
FAST_SELF_ATTENTIONS = ("full", "linear")
BOUNDARY_PE_SCOPES = ("word", "window")


def parse_interaction_layers(spec: str, num_layers: int) -> Set[int]:
    """0-based indices of the blocks whose branches interact (paper Table 6).

    ``all``, ``last``, ``bottomN`` / ``topN`` (the first / last N blocks), ``everyN``
    (blocks 1, 1+N, ...), or a comma list of 1-based block numbers such as ``1,3,5``.
    """
    spec = spec.strip().lower()
    if spec == "all":
        return set(range(num_layers))
    if spec == "last":
        return {num_layers - 1}
    m = re.fullmatch(r"(bottom|top|every)(\d+)", spec)
    if m:
        n = int(m.group(2))
        if n < 1 or (m.group(1) != "every" and n > num_layers):
            raise ValueError(f"interaction layers {spec!r}: N must be in 1..{num_layers}")
        if m.group(1) == "bottom":
            return set(range(n))
        if m.group(1) == "top":
            return set(range(num_layers - n, num_layers))
        return set(range(0, num_layers, n))
    if re.fullmatch(r"\d+(,\d+)*", spec):
        layers = {int(i) - 1 for i in spec.split(",")}
        if min(layers) < 0 or max(layers) >= num_layers:
            raise ValueError(f"interaction layers {spec!r}: block numbers must be in 1..{num_layers}")
        return layers
    raise ValueError(
        f"interaction layers {spec!r}: use all, last, bottomN, topN, everyN or a comma list like 1,3,5"
    )


def random_word_ids(word_ids: torch.Tensor) -> torch.Tensor:
    """Random word segmentation of the same units with the batch's word/unit ratio
    (the "random boundaries" ablation of Table 5); -1 at padding is kept."""
    valid = word_ids.ge(0)
    num_words = (word_ids.max(1).values + 1).clamp(min=0).sum()
    rate = num_words.float() / valid.sum().clamp(min=1)
    ends = (torch.rand(word_ids.shape, device=word_ids.device) < rate) & valid
    ids = torch.cumsum(ends.long(), 1) - ends.long()
    return ids.masked_fill(~valid, -1)


class FastGroup(NamedTuple):
    """The fast branch's input for the sentences ``index`` of the batch (None: all of
    them), trimmed to the longest of them (``length_groups``)."""

    index: Optional[torch.Tensor]
    tokens: torch.Tensor  # Bg x Lg
    padding_mask: Optional[torch.Tensor]  # Bg x Lg, None without padding
    graph: Optional[WordGraph]  # the F-GCN's word graph (None: no boundaries)
    band: Optional[torch.Tensor]  # boundary PE relations (None: no boundary PE)
    subword_ids: torch.Tensor  # Bg x Lg


def boundary_pe_window(cfg) -> Optional[int]:
    """The relative window of the fast branch's boundary PE; None without one (turned
    off, or Linformer attention, whose compressed keys have no pairwise positions)."""
    return None if cfg.no_boundary_pe or cfg.fast_self_attention == "linear" else cfg.boundary_pe_window


def fast_branch_config(cfg):
    """The slow branch's config with the fast branch's width, FFN size, heads and
    relative window (None: no boundary PE)."""
    fast = copy.deepcopy(cfg)
    fast.encoder.embed_dim = cfg.fast_embed_dim
    fast.encoder.ffn_embed_dim = cfg.fast_ffn_embed_dim
    fast.encoder.attention_heads = cfg.fast_attention_heads
    fast.boundary_pe_window = boundary_pe_window(cfg)
    return fast


def no_slow_layers(cfg):
    """The config without subword blocks, for the fast-branch-only encoder."""
    fast_only = copy.deepcopy(cfg)
    fast_only.encoder.layers = 0
    return fast_only


def read_sentencepiece_model(cfg) -> Optional[bytes]:
    """The bytes of ``--fast-sentencepiece-model``; None when the file is gone but the
    model records its size (a checkpoint: its state dict carries the model)."""
    path = cfg.fast_sentencepiece_model
    if not path:
        raise ValueError("--fast-input sentencepiece needs --fast-sentencepiece-model")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    if getattr(cfg, "fast_sentencepiece_pieces", None):
        return None
    raise FileNotFoundError(f"--fast-sentencepiece-model {path}: no such file")


class SlowFastEncoder(TransformerEncoderBase):
    """Slow (subword) and fast (character) branches; outputs the fairseq encoder dict.

    Extra attributes read from ``cfg`` (the model's flat argparse options):
    ``no_fast_branch``, ``no_slow_word_graph``, ``fast_embed_dim``, ``fast_ffn_embed_dim``,
    ``fast_attention_heads``, ``fast_input``, ``fast_sentencepiece_model``,
    ``subword_style``, ``fast_max_characters``, ``slowfast_fusion``,
    ``slowfast_encoder_output``, ``unidirectional_fusion``, ``fast_boundaries``,
    ``no_boundary_pe``, ``boundary_pe_window``, ``boundary_pe_scope``, ``fast_self_attention``,
    ``fast_linear_attention_length``, ``fast_linear_attention_max_length``,
    ``slowfast_interaction_layers``, ``slowfast_ode_block``.
    With ``no_slow_branch`` the encoder is the fast branch alone: no subword layers, its
    output projected to the decoder's width.
    """

    def __init__(self, cfg, dictionary, embed_tokens):
        self._validate(cfg)
        self.has_slow_branch = not cfg.no_slow_branch
        super().__init__(cfg if self.has_slow_branch else no_slow_layers(cfg), dictionary, embed_tokens)
        self.characters = SubwordCharacterTable(
            dictionary, style=cfg.subword_style, max_characters=cfg.fast_max_characters or None
        )
        self.has_fast_branch = not cfg.no_fast_branch
        self.ode_solver = cfg.slowfast_ode_block
        gated = self.ode_solver == "rk2-gated"  # one gate per branch, shared by the blocks
        self.slow_ode_gate = RK2Gate(cfg.encoder.embed_dim) if gated else None
        self.fast_ode_gate = RK2Gate(cfg.fast_embed_dim) if gated and self.has_fast_branch else None
        if not self.has_slow_branch:
            # nothing reads the subwords' embeddings or the slow output norm: no unused parameters
            self.embed_tokens = self.layer_norm = self.layernorm_embedding = None
        if not self.has_fast_branch:
            return
        fast_cfg = fast_branch_config(cfg)
        slow_dim, fast_dim = cfg.encoder.embed_dim, cfg.fast_embed_dim
        self.fast_input = cfg.fast_input
        self.fast_boundaries = cfg.fast_boundaries
        self.max_fast_groups = 4  # sub-batches of similar length the fast branch runs in (length_groups)
        self.boundary_pe_window = boundary_pe_window(cfg)
        self.boundary_pe_within_words = cfg.boundary_pe_scope == "word" and cfg.fast_boundaries != "none"
        self.output = cfg.slowfast_encoder_output

        if self.fast_input == "char":
            self.fast_padding_idx, fast_vocabulary = PAD_CHAR, self.characters.num_characters
        elif self.fast_input == "subword":
            self.fast_padding_idx, fast_vocabulary = dictionary.pad(), len(dictionary)
        else:
            self.sentencepiece = SentencePieceFastInput(
                self.characters,
                dictionary,
                read_sentencepiece_model(cfg),
                getattr(cfg, "fast_sentencepiece_pieces", None),
            )
            self.fast_padding_idx, fast_vocabulary = PAD_UNIT, self.sentencepiece.num_units
        self.fast_embed_tokens = nn.Embedding(fast_vocabulary, fast_dim, padding_idx=self.fast_padding_idx)
        nn.init.normal_(self.fast_embed_tokens.weight, mean=0, std=fast_dim ** -0.5)
        nn.init.constant_(self.fast_embed_tokens.weight[self.fast_padding_idx], 0)
        self.fast_embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(fast_dim)
        self.fast_embed_positions = (
            PositionalEmbedding(cfg.max_source_positions, fast_dim, self.fast_padding_idx, learned=False)
            if not cfg.no_token_positional_embeddings
            else None
        )
        self.fast_dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)

        interacting = (
            parse_interaction_layers(cfg.slowfast_interaction_layers, cfg.encoder.layers)
            if self.has_slow_branch else set()
        )
        # When only the slow branch is read, the fast branch stops after the attention
        # half of the last interacting block: nothing reads what it would compute later.
        last_fast = max(interacting) if self.output == "slow" else cfg.encoder.layers - 1
        self.fast_layers = nn.ModuleList()
        for i in range(cfg.encoder.layers):
            if i in interacting:
                slow_layer = self.layers[i]
                slow_layer.fusion = build_fusion(
                    cfg.slowfast_fusion,
                    slow_dim,
                    fast_dim,
                    cfg.encoder.attention_heads,
                    cfg.attention_dropout,
                    to_slow=True,
                )
                slow_layer.fusion_layer_norm = LayerNorm(slow_dim)
            if i > last_fast:
                continue
            truncated = i == last_fast and self.output == "slow"
            fast_fusion = None
            if i in interacting and not cfg.unidirectional_fusion and not truncated:
                fast_fusion = build_fusion(
                    cfg.slowfast_fusion,
                    fast_dim,
                    slow_dim,
                    cfg.fast_attention_heads,
                    cfg.attention_dropout,
                    to_slow=False,
                )
            self.fast_layers.append(
                FastBranchEncoderLayer(
                    fast_cfg,
                    use_word_graph=self.fast_boundaries != "none",
                    fusion=fast_fusion,
                    feed_forward=not truncated,
                )
            )
        self.fast_layer_norm = None
        self.fast_output_proj = None
        if self.output != "slow":
            self.fast_layer_norm = LayerNorm(fast_dim) if cfg.encoder.normalize_before else None
            self.fast_output_proj = nn.Linear(fast_dim, slow_dim)

    @staticmethod
    def _validate(cfg):
        choices = dict(
            fast_input=FAST_INPUTS,
            fast_self_attention=FAST_SELF_ATTENTIONS,
            fast_boundaries=FAST_BOUNDARIES,
            boundary_pe_scope=BOUNDARY_PE_SCOPES,
            slowfast_fusion=FUSION_METHODS,
            slowfast_encoder_output=ENCODER_OUTPUTS,
            slowfast_ode_block=ODE_SOLVERS,
        )
        for name, allowed in choices.items():
            if getattr(cfg, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: choose from {', '.join(allowed)}")
        if cfg.fast_embed_dim % cfg.fast_attention_heads:
            raise ValueError(
                f"--fast-embed-dim {cfg.fast_embed_dim} is not divisible by "
                f"--fast-attention-heads {cfg.fast_attention_heads}"
            )
        if cfg.no_fast_branch and cfg.slowfast_encoder_output != "slow":
            raise ValueError("--no-fast-branch leaves only the slow branch: --slowfast-encoder-output must be slow")
        if cfg.no_slow_branch and (cfg.no_fast_branch or cfg.slowfast_encoder_output != "fast"):
            raise ValueError("--no-slow-branch leaves only the fast branch: it needs the fast branch (no "
                             "--no-fast-branch) and --slowfast-encoder-output fast (its architectures' default)")
        if cfg.no_slow_branch and cfg.slowfast_ode_block != "euler":
            raise ValueError("--slowfast-ode-block applies to the two-branch encoder; --no-slow-branch has no "
                             "slow-fast blocks to solve")
        if cfg.checkpoint_activations or cfg.offload_activations:
            # fairseq's checkpointing wraps a layer's forward; these layers run in parts between
            # the branches' fusions, so a wrapper would be silently skipped
            raise ValueError("--checkpoint-activations/--offload-activations are not supported by the Slow-Fast "
                             "encoder (its layers run in parts between the two branches' fusions)")

    def build_encoder_layer(self, cfg):
        return SlowFastEncoderLayer(cfg, use_word_graph=not cfg.no_slow_word_graph)

    def fast_branch_input(self, src_tokens) -> FastBranchInput:
        if self.fast_input == "char":
            return self.characters(src_tokens)
        if self.fast_input == "subword":
            return self.characters.subword_input(src_tokens)
        return self.sentencepiece(src_tokens, *self.characters.subword_word_boundaries(src_tokens))

    def fast_group(self, fast: FastBranchInput, word_ids, index: Optional[torch.Tensor], size: int) -> FastGroup:
        tokens, mask, word_ids, subword_ids = (
            take(t, index, size) for t in (fast.tokens, fast.padding_mask, word_ids, fast.subword_ids)
        )
        graph = WordGraph(word_ids) if self.fast_boundaries != "none" else None
        band = None
        if self.boundary_pe_window is not None:
            band = boundary_band(word_ids, self.boundary_pe_window, restrict_to_word=self.boundary_pe_within_words)
        return FastGroup(index, tokens, mask if mask.any() else None, graph, band, subword_ids)

    def forward_fast_embedding(self, tokens, padding_mask: Optional[torch.Tensor]):
        """Time-first embedded fast units, zero at padding."""
        x = self.fast_embed_scale * self.fast_embed_tokens(tokens)
        if self.fast_embed_positions is not None:
            x = x + self.fast_embed_positions(tokens)
        x = self.fast_dropout_module(x)
        if padding_mask is not None:
            x = x * ~padding_mask.unsqueeze(-1)
        return x.transpose(0, 1)

    def fast_branch_groups(self, src_tokens):
        """The fast branch's input, its length groups, and each group's embedded units."""
        fast = self.fast_branch_input(src_tokens)
        word_ids = random_word_ids(fast.word_ids) if self.fast_boundaries == "random" else fast.word_ids
        groups = [
            self.fast_group(fast, word_ids, index, size)
            for index, size in length_groups(fast.padding_mask, self.max_fast_groups)
        ]
        return fast, groups, [self.forward_fast_embedding(group.tokens, group.padding_mask) for group in groups]

    def fast_branch_output(self, xf, groups, fast: FastBranchInput):
        """The groups' final states as one Lf x B x C batch at the slow (decoder's) width."""
        xf = merge(xf, [group.index for group in groups], fast.tokens.size(1))
        if self.fast_layer_norm is not None:
            xf = self.fast_layer_norm(xf)
        return self.fast_output_proj(xf)

    def forward(
        self,
        src_tokens,
        src_lengths: Optional[torch.Tensor] = None,
        return_all_hiddens: bool = False,
        token_embeddings=None,
    ):
        if not self.has_slow_branch:
            return self.forward_fast_only(src_tokens)
        padding_mask = src_tokens.eq(self.padding_idx)
        xs, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        xs = (xs * ~padding_mask.unsqueeze(-1)).transpose(0, 1)
        slow_mask = padding_mask if padding_mask.any() else None

        if self.has_fast_branch:
            fast, groups, xf = self.fast_branch_groups(src_tokens)
            subword_word_ids = fast.subword_word_ids
        else:
            fast, groups, xf = None, [], []
            _, subword_word_ids = self.characters.subword_word_boundaries(src_tokens)

        slow_graph = WordGraph(subword_word_ids)
        encoder_states = [xs] if return_all_hiddens else []
        for i in range(len(self.layers)):
            def block(state, i=i):
                xs, xf = self.forward_block(i, state[0], state[1:], slow_mask, slow_graph, fast, groups)
                return [xs, *xf]

            if self.ode_solver == "euler":
                state = block([xs, *xf])
            else:
                state = rk2_step(block, [xs, *xf], [self.slow_ode_gate, *[self.fast_ode_gate] * len(xf)])
            xs, xf = state[0], state[1:]
            if return_all_hiddens:
                encoder_states.append(xs)

        if self.layer_norm is not None:
            xs = self.layer_norm(xs)
        out, out_mask = xs, padding_mask
        if self.has_fast_branch and self.output != "slow":
            xf = self.fast_branch_output(xf, groups, fast)
            if self.output == "fast":
                out, out_mask = xf, fast.padding_mask
            else:
                out, out_mask = torch.cat([xs, xf], 0), torch.cat([padding_mask, fast.padding_mask], 1)
        return encoder_out_dict(out, out_mask, [encoder_embedding], encoder_states, src_tokens, self.padding_idx)

    def forward_block(self, i, xs, xf, slow_mask, slow_graph, fast: Optional[FastBranchInput], groups):
        """Block i of both branches: the slow states (Ls x B x C) and the fast ones (one
        tensor per length group) after it, each with every sublayer's residual."""
        slow_layer = self.layers[i]
        xs = slow_layer.forward_graph_and_attention(xs, slow_mask, slow_graph)
        if self.has_fast_branch and i < len(self.fast_layers):
            fast_layer = self.fast_layers[i]
            xf = [
                fast_layer.forward_graph_and_attention(x, group.padding_mask, group.graph, group.band)
                for x, group in zip(xf, groups)
            ]
            fused_xs = xs
            if slow_layer.fusion is not None:
                context = merge(xf, [group.index for group in groups], fast.tokens.size(1))
                fast_mask = fast.padding_mask if fast.padding_mask.any() else None
                fused_xs = slow_layer.forward_fusion(xs, context, fast_mask, fast.subword_ids)
            if fast_layer.fusion is not None:
                xf = [
                    fast_layer.forward_fusion(
                        x, take(xs, group.index, time_first=True), take(slow_mask, group.index), group.subword_ids
                    )
                    for x, group in zip(xf, groups)
                ]
            xs = fused_xs
            if fast_layer.has_feed_forward:
                xf = [fast_layer.forward_feed_forward(x) for x in xf]
        return slow_layer.forward_feed_forward(xs), xf

    def forward_fast_only(self, src_tokens):
        """The fast branch alone (no fusion sublayers); no subword embeddings or states to return."""
        fast, groups, xf = self.fast_branch_groups(src_tokens)
        for layer in self.fast_layers:
            xf = [layer.forward_graph_and_attention(x, group.padding_mask, group.graph, group.band)
                  for x, group in zip(xf, groups)]
            xf = [layer.forward_feed_forward(x) for x in xf]
        out = self.fast_branch_output(xf, groups, fast)
        return encoder_out_dict(out, fast.padding_mask, [], [], src_tokens, self.padding_idx)


def encoder_out_dict(out, out_mask, encoder_embedding, encoder_states, src_tokens, padding_idx):
    """fairseq's encoder output dictionary (``TransformerEncoderBase.forward``'s keys)."""
    return {
        "encoder_out": [out],  # T x B x C
        "encoder_padding_mask": [out_mask],  # B x T
        "encoder_embedding": encoder_embedding,  # [B x Ls x C], or [] without a slow branch
        "encoder_states": encoder_states,  # List[Ls x B x C]
        "fc_results": [],
        "src_tokens": [],
        "src_lengths": [src_tokens.ne(padding_idx).sum(1, dtype=torch.int32).reshape(-1, 1)],
    }
