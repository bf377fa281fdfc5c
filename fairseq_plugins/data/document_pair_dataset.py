"""Sentence pairs with their document context: document-level samples of a split.

Two layouts (``document_context.sample_windows``), both joined as described in
``document_layout``:

- ``sentences``: sample i is sentence i preceded by its context window on both sides. Only the
  current sentence is a training target: context target positions are padding in ``target``, so
  fairseq's criteria (which skip padding) put no loss on them, and ``fairseq-generate`` scores
  each sentence exactly once.
- ``chunks`` (the original BPT code): a sample is a chunk of whole sentences preceded by the
  previous chunk of its document. Every target token of the sample is a training target, the
  previous chunk's included, as in the original (its ``MTBatcher`` labels the whole target).

The reference translations of the context travel as ``target_context`` (the oracle decoding mode).

For decoding with the model's own translations as target context, a dataset can batch in
*document order*: batch b holds only samples whose preceding samples all sit in earlier batches
(samples grouped by their position in their document), so each sample's context has been
translated before it is decoded.
"""

import numpy as np
import torch
from fairseq.data import FairseqDataset, data_utils

from .document_context import document_starts, sample_windows


class DocumentPairDataset(FairseqDataset):
    """Wraps sentence-level source/target datasets (items end with ``</s>``) and document ids;
    ``src``/``tgt`` stay the sentence-level datasets, items are samples."""

    def __init__(
        self, src, tgt, src_dict, tgt_dict, docids, max_context_tokens,
        left_pad_source=True, shuffle=True, split="", document_order=False, samples="sentences",
    ):
        if len(src) != len(tgt):
            raise ValueError(f"{len(src)} source sentences but {len(tgt)} target sentences")
        if src_dict.bos() != tgt_dict.bos() or src_dict.pad() != tgt_dict.pad():
            raise ValueError("source and target dictionaries disagree on <s>/<pad> indices")
        self.src, self.tgt = src, tgt
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.separator = src_dict.bos()
        self.pad, self.eos = src_dict.pad(), src_dict.eos()
        self.left_pad_source = left_pad_source
        self.shuffle = shuffle
        self.max_context_tokens = max_context_tokens
        self.split = split
        self.document_order = document_order
        self.samples = samples
        self.context_loss = samples == "chunks"  # the original trains on the whole chunk sample
        windows = sample_windows(samples, docids, src.sizes, max_context_tokens)
        self.context_start = windows.context_start
        self.current_start, self.current_end = windows.current_start, windows.current_end
        sample_document = np.asarray(docids)[self.current_start]
        self.position_in_document = np.arange(len(self.current_start)) - document_starts(sample_document)
        self.src_sizes = self._window_sizes(np.asarray(src.sizes, dtype=np.int64))
        self.tgt_sizes = self._window_sizes(np.asarray(tgt.sizes, dtype=np.int64))
        self.sizes = np.vstack((self.src_sizes, self.tgt_sizes)).T

    def _window_sizes(self, sentence_sizes):
        """Tokens in each sample: the current sentences plus their whole context window."""
        ends = np.concatenate([[0], np.cumsum(sentence_sizes)])
        return ends[self.current_end] - ends[self.context_start]

    def _joined(self, dataset, first, last):
        """Sentences first..last-1 of ``dataset``, each with its end mark turned into ``<s>``."""
        parts = []
        for j in range(first, last):
            sentence = dataset[j]
            if sentence[-1].item() != self.eos:
                raise ValueError(f"sentence {j} does not end with </s>: not fairseq-preprocess output")
            parts.append(torch.cat([sentence[:-1], sentence.new_tensor([self.separator])]))
        return torch.cat(parts) if parts else dataset[last].new_empty(0)

    def _sentences(self, dataset, first, end):
        """Sentences first..end-1, joined by ``<s>``, the last one ending with its ``</s>``."""
        return torch.cat([self._joined(dataset, first, end - 1), dataset[end - 1]])

    def sentences(self, index) -> range:
        """The sentences sample ``index`` translates (its current sentences)."""
        return range(int(self.current_start[index]), int(self.current_end[index]))

    def __getitem__(self, index):
        context = int(self.context_start[index])
        first, end = int(self.current_start[index]), int(self.current_end[index])
        return {
            "id": index,
            "source": torch.cat([self._joined(self.src, context, first), self._sentences(self.src, first, end)]),
            "target_context": self._joined(self.tgt, context, first),
            "target": self._sentences(self.tgt, first, end),
        }

    def __len__(self):
        return len(self.current_start)

    def collater(self, samples):
        """fairseq's translation batch, plus ``target_context`` (right-padded, may be 0 wide)."""
        if len(samples) == 0:
            return {}
        full_targets = [torch.cat([s["target_context"], s["target"]]) for s in samples]
        # sentences layout: loss only on the current sentence, context positions become padding
        targets = full_targets if self.context_loss else [
            torch.cat([s["target_context"].new_full(s["target_context"].shape, self.pad), s["target"]])
            for s in samples
        ]
        contexts = [s["target_context"] for s in samples]
        width = max(len(c) for c in contexts)
        target_context = torch.full((len(samples), width), self.pad, dtype=torch.long)
        for row, context in enumerate(contexts):
            target_context[row, : len(context)] = context
        return {
            "id": torch.LongTensor([s["id"] for s in samples]),
            "nsentences": len(samples),
            "ntokens": sum(len(t) - int(t.eq(self.pad).sum()) for t in targets),
            "net_input": {
                "src_tokens": data_utils.collate_tokens(
                    [s["source"] for s in samples], self.pad, self.eos, left_pad=self.left_pad_source
                ),
                "src_lengths": torch.LongTensor([len(s["source"]) for s in samples]),
                "prev_output_tokens": data_utils.collate_tokens(
                    full_targets, self.pad, self.eos, left_pad=False, move_eos_to_beginning=True
                ),
            },
            "target": data_utils.collate_tokens(targets, self.pad, self.eos, left_pad=False),
            "target_context": target_context,
            "document_split": self.split,  # where the task finds the context windows
        }

    def num_tokens(self, index):
        return max(self.src_sizes[index], self.tgt_sizes[index])

    def num_tokens_vec(self, indices):
        return np.maximum(self.src_sizes[indices], self.tgt_sizes[indices])

    def size(self, index):
        return (self.src_sizes[index], self.tgt_sizes[index])

    def ordered_indices(self):
        """Shuffled (when training), then sorted by target and source length like fairseq's."""
        indices = np.random.permutation(len(self)) if self.shuffle else np.arange(len(self))
        indices = indices[np.argsort(self.tgt_sizes[indices], kind="mergesort")]
        return indices[np.argsort(self.src_sizes[indices], kind="mergesort")]

    def batch_by_size(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        """fairseq's batching; in document order, done separately for the first sentences of all
        documents, then the second ones, ... so that no batch holds a sentence and its context."""
        if not self.document_order:
            return super().batch_by_size(indices, max_tokens, max_sentences, required_batch_size_multiple)
        indices = np.asarray(indices, dtype=np.int64)
        position = self.position_in_document[indices]
        batches = []
        for wave in np.unique(position):
            batches += super().batch_by_size(
                indices[position == wave], max_tokens, max_sentences, required_batch_size_multiple
            )
        return batches

    def filter_indices_by_size(self, indices, max_sizes):
        return data_utils.filter_paired_dataset_indices_by_size(
            self.src_sizes, self.tgt_sizes, indices, max_sizes
        )
