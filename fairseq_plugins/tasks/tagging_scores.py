"""Scores of a sequence tagger: token accuracy (POS) and span F1 (NER), summed over batches.

Span F1 is CoNLL's: an entity counts when its type and both boundaries match. ``BIO`` scores
as the CoNLL ``conlleval`` script does (seqeval's default mode: an ``I-`` after ``O`` or
after another type opens an entity, so IOB1 and IOB2 files both score right); ``BIOES``
scores strictly under that scheme (seqeval's strict mode). Counts (true positives,
predicted, gold entities) add up over batches and workers, so fairseq's metrics aggregate them.
"""

from typing import List, Sequence, Tuple

from fairseq_plugins.command_line import import_extra

SCHEMES = ("BIO", "BIOES")


def _entities(sequences: List[List[str]], scheme: str):
    # imported here: the plugin loads (every task registers) without the "tagging" extra
    import_extra("seqeval", "tagging", "span F1 of the sequence_tagging task")
    from seqeval.metrics.sequence_labeling import get_entities
    from seqeval.scheme import IOBES, Entities

    if scheme == "BIO":
        return [set(get_entities(seq)) for seq in sequences]
    if scheme == "BIOES":
        return [{e.to_tuple()[1:] for e in sentence} for sentence in Entities(sequences, IOBES).entities]
    raise ValueError(f"unknown tag scheme {scheme!r}: choose from {', '.join(SCHEMES)}")


def span_counts(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]], scheme: str = "BIO"
                ) -> Tuple[int, int, int]:
    """(true positives, predicted entities, gold entities) over sentences of tag strings."""
    if len(gold) != len(predicted) or any(len(g) != len(p) for g, p in zip(gold, predicted)):
        raise ValueError("gold and predicted tags differ in number or length")
    gold_sets = _entities([list(s) for s in gold], scheme)
    pred_sets = _entities([list(s) for s in predicted], scheme)
    true = sum(len(g & p) for g, p in zip(gold_sets, pred_sets))
    return true, sum(map(len, pred_sets)), sum(map(len, gold_sets))


def f1(true: float, predicted: float, gold: float) -> float:
    """Span F1 in percent (0 when nothing was predicted or nothing is gold)."""
    if true == 0:
        return 0.0
    precision, recall = true / predicted, true / gold
    return 100.0 * 2 * precision * recall / (precision + recall)
