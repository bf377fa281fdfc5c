"""An encoder with classification heads, for fairseq's ``sentence_prediction`` task and the
plugin's ``sequence_tagging`` task.

The model is an encoder (one of the plugin's, or fairseq's transformer encoder: each subclass
overrides ``build_encoder``), a readout that turns its states into one vector per sentence
(:mod:`fairseq_plugins.modules.common.sentence_readout`; each architecture defaults to its
paper's) and named heads, as fairseq's RoBERTa has them: ``register_classification_head``
and ``classification_heads``. A head registered with ``token_level=True`` (the tagger's)
classifies every token's state instead of the sentence vector.

Inputs may start from pre-trained word vectors: ``--encoder-embed-path`` names a GloVe text
file (fairseq's flag; read as GloVe here), ``--freeze-embeddings`` keeps them fixed as the
BPT and SegTree papers do. ``--char-ngram-dim`` joins character features to every word (JMT's
character n-grams, the Multi-Scale paper's "+ Char" tagging rows): the word embedding then
takes the encoder's width minus that dim.

Sentence pairs are read jointly by default (the task's single row ``<s> a </s> SEP b </s>``, as
RoBERTa reads MNLI); ``--pair-encoding separate`` encodes each sentence alone with the same
encoder and classifies ``[r1; r2; |r1 - r2|; r1 * r2]``, the Multi-Scale paper's SNLI setup
(:mod:`fairseq_plugins.modules.common.sentence_pairs`).

``--embed-dropout`` is the dropout on the input embeddings (BPT's and SegTree's ``dropouti``;
unset: ``--dropout``, fairseq's), ``--layernorm-dropped-embedding`` a layer norm after it (their
``norm(emb_dropout(h))``); ``--no-bos-eos-tokens`` encodes each sentence without the
task's ``<s>`` and the ``</s>`` of its row, so that a tree encoder's leaves are the sentence's
words alone, as in BPT's and SegTree's original classifiers.

``--crf`` gives a tagger's head a linear-chain CRF
(:mod:`fairseq_plugins.modules.common.linear_crf`): the sequence_tagging criterion then trains on
its negative log-likelihood and every prediction is its Viterbi path.
"""

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fairseq.data import data_utils
from fairseq.dataclass import ChoiceEnum
from fairseq.models import BaseFairseqModel
from fairseq.models.transformer import Embedding, TransformerConfig
from fairseq.modules import LayerNorm

from fairseq_plugins.data.labels import (
    check_known, check_no_empty_split, check_num_classes, check_regression_targets, class_labels,
)
from fairseq_plugins.models.dictionary_fingerprint import DictionaryFingerprint
from fairseq_plugins.models.lm_training import EmbeddingDropout, LMTrainingConfig
from fairseq_plugins.models.model_options import add_config_args, check_at_least, check_choice, config_with_options
from fairseq_plugins.models.plugin_model import task_data_folders
from fairseq_plugins.modules.common.char_ngram_embedding import CharNgramWordEmbedding
from fairseq_plugins.modules.common.classification_heads import ClassificationHead
from fairseq_plugins.modules.common.pretrained_embeddings import load_pretrained
from fairseq_plugins.modules.common.sentence_pairs import pair_features, split_pair
from fairseq_plugins.modules.common.sentence_readout import READOUTS, readout_dim, sentence_vector
from fairseq_plugins.modules.common.sentence_words import words_only


PAIR_ENCODINGS = ("joint", "separate")


@dataclass
class _ClassifierOwnOptions:
    """The options every sentence classifier adds to its encoder's (with ``--embed-dropout``, below)."""

    sentence_readout: ChoiceEnum(READOUTS) = field(default="cls-max", metadata={
        "help": "sentence vector: root (tree root node: BPT, SegTree), cls-max ([CLS] joined with max-pooling: "
                "Multi-Scale), cls (first token: RoBERTa), max, mean"})
    classifier_layers: int = field(default=2, metadata={
        "help": "layers of the classification head: 1 (dropout, linear: BPT) or 2 (MLP: Multi-Scale)"})
    classifier_inner_dim: int = field(default=0, metadata={
        "help": "hidden width of a 2-layer head (0: the encoder's embedding dim)"})
    pooler_dropout: float = field(default=0.0, metadata={"help": "dropout before (and inside) the head"})
    pooler_activation_fn: str = field(default="relu", metadata={"help": "activation inside a 2-layer head"})
    pair_encoding: ChoiceEnum(PAIR_ENCODINGS) = field(default="joint", metadata={
        "help": "sentence pairs: joint (one row, premise SEP hypothesis: RoBERTa) or separate (each sentence "
                "encoded alone, head on [r1; r2; |r1 - r2|; r1 * r2]: the Multi-Scale paper's SNLI)"})
    char_ngram_dim: int = field(default=0, metadata={
        "help": "character features: width of JMT's character n-gram embedding (n 2-4, averaged per word) "
                "concatenated to the word embedding, which takes the rest of --encoder-embed-dim (0: none)"})
    char_ngram_path: str = field(default="", metadata={
        "help": "JMT's pre-trained charNgram.txt to start the n-gram embeddings from (needs --char-ngram-dim)"})
    crf: bool = field(default=False, metadata={
        "help": "a tagger's output: a linear-chain CRF over the head's per-word scores, trained on its "
                "log-likelihood and decoded by Viterbi (the Multi-Scale paper's + CRF rows)"})
    freeze_embeddings: bool = field(default=False, metadata={
        "help": "keep the input embeddings fixed (with --encoder-embed-path: fixed GloVe, as BPT and SegTree)"})
    layernorm_dropped_embedding: bool = field(default=False, metadata={
        "help": "a layer norm on the dropped-out input embeddings, norm(dropout(embedding)), as BPT's and "
                "SegTree's original classifiers (--layernorm-embedding normalizes before the dropout)"})
    no_bos_eos_tokens: bool = field(default=False, metadata={
        "help": "encode each sentence without the <s> in front and the </s> at its end: a tree's leaves are "
                "then its words alone, as BPT's and SegTree's original classifiers build them (sentence "
                "classification with a root, max or mean readout)"})


# the language models' --embed-dropout, declared once
ClassifierOptions = config_with_options("ClassifierOptions", _ClassifierOwnOptions, LMTrainingConfig,
                                        ["embed_dropout"], __name__)


def check_task_labels(task) -> None:
    """sentence_prediction's labels (fairseq's task checks nothing, and fairseq-train loads the data
    after the model): regression targets that are numbers; --num-classes against the label
    dictionary, and no unknown label in the binarized splits beside train (fairseq-preprocess
    built the dictionary from train, so only the others can hold one; they are small enough to
    read at every load)."""
    labels = getattr(task, "label_dictionary", None)
    num_classes = getattr(getattr(task, "cfg", None), "num_classes", None)
    if getattr(getattr(task, "cfg", None), "regression_target", False):
        check_regression_targets(os.path.join(task.cfg.data, "label"))
    if labels is None or num_classes is None:  # regression, or the tagger (whose task checks its tags)
        return
    folder = os.path.join(task.cfg.data, "label")
    check_num_classes(labels, num_classes, os.path.join(folder, "dict.txt"))
    splits = sorted(name[:-len(".idx")] for name in os.listdir(folder) if name.endswith(".idx")) \
        if os.path.isdir(folder) else []
    for split in splits:
        if split != "train":
            path = os.path.join(folder, split)
            check_known(data_utils.load_indexed_dataset(path, labels), labels, path)


def embed_dropout(cfg) -> float:
    """The dropout rate on the input embeddings: ``--embed-dropout``, unset ``--dropout`` (fairseq's)."""
    rate = cfg.dropout if cfg.embed_dropout is None else cfg.embed_dropout
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"--embed-dropout {rate}: give a rate in [0, 1]")
    if cfg.layernorm_dropped_embedding and cfg.layernorm_embedding:
        raise ValueError("--layernorm-dropped-embedding normalizes the embeddings after their dropout: "
                         "drop --layernorm-embedding (before it)")
    return rate


def check_words_only(cfg, folders) -> None:
    """--no-bos-eos-tokens leaves out what a [CLS] readout reads and the </s> that separates a joint pair."""
    if cfg.sentence_readout in ("cls", "cls-max"):
        raise ValueError(f"--sentence-readout {cfg.sentence_readout} reads the <s> that --no-bos-eos-tokens leaves "
                         "out: use root, max or mean")
    if cfg.pair_encoding == "joint" and any(os.path.isdir(os.path.join(f, "input1")) for f in folders):
        raise ValueError("--no-bos-eos-tokens would join a pair's sentences (their </s> is the boundary): "
                         "give --pair-encoding separate")


class SentenceEncoderModel(DictionaryFingerprint, BaseFairseqModel):
    """Encoder + readout + named classification heads (subclasses choose the encoder)."""

    config_class = TransformerConfig  # a subclass's config, with ClassifierOptions among its bases

    def __init__(self, cfg, encoder, label_dictionary=None):
        BaseFairseqModel.__init__(self)  # the fingerprint's buffer is registered below, once encoder exists
        self.encoder = encoder
        self.label_dictionary = label_dictionary  # the task's (None for regression): fingerprinted
        self.cfg = cfg
        self.args = cfg  # fairseq's criteria look up optional settings on model.args
        self.readout = cfg.sentence_readout
        self.classification_heads = nn.ModuleDict()
        self.register_buffer("dictionary_fingerprint", self._current_fingerprint())

    def fingerprinted_dictionaries(self) -> dict:
        sides = {"source": self.encoder.dictionary, "target": self.encoder.dictionary}
        if self.label_dictionary is not None:
            sides["label"] = self.label_dictionary
        return sides

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, cls.config_class)

    @classmethod
    def build_model(cls, args, task):
        cfg = cls.config_class.from_namespace(args)
        if getattr(args, "max_positions", None):  # set by sentence_prediction and sequence_tagging
            cfg.max_source_positions = args.max_positions
        check_choice(cfg, "sentence_readout", READOUTS)
        check_at_least(cfg, "classifier_layers", 1)
        check_choice(cfg, "pair_encoding", PAIR_ENCODINGS)
        if cfg.pair_encoding == "separate" and None in (getattr(task.cfg, "init_token", None),
                                                       getattr(task.cfg, "separator_token", None)):
            raise ValueError("--pair-encoding separate splits the sentence_prediction task's pair rows: give the "
                             "task --init-token and --separator-token (e.g. 0 and 2)")
        cls.check_options(cfg)
        folders = task_data_folders(task)
        if cfg.no_bos_eos_tokens:
            check_words_only(cfg, folders)
        for folder in folders:
            check_no_empty_split(folder)
        check_task_labels(task)
        dictionary = task.source_dictionary
        encoder = cls.build_encoder(cfg, dictionary, cls.build_input_embedding(cfg, dictionary))
        # fairseq's encoders apply their dropout_module to the embeddings only (forward_embedding)
        norm = LayerNorm(cfg.encoder.embed_dim) if cfg.layernorm_dropped_embedding else None
        encoder.dropout_module = EmbeddingDropout(embed_dropout(cfg), norm)
        return cls(cfg, encoder, getattr(task, "label_dictionary", None))

    @classmethod
    def build_input_embedding(cls, cfg, dictionary):
        """Word embeddings (GloVe, fixed or not), with character n-gram features when asked."""
        if not 0 <= cfg.char_ngram_dim < cfg.encoder.embed_dim:
            raise ValueError(f"--char-ngram-dim {cfg.char_ngram_dim} must be >= 0 and leave the word embedding part of "
                             f"--encoder-embed-dim {cfg.encoder.embed_dim}")
        if cfg.char_ngram_path and not cfg.char_ngram_dim:
            raise ValueError("--char-ngram-path needs --char-ngram-dim (the width of its vectors, JMT's: 100)")
        words = Embedding(len(dictionary), cfg.encoder.embed_dim - cfg.char_ngram_dim, dictionary.pad())
        if cfg.encoder.embed_path:
            load_pretrained(words, dictionary, cfg.encoder.embed_path)
        if cfg.freeze_embeddings:
            words.weight.requires_grad_(False)
        if not cfg.char_ngram_dim:
            return words
        embedding = CharNgramWordEmbedding(words, dictionary, cfg.char_ngram_dim)
        if cfg.char_ngram_path:
            embedding.load_ngram_vectors(cfg.char_ngram_path)
        return embedding

    @classmethod
    def check_options(cls, cfg):
        """Clear errors for options this encoder cannot have."""
        if cfg.sentence_readout == "root":
            raise ValueError("--sentence-readout root needs a tree encoder (bpt_classifier, segtree_classifier)")

    @classmethod
    def build_encoder(cls, cfg, dictionary, embed_tokens):
        raise NotImplementedError

    def max_positions(self):
        return self.encoder.max_positions()

    def register_classification_head(self, name, num_classes=None, inner_dim=None, token_level=False, **kwargs):
        """A head over the sentence vector, or with ``token_level`` over each token's state."""
        if token_level and self.cfg.no_bos_eos_tokens:
            raise ValueError("--no-bos-eos-tokens is for sentence classification: a tagger's tags are read from "
                             "every token of its row")
        embed_dim = self.cfg.encoder.embed_dim
        input_dim = embed_dim if token_level else readout_dim(self.readout, embed_dim)
        if self.cfg.pair_encoding == "separate" and not token_level:
            input_dim *= 4  # [r1; r2; |r1 - r2|; r1 * r2]
        self.classification_heads[name] = ClassificationHead(
            input_dim, inner_dim or self.cfg.classifier_inner_dim or embed_dim, num_classes,
            self.cfg.classifier_layers, self.cfg.pooler_activation_fn, self.cfg.pooler_dropout,
            token_level=token_level, crf=self.cfg.crf,
        )

    def forward(self, src_tokens, src_lengths=None, features_only=True, classification_head_name=None, **kwargs):
        """Logits of the head ``classification_head_name`` ([B x classes], a tagger's [B x T x
        classes]), or without a head the sentence vectors [B x D]; second: the encoder's output."""
        head = self.classification_heads[classification_head_name] if classification_head_name else None
        if head is not None and head.token_level:
            out = self.encoder(src_tokens, src_lengths=src_lengths)
            return self._tags_only(head(out["encoder_out"][0].transpose(0, 1))), out
        if self.cfg.pair_encoding == "separate":
            features, out = self._pair_vectors(src_tokens)
        else:
            features, out = self._sentence_vectors(src_tokens, src_lengths)
        return (features if head is None else head(features)), out

    def _tags_only(self, logits):
        """-inf for a tagger's columns that are no tag: the head has one per symbol of the tag
        dictionary, the padding fairseq-preprocess adds to it (``madeupword0000``...) included."""
        if self.label_dictionary is None:
            return logits
        tags = set(class_labels(self.label_dictionary))
        symbols = self.label_dictionary.symbols[self.label_dictionary.nspecial:][: logits.size(-1)]
        not_tag = torch.tensor([s not in tags for s in symbols], device=logits.device)
        return logits.masked_fill(not_tag, float("-inf"))

    def _sentence_vectors(self, src_tokens, src_lengths):
        want_root = self.readout == "root"
        if self.cfg.no_bos_eos_tokens:
            d = self.encoder.dictionary
            src_tokens = words_only(src_tokens, d.bos(), d.eos(), d.pad())
            src_lengths = src_tokens.ne(d.pad()).sum(1)
        out = self.encoder(src_tokens, src_lengths=src_lengths, **({"return_root": True} if want_root else {}))
        padding = out["encoder_padding_mask"][0] if out["encoder_padding_mask"] else None
        root = out["encoder_root"][0] if want_root else None
        return sentence_vector(self.readout, out["encoder_out"][0], padding, root), out

    def _pair_vectors(self, src_tokens):
        """Both sentences of every pair through the encoder in one batch of 2B rows."""
        pad = self.encoder.dictionary.pad()
        first, second = split_pair(src_tokens, self.encoder.dictionary.eos(), pad)
        width = max(first.size(1), second.size(1))
        rows = torch.cat([F.pad(part, (0, width - part.size(1)), value=pad) for part in (first, second)])
        vectors, out = self._sentence_vectors(rows, rows.ne(pad).sum(1))
        return pair_features(*vectors.chunk(2)), out

    def get_targets(self, sample, net_output):
        return sample["target"]

    def upgrade_state_dict_named(self, state_dict, name):
        # fairseq's loader may also hand over heads this model lacks; keep only known ones
        prefix = name + "." if name else ""
        for key in [k for k in state_dict if k.startswith(prefix + "classification_heads.")]:
            head = key[len(prefix + "classification_heads."):].split(".")[0]
            if head not in self.classification_heads:
                del state_dict[key]
        super().upgrade_state_dict_named(state_dict, name)

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="checkpoint_best.pt", data_name_or_path=".",
                        **kwargs):
        """A hub interface (``encode``, ``predict``, ``predict_label``) over a local checkpoint."""
        from fairseq import hub_utils

        from fairseq_plugins.models.sentence_hub_interface import SentenceHubInterface

        loaded = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path,
                                           archive_map={}, **kwargs)
        return SentenceHubInterface(loaded["args"], loaded["task"], loaded["models"][0])

    @classmethod
    def hub_models(cls):
        return {}

