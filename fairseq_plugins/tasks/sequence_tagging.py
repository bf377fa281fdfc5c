"""Sequence tagging (POS, NER) as a fairseq task and criterion: one label per word.

Data layout, as fairseq's ``sentence_prediction`` has it: ``input0/`` holds the words and
``label/`` the tags, one sentence a line with one tag per word, each binarized with
``fairseq-preprocess --only-source`` (the tags with their own dictionary). The encoder reads
the words and the end-of-sentence token fairseq-preprocess appends; the model's token-level
head (``register_classification_head(..., token_level=True)``) labels each word, the end token
is not scored.

``--criterion sequence_tagging`` logs token accuracy and, with ``--tag-scheme BIO`` or
``BIOES``, CoNLL span precision, recall and F1 (:mod:`fairseq_plugins.tasks.tagging_scores`);
choose the checkpoint by ``--best-checkpoint-metric accuracy`` (POS) or ``f1`` (NER) with
``--maximize-best-checkpoint-metric``. A model built with ``--crf`` (a linear-chain CRF on its
head, :mod:`fairseq_plugins.modules.common.linear_crf`) trains on the CRF's negative
log-likelihood instead of the per-word cross-entropy, and its tags are the Viterbi path
(the head's ``predict_tags``, which the evaluation and the hub call too).
"""

import contextlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch.nn.functional as F
from omegaconf import II, MISSING, OmegaConf, open_dict

from fairseq import metrics
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.data import (
    AppendTokenDataset, Dictionary, IdDataset, NestedDictionaryDataset, NumelDataset, NumSamplesDataset,
    OffsetTokensDataset, RightPadDataset, SortDataset, StripTokenDataset, data_utils,
)
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import FairseqTask, register_task

from fairseq_plugins.data.labels import check_known
from fairseq_plugins.tasks.tagging_scores import SCHEMES, f1, span_counts

logger = logging.getLogger(__name__)

IGNORE = -100  # target of positions that are not words (end of sentence, padding)
TAG_SCHEMES = ("none",) + SCHEMES


@dataclass
class SequenceTaggingConfig(FairseqDataclass):
    data: str = field(default=MISSING, metadata={"help": "folder with input0/ (words) and label/ (tags)"})
    max_positions: int = field(default=512, metadata={"help": "longest sentence in tokens"})
    tag_scheme: ChoiceEnum(TAG_SCHEMES) = field(default="none", metadata={
        "help": "span scoring: BIO (conlleval's rules, also right for IOB1), BIOES (strict), none (accuracy only)"})
    classification_head_name: str = field(default="tagging_head", metadata={"help": "name of the tagger's head"})
    no_shuffle: bool = field(default=False, metadata={
        "help": "keep the sentences in file order (by default each split is shuffled once, with --seed)"})
    seed: int = II("common.seed")


@register_task("sequence_tagging", dataclass=SequenceTaggingConfig)
class SequenceTaggingTask(FairseqTask):
    def __init__(self, cfg, dictionary, label_dictionary):
        super().__init__(cfg)
        self.dictionary = dictionary
        self._label_dictionary = label_dictionary

    @classmethod
    def setup_task(cls, cfg, **kwargs):
        words = Dictionary.load(os.path.join(cfg.data, "input0", "dict.txt"))
        tags = Dictionary.load(os.path.join(cfg.data, "label", "dict.txt"))
        logger.info(f"[input] dictionary: {len(words)} types; [label] dictionary: {len(tags)} types")
        return cls(cfg, words, tags)

    @property
    def num_tags(self) -> int:
        return len(self._label_dictionary) - self._label_dictionary.nspecial

    def tag_strings(self, ids) -> list:
        return [self._label_dictionary[int(i) + self._label_dictionary.nspecial] for i in ids]

    def load_dataset(self, split, combine=False, **kwargs):
        def load(key, dictionary):
            path = os.path.join(self.cfg.data, key, split)
            dataset = data_utils.load_indexed_dataset(path, dictionary, combine=combine)
            if dataset is None:
                raise FileNotFoundError(f"no {key} data for split {split!r} at {path}")
            return dataset

        words = load("input0", self.dictionary)
        tags = load("label", self._label_dictionary)
        check_known(tags, self._label_dictionary, os.path.join(self.cfg.data, "label", split))
        if len(words) != len(tags) or not np.array_equal(words.sizes, tags.sizes):
            pairs = enumerate(zip(words.sizes, tags.sizes))
            bad = next((i for i, (a, b) in pairs if a != b), min(len(words), len(tags)))
            raise ValueError(f"{split}: sentence {bad} has a different number of words and tags "
                             f"(input0 and label must have one tag per word on each line)")
        targets = OffsetTokensDataset(StripTokenDataset(tags, self._label_dictionary.eos()),
                                      -self._label_dictionary.nspecial)
        targets = AppendTokenDataset(targets, IGNORE)  # the end-of-sentence token has no tag
        dataset = NestedDictionaryDataset({
            "id": IdDataset(),
            "net_input": {
                "src_tokens": RightPadDataset(words, pad_idx=self.dictionary.pad()),
                "src_lengths": NumelDataset(words, reduce=False),
            },
            "target": RightPadDataset(targets, pad_idx=IGNORE),
            "nsentences": NumSamplesDataset(),
            "ntokens": NumelDataset(words, reduce=True),
        }, sizes=[words.sizes])
        if not self.cfg.no_shuffle:
            with data_utils.numpy_seed(self.cfg.seed):
                dataset = SortDataset(dataset, sort_order=[np.random.permutation(len(dataset))])
        self.datasets[split] = dataset
        return dataset

    def build_model(self, cfg, from_checkpoint=False):
        from fairseq import models

        with open_dict(cfg) if OmegaConf.is_config(cfg) else contextlib.ExitStack():
            cfg.max_positions = self.cfg.max_positions
        model = models.build_model(cfg, self, from_checkpoint)
        if not hasattr(model, "register_classification_head"):
            raise ValueError(f"--arch {cfg.arch} has no classification heads: use a classifier architecture "
                             f"(transformer_classifier, bpt_classifier, segtree_classifier, ms_classifier, ms_tagger)")
        model.register_classification_head(self.cfg.classification_head_name, num_classes=self.num_tags,
                                           token_level=True)
        return model

    def max_positions(self):
        return self.cfg.max_positions

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary

    @property
    def label_dictionary(self):
        return self._label_dictionary


@register_criterion("sequence_tagging")
class SequenceTaggingCriterion(FairseqCriterion):
    """Cross-entropy per word, or a ``--crf`` model's sentence negative log-likelihood; logs accuracy
    and (with a tag scheme) span precision/recall/F1. The loss is summed and divided by the words."""

    def __init__(self, task):
        super().__init__(task)
        self.head = task.cfg.classification_head_name
        self.scheme = task.cfg.tag_scheme

    def forward(self, model, sample, reduce=True):
        logits, _ = model(**sample["net_input"], classification_head_name=self.head)
        target = sample["target"]
        logits = logits[:, : target.size(1)]
        words = target.ne(IGNORE)
        head = model.classification_heads[self.head]
        if head.crf is None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1),
                                   ignore_index=IGNORE, reduction="sum")
        else:
            loss = head.crf(logits.float(), target, words).sum()
        predicted = head.predict_tags(logits, words)
        sample_size = int(words.sum())
        log = {"loss": loss.data, "ntokens": sample["ntokens"], "nsentences": target.size(0),
               "sample_size": sample_size, "ncorrect": int((predicted.eq(target) & words).sum())}
        if self.scheme != "none":
            gold, pred = [], []
            for row_target, row_pred, row_words in zip(target.tolist(), predicted.tolist(), words.tolist()):
                keep = [i for i, w in enumerate(row_words) if w]
                gold.append(self.task.tag_strings(row_target[i] for i in keep))
                pred.append(self.task.tag_strings(row_pred[i] for i in keep))
            log["span_true"], log["span_pred"], log["span_gold"] = span_counts(gold, pred, self.scheme)
        return loss, sample_size, log

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")
        metrics.log_scalar("loss", total("loss") / max(sample_size, 1) / np.log(2), sample_size, round=3)
        metrics.log_scalar("accuracy", 100.0 * total("ncorrect") / max(sample_size, 1), sample_size, round=2)
        if any("span_gold" in log for log in logging_outputs):
            # counts summed over the whole validation set, the scores derived from the sums
            for key in ("span_true", "span_pred", "span_gold"):
                metrics.log_scalar_sum(f"_{key}", total(key))

            def counts(meters):
                return meters["_span_true"].sum, meters["_span_pred"].sum, meters["_span_gold"].sum

            metrics.log_derived("precision", lambda m: round(100.0 * counts(m)[0] / max(counts(m)[1], 1), 2))
            metrics.log_derived("recall", lambda m: round(100.0 * counts(m)[0] / max(counts(m)[2], 1), 2))
            metrics.log_derived("f1", lambda m: round(f1(*counts(m)), 2))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False  # ints and tensors mixed; fairseq then reduces through reduce_metrics
