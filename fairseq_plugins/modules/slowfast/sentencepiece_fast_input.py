"""The source re-segmented by a sentencepiece model: the fast branch's input for the
paper's Table 4d row "subword slow + sentencepiece fast".

The slow branch reads the data-bin's subwords as usual. The fast branch reads the same
sentence cut by a second segmentation, computed inside the model so that
``fairseq-generate`` and ``fairseq-interactive`` need no extra input files: the subwords
are joined into words through the dictionary (``SubwordCharacterTable`` knows where
words end), each word is encoded by the sentencepiece model, and the pieces are the
fast branch's units. Dictionary special symbols (``</s>``, ``<unk>``, ...) stay one unit
each, as for the character input.

Encoding word by word is the same as encoding the sentence for a model trained with
sentencepiece's default ``split_by_whitespace`` (pieces never cross a space); the words
are the tokenized text the BPE was learned on with the ``@@`` joins undone, which is
what the sentencepiece model should be trained on (docs/slowfast.md). Segmentations are
cached per word.

The serialized sentencepiece model is a buffer of this module: the checkpoint carries it
and loading a checkpoint rebuilds the processor from it, so a checkpoint translates
without the original ``.model`` file.
"""

import bisect
from typing import Dict, List, Optional, Tuple

import sentencepiece
import torch
from torch import nn

from .subword_characters import SENTENCEPIECE_WORD_START as WORD_START, FastBranchInput, SubwordCharacterTable

PAD_UNIT = 0


def piece_count(model_proto: bytes) -> int:
    """The number of pieces of a serialized sentencepiece model."""
    return sentencepiece.SentencePieceProcessor(model_proto=model_proto).get_piece_size()


class SentencePieceFastInput(nn.Module):
    """src_tokens -> sentencepiece units (``FastBranchInput``).

    Unit ids: 0 padding, then the dictionary's special symbols but padding, then the
    sentencepiece pieces in the model's order. ``subword_ids`` of a piece is the subword
    its first character comes from.

    Args:
        characters: the source dictionary's ``SubwordCharacterTable`` (subword surfaces).
        dictionary: the source dictionary.
        model_proto: the serialized sentencepiece model; None builds an empty module
            of ``num_pieces`` pieces that a state dict fills in (a checkpoint loaded
            where its ``.model`` file no longer is).
    """

    def __init__(
        self,
        characters: SubwordCharacterTable,
        dictionary,
        model_proto: Optional[bytes],
        num_pieces: Optional[int] = None,
    ):
        super().__init__()
        self.pad_index = dictionary.pad()
        self.surfaces = [characters.strip_markers(s) for s in dictionary.symbols]
        specials = [i for i in range(dictionary.nspecial) if i != self.pad_index]
        self.special_units = {token: 1 + k for k, token in enumerate(specials)}
        self.first_piece = 1 + len(specials)
        proto = torch.tensor(list(model_proto or b""), dtype=torch.uint8)
        self.register_buffer("model_proto", proto)
        self.processor: Optional[sentencepiece.SentencePieceProcessor] = None
        self._cache: Dict[str, Tuple[Tuple[int, int], ...]] = {}
        if model_proto is not None:
            self._load_processor()
            num_pieces = piece_count(model_proto)
        if num_pieces is None:
            raise ValueError("a SentencePieceFastInput without a model needs num_pieces")
        self.num_units = self.first_piece + num_pieces

    def _load_processor(self):
        self.processor = sentencepiece.SentencePieceProcessor(model_proto=bytes(self.model_proto.tolist()))
        self._cache = {}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the checkpoint's model wins over the file the module was built from
        key = prefix + "model_proto"
        if key in state_dict:
            self.model_proto = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if key in state_dict:
            self._load_processor()
            if self.first_piece + self.processor.get_piece_size() != self.num_units:
                raise RuntimeError(
                    f"the checkpoint's sentencepiece model has {self.processor.get_piece_size()} pieces, "
                    f"the model was built for {self.num_units - self.first_piece}"
                )

    def segment(self, word: str) -> Tuple[Tuple[int, int], ...]:
        """(unit id, first character) of each piece of ``word``. Characters are counted
        on the pieces' text (an unknown piece counts one), which is the word's own
        unless the model's normalisation changes it."""
        pieces = self._cache.get(word)
        if pieces is None:
            start, pieces = 0, []
            for piece in self.processor.encode(word, out_type=int):
                pieces.append((self.first_piece + piece, start))
                if self.processor.is_unknown(piece):
                    start += 1
                else:
                    start += len(self.processor.id_to_piece(piece).replace(WORD_START, ""))
            pieces = self._cache[word] = tuple(pieces)
        return pieces

    def forward(
        self, src_tokens: torch.Tensor, ends_word: torch.Tensor, subword_word_ids: torch.Tensor
    ) -> FastBranchInput:
        """``ends_word`` and ``subword_word_ids``: ``SubwordCharacterTable.subword_word_boundaries``."""
        if self.processor is None:
            raise RuntimeError("no sentencepiece model: load a checkpoint or give --fast-sentencepiece-model")
        rows: List[Tuple[List[int], List[int], List[int]]] = []
        for tokens, ends in zip(src_tokens.tolist(), ends_word.tolist()):
            units, words, subwords = [], [], []
            word, starts, word_index = "", [], 0
            for position, (token, end) in enumerate(zip(tokens, ends)):
                if token == self.pad_index:
                    continue
                if token in self.special_units:  # a special symbol is a word of its own
                    units.append(self.special_units[token])
                    words.append(word_index)
                    subwords.append(position)
                else:
                    starts.append(len(word))  # first character of each subword of the word
                    word += self.surfaces[token]
                    if end:
                        first = position - len(starts) + 1
                        for unit, char in self.segment(word):
                            units.append(unit)
                            words.append(word_index)
                            subwords.append(first + max(bisect.bisect_right(starts, char) - 1, 0))
                        word, starts = "", []
                if end:
                    word_index += 1
            rows.append((units, words, subwords))
        return self._batch(rows, src_tokens.device, subword_word_ids)

    @staticmethod
    def _batch(rows, device, subword_word_ids) -> FastBranchInput:
        width = max([1] + [len(units) for units, _, _ in rows])

        def padded(index: int, fill: int) -> torch.Tensor:
            return torch.tensor(
                [row[index] + [fill] * (width - len(row[index])) for row in rows], dtype=torch.long, device=device
            )

        tokens = padded(0, PAD_UNIT)
        return FastBranchInput(tokens, tokens.eq(PAD_UNIT), padded(1, -1), padded(2, -1), subword_word_ids)
