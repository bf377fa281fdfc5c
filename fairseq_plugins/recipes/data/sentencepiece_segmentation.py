"""Sentencepiece segmentation of tokenized text (Kudo and Richardson, 2018), the other choice to
subword-nmt BPE (``Recipe.segmentation``): a unigram model learnt from the training text, applied
line by line in worker processes (the model is loaded once per process). Pieces carry "▁" at the
start of a word; ``fairseq-generate --remove-bpe sentencepiece`` joins them back."""

import io
from pathlib import Path
from typing import List

from .progress import log

SENTENCEPIECE_WORD_START = "\u2581"
_MODEL = None  # per-process sentencepiece processor


def learn_sentencepiece(texts: List[List[str]], vocab_size: int, model: Path) -> None:
    """A unigram model of ``vocab_size`` pieces learnt from every line of ``texts``, written to
    ``model`` (a sample of 10M lines when there are more, as sentencepiece's own trainer samples)."""
    import sentencepiece

    lines = [line for lines in texts for line in lines if line.strip()]
    log(f"learning a {vocab_size}-piece sentencepiece model from {len(lines)} lines -> {model.name}")
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, input_sentence_size=10_000_000, shuffle_input_sentence=True,
        hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    model.write_bytes(proto.getvalue())


def init_sentencepiece(model: str) -> None:
    """Load the model into this process (a ``map_lines`` initializer: once per worker)."""
    global _MODEL
    import sentencepiece

    _MODEL = sentencepiece.SentencePieceProcessor(model_file=model)


def apply_sentencepiece(line: str) -> str:
    """``line`` as the pieces of the model ``init_sentencepiece`` loaded, space-separated."""
    return " ".join(_MODEL.encode(line, out_type=str))
