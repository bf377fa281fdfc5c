"""The hub interface of the sentence classifiers and taggers: text in, labels out.

Like fairseq's ``RobertaHubInterface``: ``encode`` turns raw sentences into the token ids the
task built in training (tokenizer and BPE if the checkpoint was loaded with them, the
dictionary, the task's ``--init-token`` and ``--separator-token``); ``predict`` returns a
head's log-probabilities; ``predict_label`` returns label strings (a ``--crf`` tagger's Viterbi path).
"""

from typing import List, Union

import torch
import torch.nn.functional as F
from torch import nn

from fairseq.data import encoders


class SentenceHubInterface(nn.Module):
    def __init__(self, cfg, task, model):
        super().__init__()
        self.cfg = cfg
        self.task = task
        self.model = model
        self.tokenizer = encoders.build_tokenizer(cfg.tokenizer)
        self.bpe = encoders.build_bpe(cfg.bpe)
        self.register_buffer("_float_tensor", torch.tensor([0], dtype=torch.float))

    @property
    def device(self):
        return self._float_tensor.device

    def _ids(self, sentence: str) -> torch.Tensor:
        if self.tokenizer is not None:
            sentence = self.tokenizer.encode(sentence)
        if self.bpe is not None:
            sentence = self.bpe.encode(sentence)
        return self.task.source_dictionary.encode_line(sentence, append_eos=True, add_if_not_exist=False).long()

    def encode(self, sentence: str, *addl_sentences: str) -> torch.Tensor:
        """Token ids of one sentence, or of a pair as the task concatenates them."""
        task_cfg = self.task.cfg
        parts = [self._ids(sentence)]
        if getattr(task_cfg, "init_token", None) is not None:
            parts.insert(0, torch.tensor([task_cfg.init_token]))
        for other in addl_sentences:
            if getattr(task_cfg, "separator_token", None) is not None:
                parts.append(torch.tensor([task_cfg.separator_token]))
            parts.append(self._ids(other))
        return torch.cat(parts)

    def predict(self, head: str, tokens: torch.LongTensor, return_logits: bool = False) -> torch.Tensor:
        """Log-probabilities (or logits) of ``head``: [B x classes], a tagger's [B x T x classes]."""
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        tokens = tokens.to(self.device)
        lengths = tokens.ne(self.task.source_dictionary.pad()).sum(1)
        with torch.no_grad():
            logits, _ = self.model(tokens, src_lengths=lengths, classification_head_name=head)
        return logits if return_logits else F.log_softmax(logits.float(), dim=-1)

    def predict_label(self, sentence: str, *addl_sentences: str, head: str = None) -> Union[str, List[str]]:
        """The label of a sentence (or pair), or a tagger's tag for each word of the sentence."""
        head = head or self.task.cfg.classification_head_name
        tokens = self.encode(sentence, *addl_sentences)
        scores = self.predict(head, tokens, return_logits=True)
        labels = self.task.label_dictionary
        if scores.dim() == 2:
            return labels[int(scores.argmax(-1)[0]) + labels.nspecial]
        words = len(self._ids(sentence)) - 1  # the tagger's words, without the end-of-sentence token
        mask = torch.arange(scores.size(1), device=scores.device).lt(words).unsqueeze(0)
        best = self.model.classification_heads[head].predict_tags(scores, mask)[0]
        return [labels[int(i) + labels.nspecial] for i in best[:words]]
