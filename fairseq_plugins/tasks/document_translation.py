"""Context-aware translation: every sentence is translated with the sentences before it in its
document (the BPT paper's document-level setting, section 4.3.1, Tables 5 and 6).

Data: fairseq-preprocess output plus ``{split}.docids`` (one document id per sentence). By
default each sentence is one sample, loss and output on the current sentence only; with
``--document-samples chunks`` a sample is a chunk of sentences behind the previous chunk, as the
original BPT code builds them (see ``fairseq_plugins.data.document_pair_dataset``), and a chunk's
translation is split back into its sentences, so that fairseq-generate prints and scores one
hypothesis per test sentence either way. Training conditions on the reference translations of the
context (teacher forcing); translation, by default, on the model's own translations of the
preceding sentences (``--target-context``).
"""

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import utils
from fairseq.data import data_utils, indexed_dataset
from fairseq.dataclass import ChoiceEnum
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_plugins.data.document_context import SAMPLE_LAYOUTS, read_docids
from fairseq_plugins.data.document_layout import source_sentence_index
from fairseq_plugins.data.document_pair_dataset import DocumentPairDataset
from fairseq_plugins.data.document_text import SentenceSeparated
from fairseq_plugins.tasks.sentence_count_search import SentenceCountSearch

logger = logging.getLogger(__name__)


@dataclass
class DocumentTranslationConfig(TranslationConfig):
    context_tokens: int = field(
        default=0,
        metadata={
            "help": "context length l: at most this many source tokens (one separator per "
            "sentence included) of whole preceding sentences of the same document; 0 = "
            "sentence-level. The paper's Table 6 uses 0, 32, 64, 128"
        },
    )
    document_samples: ChoiceEnum(list(SAMPLE_LAYOUTS)) = field(
        default="sentences",
        metadata={
            "help": "sentences = one sample per sentence, behind at most --context-tokens tokens of "
            "whole preceding sentences, loss on that sentence only; chunks = the original BPT "
            "code's samples: each document cut into chunks of whole sentences of at least "
            "--context-tokens/2 source tokens, a sample is the previous chunk and the current one, "
            "loss on every target sentence of the sample, and a chunk's sentences are translated "
            "together, then output and scored one by one"
        },
    )
    target_context: ChoiceEnum(["translations", "oracle-reference", "same-pass"]) = field(
        default="translations",
        metadata={
            "help": "target context when translating: translations = the model's own "
            "translations of the preceding sentences, decoded in document order and forced as a "
            "decoder prefix (what a real system has); oracle-reference = the reference "
            "translations of the preceding sentences (an oracle: test references leak into the "
            "input); same-pass = the model translates context and sentence in one beam search "
            "(the original BPT code). Only the current sentence is ever output"
        },
    )
    target_context_at_inference: Optional[str] = field(
        default=None,
        metadata={
            "help": "replaced by --target-context (reference = oracle-reference, generated = "
            "same-pass); kept so that checkpoints that stored it still load, and refused when "
            "it asks for anything but the old default"
        },
    )


@register_task("document_translation", dataclass=DocumentTranslationConfig)
class DocumentTranslationTask(TranslationTask):
    """Translation of sentences in their document context (any fairseq translation model)."""

    cfg: DocumentTranslationConfig

    def __init__(self, cfg: DocumentTranslationConfig, src_dict, tgt_dict):
        if cfg.context_tokens < 0:
            raise ValueError(f"--context-tokens must be >= 0, got {cfg.context_tokens}")
        unsupported = {
            "--left-pad-target": cfg.left_pad_target,
            "--truncate-source": cfg.truncate_source,
            "--load-alignments": cfg.load_alignments,
            "--num-batch-buckets": cfg.num_batch_buckets > 0,
        }
        for option, used in unsupported.items():
            if used:
                raise ValueError(f"document_translation does not support {option}")
        if cfg.target_context_at_inference not in (None, "reference"):
            # "reference" was the old default, stored in every checkpoint trained with it
            raise ValueError(
                f"--target-context-at-inference {cfg.target_context_at_inference} is gone: use "
                "--target-context same-pass (was 'generated') or oracle-reference (was 'reference')"
            )
        if cfg.target_context_at_inference == "reference":
            logger.warning(
                "--target-context-at-inference is obsolete and ignored (checkpoints of earlier "
                f"versions store it); the target context is --target-context {cfg.target_context}"
            )
        super().__init__(cfg, src_dict, tgt_dict)
        # sentence index -> the best hypothesis (no </s>), per split, for --target-context translations
        self.translations = {}

    @property
    def sentence_separator(self) -> int:
        """The token joining the sentences of a sample (see ``document_layout``)."""
        return self.src_dict.bos()

    def build_tokenizer(self, args):
        """fairseq's tokenizer, applied to each ``<s>``-separated sentence of raw input (it would
        split the marker and fuse the context into the sentence)."""
        return self._separated(super().build_tokenizer(args))

    def build_bpe(self, args):
        """fairseq's BPE, applied to each ``<s>``-separated sentence of raw input."""
        return self._separated(super().build_bpe(args))

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """fairseq-interactive's lines, less those with no sentence to translate after the last
        ``<s>`` (an empty line, or context alone): the model would invent a translation of nothing.
        Each is skipped with a warning and the session goes on."""
        separator = self.src_dict[self.sentence_separator]
        kept = []
        for line in lines:
            if line.rsplit(separator, 1)[-1].strip():
                kept.append(line)
            else:
                logger.warning(f"skipped an input line with no sentence to translate after its last {separator}: "
                               f"{line!r}")
        return super().get_interactive_tokens_and_lengths(kept, encode_fn)

    def _separated(self, encoder):
        return None if encoder is None else SentenceSeparated(encoder, self.src_dict[self.sentence_separator])

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        paths = utils.split_paths(self.cfg.data)
        data_path = paths[(epoch - 1) % len(paths)] if split == self.cfg.train_subset else paths[0]
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        prefix = None
        for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
            candidate = os.path.join(data_path, f"{split}.{pair}.")
            if indexed_dataset.dataset_exists(candidate + src, impl=self.cfg.dataset_impl):
                prefix = candidate
                break
        if prefix is None:
            raise FileNotFoundError(f"Dataset not found: {split} ({data_path})")
        if indexed_dataset.dataset_exists(
            prefix.replace(f"{split}.", f"{split}1.", 1) + src, impl=self.cfg.dataset_impl
        ):
            raise ValueError(f"sharded split {split}1 found in {data_path}: not supported")
        src_data = data_utils.load_indexed_dataset(prefix + src, self.src_dict, self.cfg.dataset_impl)
        tgt_data = data_utils.load_indexed_dataset(prefix + tgt, self.tgt_dict, self.cfg.dataset_impl)
        if tgt_data is None:
            raise FileNotFoundError(f"target side of {split} not found: {prefix + tgt}")
        docids = read_docids(os.path.join(data_path, f"{split}.docids"))
        dataset = DocumentPairDataset(
            src_data, tgt_data, self.src_dict, self.tgt_dict, docids,
            max_context_tokens=self.cfg.context_tokens,
            left_pad_source=self.cfg.left_pad_source,
            shuffle=(split != "test"),
            split=split,
            document_order=self._decodes_in_document_order(split),
            samples=self.cfg.document_samples,
        )
        logger.info(
            f"{data_path} {split} {src}-{tgt}: {len(src_data)} sentences, {len(set(docids))} documents, "
            f"{len(dataset)} samples ({self.cfg.document_samples}, --context-tokens {self.cfg.context_tokens})"
        )
        self.datasets[split] = dataset
        self.translations[split] = {}

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, **kwargs):
        """fairseq's generator; with chunk samples its search keeps every hypothesis at the number
        of sentences of its source (``SentenceCountSearch``), so that it splits into them."""
        if self.cfg.document_samples == "chunks" and getattr(args, "print_alignment", None):
            raise ValueError("--print-alignment is not supported with --document-samples chunks")
        generator = super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, **kwargs)
        if self.cfg.document_samples == "chunks" and hasattr(generator, "search"):
            generator.search = SentenceCountSearch(generator.search, self.sentence_separator)
        return generator

    def _decodes_in_document_order(self, split) -> bool:
        """Splits that may be translated with the model's own context are batched so that a
        sentence comes after its context (training batches stay fairseq's; validation loss does
        not depend on the order, so sharded validation in distributed training is fine)."""
        return (
            self.cfg.target_context == "translations"
            and self.cfg.context_tokens > 0
            and split != self.cfg.train_subset
        )

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        """Decode the sample with its target context, then keep only its current sentences (with
        chunk samples, one row per sentence: ``sample`` is rewritten to match, see
        ``_one_row_per_sentence``), and remember them as context of the samples after them."""
        if prefix_tokens is not None:
            raise ValueError(
                "document_translation sets the decoder prefix itself (the target context); "
                "do not pass --prefix-size"
            )
        split = sample.get("document_split")
        dataset = self.datasets.get(split) if split in self.translations else None
        separators = sample["net_input"]["src_tokens"].eq(self.sentence_separator).sum(dim=1)
        if dataset is None:  # fairseq-interactive: the last sentence of a line is the one translated
            n_context = separators.tolist()
        else:
            ids = sample["id"].cpu().numpy()
            n_context = (dataset.current_start[ids] - dataset.context_start[ids]).tolist()
        if isinstance(getattr(generator, "search", None), SentenceCountSearch):
            generator.search.expect(sample["id"], separators)
        if dataset is None or self.cfg.target_context == "same-pass":
            context = None  # fairseq-interactive has no target context: the model translates it
        elif self.cfg.target_context == "oracle-reference":
            context = sample["target_context"]
        else:
            context = self._own_translations(split, sample["id"])
            context = context.to(sample["net_input"]["src_tokens"].device)
        if context is not None and context.size(1) == 0:
            context = None
        with torch.no_grad():
            if context is None:
                hypos = generator.generate(models, sample, constraints=constraints)
            else:
                # --max-len-a/b budget the current sentences: widen it by the forced prefix
                max_len_b = generator.max_len_b
                generator.max_len_b = max_len_b + context.size(1)
                try:
                    hypos = generator.generate(
                        models, sample, prefix_tokens=context, constraints=constraints
                    )
                finally:
                    generator.max_len_b = max_len_b
        for row, row_hypos in enumerate(hypos):
            for hypo in row_hypos:
                self._drop_context(hypo, n_context[row])
            if context is not None and isinstance(generator, SequenceGenerator):
                self._rescore_current_sentence(row_hypos, generator)
        if dataset is not None and dataset.samples == "chunks":
            hypos = self._one_row_per_sentence(sample, hypos, dataset, n_context, generator)
        if dataset is not None:
            for sentence, row_hypos in zip(sample["id"].tolist(), hypos):
                self.translations[split][sentence] = self._as_context(row_hypos[0]["tokens"])
        return hypos

    def _one_row_per_sentence(self, sample, hypos, dataset, n_context, generator):
        """Split every chunk hypothesis (its current sentences, joined by ``<s>``) into sentences,
        and rewrite ``sample`` to one row per sentence (id, source and reference sentence), so that
        fairseq-generate prints and scores each test sentence once against its own reference.

        The n-best list of a sentence follows the ranking of the chunk hypotheses; a sentence's
        score is its own log probability over its length ** --lenpen."""
        ids, rows = [], []
        for row, (sample_id, row_hypos) in enumerate(zip(sample["id"].tolist(), hypos)):
            sentences = dataset.sentences(sample_id)
            source = sample["net_input"]["src_tokens"][row]
            source_sentence = source_sentence_index(source, self.sentence_separator).masked_fill(
                source.eq(self.src_dict.pad()), -1
            )
            parts = [self._split_hypothesis(hypo, len(sentences), sample_id, generator) for hypo in row_hypos]
            for k, sentence in enumerate(sentences):
                aligned = source_sentence.eq(n_context[row] + k).nonzero().flatten()
                for part in parts:
                    if part[k]["attention"] is not None:
                        part[k]["attention"] = part[k]["attention"][aligned]
                ids.append(sentence)
                rows.append([part[k] for part in parts])
        pad, eos, device = self.src_dict.pad(), self.src_dict.eos(), sample["id"].device
        sources = [dataset.src[j] for j in ids]
        sample["id"] = torch.tensor(ids, dtype=torch.long, device=device)
        sample["net_input"]["src_tokens"] = data_utils.collate_tokens(
            sources, pad, eos, left_pad=dataset.left_pad_source
        ).to(device)
        sample["net_input"]["src_lengths"] = torch.tensor([len(s) for s in sources], device=device)
        if sample.get("target") is not None:
            references = [dataset.tgt[j] for j in ids]
            sample["target"] = data_utils.collate_tokens(references, pad, eos).to(device)
            sample["ntokens"] = sum(len(t) for t in references)
        sample["nsentences"] = len(ids)
        return rows

    def _split_hypothesis(self, hypo, n_sentences, sample_id, generator):
        """The ``n_sentences`` sentences of a hypothesis, each ending with ``</s>`` (in place of its
        ``<s>``) and scored alone. The search holds every hypothesis at that number of sentences;
        one cut short by the maximum length gets empty sentences for those it lacks (warned)."""
        tokens, scores = hypo["tokens"], hypo["positional_scores"]
        attention = hypo.get("attention")
        cuts = tokens.eq(self.sentence_separator).nonzero().flatten().tolist()[: n_sentences - 1]
        if len(cuts) < n_sentences - 1:
            logger.warning(
                f"sample {sample_id}: a translation has {len(cuts) + 1} of its {n_sentences} sentences "
                "(cut by the maximum length: raise --max-len-b); the others are left empty"
            )
        ends = cuts + [len(tokens) - 1]
        starts = [0] + [cut + 1 for cut in cuts]
        parts = []
        for start, end in zip(starts, ends):
            sentence = tokens[start : end + 1].clone()
            sentence[-1] = self.tgt_dict.eos()
            parts.append(self._sentence_hypothesis(
                sentence, scores[start : end + 1],
                attention[:, start : end + 1] if attention is not None and attention.numel() > 0 else None,
                generator,
            ))
        for _ in range(n_sentences - len(parts)):
            empty = tokens.new_tensor([self.tgt_dict.eos()])
            parts.append(self._sentence_hypothesis(empty, scores.new_tensor([-math.inf]), None, generator))
        return parts

    @classmethod
    def _sentence_hypothesis(cls, tokens, positional_scores, attention, generator):
        return {
            "tokens": tokens,
            "positional_scores": positional_scores,
            "score": cls._sentence_score(positional_scores, generator),
            "attention": attention,
            "alignment": torch.empty(0),
        }

    @staticmethod
    def _sentence_score(positional_scores, generator):
        """A sentence's score as sentence-level decoding gives it: log probability over its length
        (with its end mark) ** --lenpen (unless --unnormalized)."""
        score = positional_scores.sum()
        if getattr(generator, "normalize_scores", True):
            score = score / len(positional_scores) ** getattr(generator, "len_penalty", 1.0)
        return score

    @classmethod
    def _rescore_current_sentence(cls, row_hypos, generator):
        """Score a hypothesis as sentence-level decoding would: its current sentence's (with chunk
        samples: sentences') log probability divided by its length ** --lenpen, then rank again.

        fairseq normalises by the whole output, forced prefix included (60-130 tokens at
        l = 64/128 against a sentence of about 25), which leaves scores almost unnormalised.
        Beam search itself ranks by cumulative log probability, which the shared prefix shifts
        by the same amount for every hypothesis, so only this final score needs the change.
        """
        for hypo in row_hypos:
            hypo["score"] = cls._sentence_score(hypo["positional_scores"], generator)
        row_hypos.sort(key=lambda hypo: float(hypo["score"]), reverse=True)

    def _as_context(self, tokens):
        """A hypothesis as a context sentence: no </s>, and no separator inside it."""
        tokens = tokens.cpu()
        return tokens[tokens.ne(self.tgt_dict.eos()) & tokens.ne(self.sentence_separator)]

    def _own_translations(self, split, ids):
        """Right-padded B x T prefix of the model's own translations of each sample's context
        window, each sentence followed by the separator (the layout of the training targets)."""
        dataset, done = self.datasets[split], self.translations[split]
        rows = []
        for sample in ids.tolist():
            parts = []
            for previous in range(int(dataset.context_start[sample]), int(dataset.current_start[sample])):
                if previous not in done:
                    raise RuntimeError(
                        f"{split}: sample {sample} needs the translation of sentence {previous}, "
                        "which was not decoded before it on this process (skipped by a size limit, "
                        "batches not in document order, or decoding split over several processes); "
                        "translate on one process, or use --target-context oracle-reference or same-pass"
                    )
                parts += [done[previous], torch.tensor([self.sentence_separator])]
            rows.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
        width = max(len(r) for r in rows)
        context = torch.full((len(rows), width), self.tgt_dict.pad(), dtype=torch.long)
        for row, tokens in enumerate(rows):
            context[row, : len(tokens)] = tokens
        return context

    def _drop_context(self, hypo, n_context):
        """Cut a hypothesis after its ``n_context``-th separator (after the last one if the
        model produced fewer, which only the same-pass mode allows)."""
        if n_context == 0:
            return
        separators = hypo["tokens"].eq(self.sentence_separator).nonzero().flatten()
        if len(separators) == 0:
            return
        cut = int(separators[min(n_context, len(separators)) - 1]) + 1
        hypo["tokens"] = hypo["tokens"][cut:]
        hypo["positional_scores"] = hypo["positional_scores"][cut:]
        if hypo.get("attention") is not None and hypo["attention"].numel() > 0:
            hypo["attention"] = hypo["attention"][:, cut:]
