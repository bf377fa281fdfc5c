"""Cross-attention restricted to the aligned sentence, for document-level translation.

BPT's document-level setting (paper section 4.3.1) lets self-attention span the whole sample
(context sentences + current sentence) but keeps encoder-decoder attention "between aligned
sentences": decoder sentence k attends only to source sentence k. Sentence boundaries are read
from the tokens (``fairseq_plugins.data.document_layout``), so nothing beyond fairseq's usual
inputs is needed, in training, in incremental decoding and in ``fairseq-interactive``.

Pieces, combinable with any fairseq transformer-style encoder/decoder by subclassing:
* ``SourceTokensEncoderMixin``: the encoder keeps ``src_tokens`` in its output (fairseq's
  ``reorder_encoder_out`` already reorders that entry for beam search);
* ``SentenceAlignedDecoderMixin``: builds the B x T x S mask and hands it to every layer's
  encoder attention in place of the B x S padding mask;
* ``SentenceAlignedCrossAttention``: fairseq's ``MultiheadAttention`` that accepts that mask.
"""

from typing import Dict, List, Optional

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from fairseq_plugins.data.document_layout import aligned_sentence_mask
from fairseq_plugins.modules.common.heads import merge_heads, split_heads


class SentenceAlignedCrossAttention(MultiheadAttention):
    """Encoder-decoder attention taking a per-query mask: ``key_padding_mask`` may be
    B x T x S (True = hidden), or B x 1 x S shared by all T queries (the nodes one decoding step
    creates). A B x S mask falls back to fairseq's implementation."""

    def set_beam_size(self, beam_size):
        """Keep one key/value copy per hypothesis: the masks of a beam's hypotheses differ."""
        self.beam_size = 1

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None,
                need_weights=True, static_kv=False, attn_mask=None, before_softmax=False,
                need_head_weights=False):
        if key_padding_mask is None or key_padding_mask.dim() != 3:
            return super().forward(query, key, value, key_padding_mask, incremental_state,
                                   need_weights, static_kv, attn_mask, before_softmax,
                                   need_head_weights)
        if not static_kv or attn_mask is not None or before_softmax or self.bias_k is not None \
                or self.add_zero_attn:
            raise ValueError("sentence-aligned attention is encoder-decoder attention only")
        tgt_len, bsz, _ = query.shape
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else {}
        if "prev_key" in saved:  # encoder keys/values of earlier decoding steps
            k, v = saved["prev_key"], saved["prev_value"]
        else:
            k = split_heads(self.k_proj(key), self.num_heads)
            v = split_heads(self.v_proj(key), self.num_heads)
            if incremental_state is not None:
                saved["prev_key"], saved["prev_value"] = k, v
                self._set_input_buffer(incremental_state, saved)
        if key_padding_mask.size(1) == 1:
            key_padding_mask = key_padding_mask.expand(-1, tgt_len, -1)
        if key_padding_mask.shape != (bsz, tgt_len, k.size(2)):
            raise ValueError(f"mask {tuple(key_padding_mask.shape)} does not match "
                             f"{bsz} x {tgt_len} queries x {k.size(2)} keys")
        q = split_heads(self.q_proj(query) * self.scaling, self.num_heads)  # B x H x T x D
        scores = (q @ k.transpose(-1, -2)).masked_fill(key_padding_mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).type_as(scores)
        out = self.dropout_module(probs) @ v
        out = self.out_proj(merge_heads(out))
        if not need_weights:
            return out, None
        weights = probs.transpose(0, 1)  # H x B x T x S, fairseq's layout
        return out, (weights if need_head_weights else weights.mean(dim=0))


class SourceTokensEncoderMixin:
    """Keep ``src_tokens`` in the encoder output so the decoder can find source sentences."""

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None,
                return_all_hiddens: bool = False, token_embeddings: Optional[Tensor] = None):
        out = super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
        out["src_tokens"] = [src_tokens]
        return out


class SentenceAlignedDecoderMixin:
    """Decoder whose encoder attention sees only the source sentence aligned with each
    target position (needs an encoder with ``SourceTokensEncoderMixin``)."""

    def cross_attention_rows(self, mask: Tensor) -> Tensor:
        """B x T x S mask of the T target tokens -> one row per cross-attention query.
        Decoders whose layers carry more than the tokens (graph nodes) map them here."""
        return mask

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = super().build_decoder_layer(cfg, no_encoder_attn)
        if layer.encoder_attn is not None:
            old = layer.encoder_attn
            layer.encoder_attn = SentenceAlignedCrossAttention(
                old.embed_dim, old.num_heads, kdim=old.kdim, vdim=old.vdim,
                dropout=old.dropout_module.p, encoder_decoder_attention=True,
            )
        return layer

    def extract_features(self, prev_output_tokens, encoder_out: Optional[Dict[str, List[Tensor]]],
                         incremental_state=None, full_context_alignment: bool = False,
                         alignment_layer: Optional[int] = None, alignment_heads: Optional[int] = None):
        if encoder_out is None or len(encoder_out.get("src_tokens", [])) == 0:
            raise ValueError("sentence-aligned decoding needs the encoder output's src_tokens "
                             "(use an encoder with SourceTokensEncoderMixin)")
        mask = aligned_sentence_mask(encoder_out["src_tokens"][0], prev_output_tokens,
                                     separator=self.dictionary.bos(), pad=self.dictionary.pad())
        if incremental_state is not None:  # fairseq feeds only the newest position then
            mask = mask[:, -1:]
        else:
            mask = self.cross_attention_rows(mask)
        encoder_out = dict(encoder_out, encoder_padding_mask=[mask])
        return super().extract_features(prev_output_tokens, encoder_out, incremental_state,
                                        full_context_alignment, alignment_layer, alignment_heads)
