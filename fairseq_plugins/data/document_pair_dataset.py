"""Sentence pairs with their document context, one sample per sentence of the split.

Sample i is sentence i preceded by its context window (see ``document_context``) on both
sides, joined as described in ``document_layout``. Only the current sentence is a training
target: context target positions are padding in ``target``, so fairseq's criteria (which skip
padding) put no loss on them, and ``fairseq-generate`` scores each sentence exactly once. The
reference translations of the context travel as ``target_context`` (the oracle decoding mode).

For decoding with the model's own translations as target context, a dataset can batch in
*document order*: batch b holds only sentences whose preceding sentences all sit in earlier
batches (sentences grouped by their position in their document), so each sentence's context
has been translated before it is decoded.
"""

import numpy as np
import torch
from fairseq.data import FairseqDataset, data_utils

from .document_context import context_starts, document_starts


class DocumentPairDataset(FairseqDataset):
    """Wraps sentence-level source/target datasets (items end with ``</s>``) and document ids."""

    def __init__(
        self, src, tgt, src_dict, tgt_dict, docids, max_context_tokens,
        left_pad_source=True, shuffle=True, split="", document_order=False,
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
        self.context_start = context_starts(docids, src.sizes, max_context_tokens)
        self.position_in_document = np.arange(len(docids)) - document_starts(docids)
        self.src_sizes = self._window_sizes(np.asarray(src.sizes, dtype=np.int64))
        self.tgt_sizes = self._window_sizes(np.asarray(tgt.sizes, dtype=np.int64))
        self.sizes = np.vstack((self.src_sizes, self.tgt_sizes)).T

    def _window_sizes(self, sentence_sizes):
        """Tokens in each sample: the current sentence plus its whole context window."""
        ends = np.concatenate([[0], np.cumsum(sentence_sizes)])
        index = np.arange(len(sentence_sizes))
        return ends[index + 1] - ends[self.context_start]

    def _joined(self, dataset, first, last):
        """Sentences first..last-1 of ``dataset``, each with its end mark turned into ``<s>``."""
        parts = []
        for j in range(first, last):
            sentence = dataset[j]
            if sentence[-1].item() != self.eos:
                raise ValueError(f"sentence {j} does not end with </s>: not fairseq-preprocess output")
            parts.append(torch.cat([sentence[:-1], sentence.new_tensor([self.separator])]))
        return torch.cat(parts) if parts else dataset[last].new_empty(0)

    def __getitem__(self, index):
        first = int(self.context_start[index])
        return {
            "id": index,
            "source": torch.cat([self._joined(self.src, first, index), self.src[index]]),
            "target_context": self._joined(self.tgt, first, index),
            "target": self.tgt[index],
        }

    def __len__(self):
        return len(self.src)

    def collater(self, samples):
        """fairseq's translation batch, plus ``target_context`` (right-padded, may be 0 wide)."""
        if len(samples) == 0:
            return {}
        full_targets = [torch.cat([s["target_context"], s["target"]]) for s in samples]
        # loss only on the current sentence: context positions become padding
        targets = [
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
            "ntokens": sum(len(s["target"]) for s in samples),
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
