"""Token layout of a document-level sample, and how to read sentence boundaries back from it.

A sample holds the context sentences and then the current sentence, joined by the dictionary's
begin-of-sentence symbol ``<s>`` (unused by fairseq translation, present in every fairseq
dictionary, so stock ``fairseq-preprocess`` output works unchanged):

    source          s1 <s> s2 <s> s_cur </s>
    target          t1 <s> t2 <s> t_cur </s>
    decoder input   </s> t1 <s> t2 <s> t_cur

With no context this is exactly fairseq's sentence-level layout. Boundaries are recomputed from
the tokens themselves, so models need nothing beyond ``src_tokens``/``prev_output_tokens`` (which
is all ``fairseq-interactive`` and incremental decoding hand them).
"""

import torch


def source_sentence_index(src_tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """Sentence number of every source position (a separator belongs to the sentence it ends)."""
    is_sep = src_tokens.eq(separator).long()
    return is_sep.cumsum(dim=-1) - is_sep


def target_sentence_index(prev_output_tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """Sentence number of every decoder position: the position fed ``<s>`` predicts the next
    sentence's first token, so it already belongs to the next sentence."""
    return prev_output_tokens.eq(separator).long().cumsum(dim=-1)


def aligned_sentence_mask(
    src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor, separator: int, pad: int
) -> torch.Tensor:
    """Boolean B x T x S mask, True where decoder position t must NOT see source position s.

    Decoder sentence k sees only source sentence k (the aligned one). A decoder that emits more
    separators than the source has sentences stays aligned with the source's last sentence,
    so no row is ever fully masked.
    """
    src_sent = source_sentence_index(src_tokens, separator)
    n_src_sentences = src_sent.max(dim=-1, keepdim=True).values + 1
    tgt_sent = torch.minimum(
        target_sentence_index(prev_output_tokens, separator), n_src_sentences - 1
    )
    blocked = tgt_sent.unsqueeze(-1).ne(src_sent.unsqueeze(1))
    return blocked | src_tokens.eq(pad).unsqueeze(1)
