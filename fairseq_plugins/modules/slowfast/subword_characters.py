"""Characters and word boundaries of a subword sentence, computed inside the model.

The Slow-Fast TranSFormer feeds its fast branch the characters of the source sentence
with "_" after every word ("A swi@@ ss bicy@@ cle" -> "A _ s w i s s _ b i c y c l e _").
``fairseq-generate`` and ``fairseq-interactive`` only hand the model ``src_tokens``, so
the characters are looked up from a table built once from the source dictionary and kept
in the model's state dict (the checkpoint then carries the character vocabulary and a
checkpoint paired with a different dictionary fails to load instead of silently reading
wrong characters).

Subword styles:

* ``bpe`` (subword-nmt): a token ending in ``@@`` continues into the next token.
  A vocabulary without any marker (word level) is the same style: every token is a word.
* ``sentencepiece``: a token starting with ``▁`` starts a new word.

Dictionary special symbols (``<s>``, ``</s>``, ``<unk>``, extra specials) are one-symbol
words of their own, without "_"; padding yields nothing.
"""

from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import nn

SUBWORD_STYLES = ("auto", "bpe", "sentencepiece")  # auto: detected from the dictionary
BPE_CONTINUATION = "@@"
SENTENCEPIECE_WORD_START = "\u2581"

PAD_CHAR = 0
UNK_CHAR = 1
WORD_END_CHAR = 2
NUM_RESERVED_CHARS = 3
"""Character ids 0..2 are padding, unknown character and the "_" word-end marker; the
dictionary's special symbols come next, then the ordinary characters."""


class FastBranchInput(NamedTuple):
    """The fast branch's input sequence and how it lines up with the subwords.

    All tensors are batch-first and right-padded (whatever the padding side of
    ``src_tokens``); index tensors hold -1 at padding.
    """

    tokens: torch.Tensor  # B x Lf, ids in the fast branch's vocabulary
    padding_mask: torch.Tensor  # B x Lf, True at padding
    word_ids: torch.Tensor  # B x Lf, index of the word each unit belongs to
    subword_ids: torch.Tensor  # B x Lf, position in src_tokens each unit comes from
    subword_word_ids: torch.Tensor  # B x Ls, index of the word of each subword


def detect_subword_style(symbols: Sequence[str]) -> str:
    """``sentencepiece`` when ``▁``-initial symbols outnumber ``@@``-final ones."""
    bpe = sum(s.endswith(BPE_CONTINUATION) for s in symbols)
    spm = sum(s.startswith(SENTENCEPIECE_WORD_START) for s in symbols)
    return "sentencepiece" if spm > bpe else "bpe"


class SubwordCharacterTable(nn.Module):
    """Per-vocabulary lookup table: subword id -> characters and word-joining flags.

    Args:
        dictionary: the source ``fairseq.data.Dictionary`` (``symbols``, ``count``,
            ``nspecial``, ``pad()``, ``unk()``).
        style: ``auto``, ``bpe`` or ``sentencepiece``.
        max_characters: keep only the most frequent characters (weighted by the
            dictionary counts); the others read as the unknown character. ``None``
            keeps every character of the dictionary.
    """

    def __init__(self, dictionary, style: str = "auto", max_characters: Optional[int] = None):
        super().__init__()
        symbols: List[str] = list(dictionary.symbols)
        if style == "auto":
            style = detect_subword_style(symbols[dictionary.nspecial:])
        if style not in ("bpe", "sentencepiece"):
            raise ValueError(f"unknown subword style {style!r}: use {', '.join(SUBWORD_STYLES)}")
        if max_characters is not None and max_characters < 1:
            raise ValueError(f"max_characters must be positive, got {max_characters}")
        self.style = style
        self.pad_index = dictionary.pad()
        specials = [i for i in range(dictionary.nspecial) if i != self.pad_index]

        pieces = [self.strip_markers(s) for s in symbols]
        counts = list(dictionary.count) if len(dictionary.count) == len(symbols) else [1] * len(symbols)
        frequency = {}
        for i in range(dictionary.nspecial, len(symbols)):
            for ch in pieces[i]:
                frequency[ch] = frequency.get(ch, 0) + max(counts[i], 1)
        ranked = sorted(frequency, key=lambda ch: (-frequency[ch], ch))
        if max_characters is not None:
            ranked = ranked[:max_characters]
        first_ordinary = NUM_RESERVED_CHARS + len(specials)
        char_index = {ch: first_ordinary + k for k, ch in enumerate(sorted(ranked))}

        token_chars: List[List[int]] = []
        for i, piece in enumerate(pieces):
            if i == self.pad_index:
                token_chars.append([])
            elif i == dictionary.unk():
                token_chars.append([UNK_CHAR])
            elif i < dictionary.nspecial:
                token_chars.append([NUM_RESERVED_CHARS + specials.index(i)])
            else:
                token_chars.append([char_index.get(ch, UNK_CHAR) for ch in piece])
        width = max(1, max(len(c) for c in token_chars))
        table = torch.full((len(symbols), width), PAD_CHAR, dtype=torch.long)
        for i, chars in enumerate(token_chars):
            table[i, : len(chars)] = torch.tensor(chars, dtype=torch.long)

        ordinary = torch.ones(len(symbols), dtype=torch.bool)
        ordinary[: dictionary.nspecial] = False
        if style == "bpe":
            open_end = torch.tensor([s.endswith(BPE_CONTINUATION) for s in symbols]) & ordinary
            open_start = ordinary.clone()
        else:
            open_end = ordinary.clone()
            open_start = torch.tensor([not s.startswith(SENTENCEPIECE_WORD_START) for s in symbols]) & ordinary

        self.register_buffer("token_chars", table)
        self.register_buffer("token_num_chars", torch.tensor([len(c) for c in token_chars]))
        self.register_buffer("token_is_ordinary", ordinary)
        self.register_buffer("token_open_end", open_end)
        self.register_buffer("token_open_start", open_start)
        self.register_buffer(
            "character_codepoints", torch.tensor([ord(ch) for ch in sorted(ranked)], dtype=torch.long)
        )
        self.num_characters = first_ordinary + len(ranked)

    def strip_markers(self, symbol: str) -> str:
        """The characters of a dictionary symbol, without its subword marker."""
        if self.style == "bpe" and symbol.endswith(BPE_CONTINUATION):
            return symbol[: -len(BPE_CONTINUATION)]
        if self.style == "sentencepiece" and symbol.startswith(SENTENCEPIECE_WORD_START):
            return symbol[len(SENTENCEPIECE_WORD_START):]
        return symbol

    def character_vocabulary(self) -> List[str]:
        """The characters behind ids ``NUM_RESERVED_CHARS + #specials`` onwards."""
        return [chr(c) for c in self.character_codepoints.tolist()]

    def subword_word_boundaries(self, src_tokens: torch.Tensor):
        """(ends_word, word_ids) for B x Ls ``src_tokens``: whether each subword closes
        its word, and the index of its word (-1 at padding)."""
        if src_tokens.dim() != 2:
            raise ValueError(f"src_tokens must be B x T, got shape {tuple(src_tokens.shape)}")
        if src_tokens.numel() and (src_tokens.min() < 0 or src_tokens.max() >= self.token_chars.size(0)):
            raise ValueError(
                f"src_tokens hold ids outside the {self.token_chars.size(0)}-symbol dictionary"
            )
        is_pad = src_tokens.eq(self.pad_index)
        following = torch.cat([src_tokens[:, 1:], src_tokens.new_full((src_tokens.size(0), 1), self.pad_index)], 1)
        joins_next = self.token_open_end[src_tokens] & self.token_open_start[following]
        ends_word = ~is_pad & ~joins_next
        word_ids = torch.cumsum(ends_word.long(), 1) - ends_word.long()
        return ends_word, word_ids.masked_fill(is_pad, -1)

    def forward(self, src_tokens: torch.Tensor) -> FastBranchInput:
        """Characters of every sentence in ``src_tokens`` (B x Ls, either padding side)."""
        ends_word, subword_word_ids = self.subword_word_boundaries(src_tokens)
        bsz, seq_len = src_tokens.shape
        num_chars = self.token_num_chars[src_tokens]
        adds_marker = ends_word & self.token_is_ordinary[src_tokens]
        lengths = num_chars + adds_marker.long()  # B x Ls characters per subword
        starts = torch.cumsum(lengths, 1) - lengths
        total = lengths.sum(1)
        max_len = max(int(total.max()), 1) if bsz else 1

        width = self.token_chars.size(1) + 1
        chars = torch.cat([self.token_chars[src_tokens], src_tokens.new_zeros(bsz, seq_len, 1)], 2)
        chars.scatter_(2, num_chars.unsqueeze(2), torch.where(adds_marker, WORD_END_CHAR, PAD_CHAR).unsqueeze(2))
        offset = torch.arange(width, device=src_tokens.device)
        valid = offset.view(1, 1, -1) < lengths.unsqueeze(2)  # B x Ls x width
        position = (starts.unsqueeze(2) + offset.view(1, 1, -1))[valid]
        row = torch.arange(bsz, device=src_tokens.device).view(-1, 1, 1).expand_as(valid)[valid]
        subword = torch.arange(seq_len, device=src_tokens.device).view(1, -1, 1).expand_as(valid)[valid]

        tokens = src_tokens.new_full((bsz, max_len), PAD_CHAR)
        tokens[row, position] = chars[valid]
        word_ids = src_tokens.new_full((bsz, max_len), -1)
        word_ids[row, position] = subword_word_ids.unsqueeze(2).expand_as(valid)[valid]
        subword_ids = src_tokens.new_full((bsz, max_len), -1)
        subword_ids[row, position] = subword
        padding_mask = torch.arange(max_len, device=src_tokens.device).view(1, -1) >= total.view(-1, 1)
        return FastBranchInput(tokens, padding_mask, word_ids, subword_ids, subword_word_ids)

    def subword_input(self, src_tokens: torch.Tensor) -> FastBranchInput:
        """The subwords themselves as the fast branch's input (Table 4d's ablation)."""
        _, subword_word_ids = self.subword_word_boundaries(src_tokens)
        positions = torch.arange(src_tokens.size(1), device=src_tokens.device).expand_as(src_tokens)
        is_pad = src_tokens.eq(self.pad_index)
        return FastBranchInput(
            src_tokens, is_pad, subword_word_ids, positions.masked_fill(is_pad, -1), subword_word_ids
        )

    def decode(self, fast_input: FastBranchInput, index: int) -> str:
        """Human-readable characters of sentence ``index`` ("_" after words, specials
        as ``<#k>``, unknown as ``<?>``): for tests and debugging."""
        vocabulary = self.character_vocabulary()
        first_ordinary = self.num_characters - len(vocabulary)
        out = []
        for c in fast_input.tokens[index][~fast_input.padding_mask[index]].tolist():
            if c == WORD_END_CHAR:
                out.append("_")
            elif c == UNK_CHAR:
                out.append("<?>")
            elif c < first_ordinary:
                out.append(f"<#{c - NUM_RESERVED_CHARS}>")
            else:
                out.append(vocabulary[c - first_ordinary])
        return " ".join(out)
