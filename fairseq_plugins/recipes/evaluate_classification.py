"""Score sentence classifiers and taggers on a test set: accuracy, or CoNLL span F1.

    fairseq-plugins-evaluate bpt-table1:bpt-sst5     # every seed's run, mean and deviation

``fairseq-plugins-evaluate`` sends configs whose task is ``sentence_prediction`` or
``sequence_tagging`` here. The checkpoint is loaded with its task over the prepared data-bin,
the test split runs through the task's own batching, and the score is computed from the
predictions: sentence accuracy; for tagging, token accuracy and span F1 (the task's
``--tag-scheme``) of the task's predicted tags (a ``--crf`` tagger's Viterbi paths). A config
with ``seeds`` (the papers' protocol, e.g. BPT: 10 runs) is scored on each seed's run, and the
result holds every run, the mean and the standard deviation.

A config's ``evaluate: {shift: n}`` scores under a sequence shift (BPT section 4.1.1, Table 2):
n placeholder symbols in front of each sentence, their embeddings all zeros, on a model trained
without them (the same runs as the unshifted row).
"""

import json
import statistics
from pathlib import Path
from typing import Dict, List

TASKS = ("sentence_prediction", "sequence_tagging")
EVALUATE_OPTIONS = ("shift",)  # what a classification config's ``evaluate:`` section may set


def _zero_placeholders(model) -> int:
    """Give the model's input embedding one more symbol, the placeholder, whose embedding is all
    zeros (BPT's shift test); returns its id (one past the dictionary)."""
    from torch import nn

    class PlaceholderEmbedding(nn.Module):
        def __init__(self, inner: nn.Embedding):
            super().__init__()
            self.inner, self.placeholder = inner, inner.num_embeddings
            self.padding_idx, self.embedding_dim = inner.padding_idx, inner.embedding_dim

        def forward(self, tokens):
            is_placeholder = tokens.eq(self.placeholder)
            vectors = self.inner(tokens.masked_fill(is_placeholder, self.padding_idx))
            return vectors.masked_fill(is_placeholder.unsqueeze(-1), 0.0)

    wrapped = PlaceholderEmbedding(model.encoder.embed_tokens)
    model.encoder.embed_tokens = wrapped
    return wrapped.placeholder


def shifted(net_input: dict, placeholder: int, shift: int) -> dict:
    """``shift`` placeholders in front of every (right-padded) row."""
    import torch

    tokens = net_input["src_tokens"]
    front = tokens.new_full((tokens.size(0), shift), placeholder)
    return dict(net_input, src_tokens=torch.cat([front, tokens], 1), src_lengths=net_input["src_lengths"] + shift)


def _load(checkpoint: Path, data: Path):
    from fairseq import checkpoint_utils

    import fairseq_plugins.models  # noqa: F401  (registers the plugin, as --user-dir would)
    import fairseq_plugins.tasks  # noqa: F401

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                       arg_overrides={"data": str(data)})
    return models[0].eval(), task


def score_checkpoint(checkpoint: Path, data: Path, subset: str = "test", batch_size: int = 64,
                     shift: int = 0) -> Dict[str, float]:
    """{"accuracy"} (sentences or tokens) and for tagging with a tag scheme {"f1", "precision", "recall"};
    with ``shift`` n, n zero-embedding placeholders lead every sentence."""
    import torch

    from fairseq_plugins.tasks.sequence_tagging import IGNORE
    from fairseq_plugins.tasks.tagging_scores import f1, span_counts

    model, task = _load(checkpoint, data)
    tagging = hasattr(task, "num_tags")
    if shift < 0 or shift and (tagging or getattr(model.cfg, "pair_encoding", "joint") == "separate"):
        raise ValueError(f"shift {shift}: a shift is n >= 0 placeholders before a sentence to classify (not a "
                         f"tagger's words, not pairs encoded separately)")
    placeholder = _zero_placeholders(model) if shift else None
    head = task.cfg.classification_head_name
    task.load_dataset(subset)
    limit = task.max_positions()  # fairseq refuses a longer sentence, naming it; a shifted one needs room
    batches = task.get_batch_iterator(task.dataset(subset), max_sentences=batch_size,
                                      max_positions=limit - shift if limit else None).next_epoch_itr(shuffle=False)
    correct = total = 0
    spans = [0, 0, 0]
    scheme = getattr(task.cfg, "tag_scheme", "none")
    with torch.no_grad():
        for sample in batches:
            net_input = shifted(sample["net_input"], placeholder, shift) if shift else sample["net_input"]
            logits, _ = model(**net_input, classification_head_name=head)
            target = sample["target"]
            if not tagging:
                target = target.view(-1)
                correct += int(logits.argmax(-1).eq(target).sum())
                total += target.numel()
                continue
            words = target.ne(IGNORE)
            predicted = model.classification_heads[head].predict_tags(logits[:, : target.size(1)], words)
            correct += int((predicted.eq(target) & words).sum())
            total += int(words.sum())
            if scheme != "none":
                gold = [task.tag_strings(t[w].tolist()) for t, w in zip(target, words)]
                pred = [task.tag_strings(p[w].tolist()) for p, w in zip(predicted, words)]
                spans = [a + b for a, b in zip(spans, span_counts(gold, pred, scheme))]
    if total == 0:
        raise ValueError(f"{subset} of {data} is empty")
    result = {"accuracy": 100.0 * correct / total}
    if tagging and scheme != "none":
        true, pred, gold = spans
        result.update(f1=f1(true, pred, gold), precision=100.0 * true / max(pred, 1),
                      recall=100.0 * true / max(gold, 1))
    return result


def summarize(per_run: List[Dict[str, float]]) -> Dict[str, float]:
    """Mean of every metric over the runs, and its sample standard deviation (``<metric>_std``)."""
    out = {}
    for metric in per_run[0]:
        values = [r[metric] for r in per_run]
        out[metric] = statistics.fmean(values)
        out[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return out


def evaluate(cfg, data: Path, checkpoints: List[Path], subset: str, results_dir: Path) -> dict:
    """Score each run's checkpoint and write ``results/<table>/<row>.json`` (mean, deviation, runs)."""
    options = dict(cfg.get("evaluate") or {})
    unknown = set(options) - set(EVALUATE_OPTIONS)
    if unknown:
        raise ValueError(f"{cfg['name']}: evaluate: {sorted(unknown)} are not options of the classification "
                         f"evaluation ({', '.join(EVALUATE_OPTIONS)})")
    shift = int(options.get("shift", 0))
    per_run = [score_checkpoint(c, data, subset, shift=shift) for c in checkpoints]
    summary = summarize(per_run)
    where = f"{cfg['data']} {subset} from {data}"
    if shift:
        where += f", shifted by {shift} zero-embedding placeholders"
    result = {"config": cfg["name"], "table": cfg["table"], "row": cfg["row"], "column": cfg["column"],
              "subset": subset, "test_set": where, "runs": [{"checkpoint": str(c), **r} for c, r in
                                                              zip(checkpoints, per_run)], **summary}
    for metric in per_run[0]:  # what results_table prints beside the number
        spread = f", standard deviation {summary[metric + '_std']:.2f}" if len(per_run) > 1 else ""
        result[f"{metric}_signature"] = f"mean of {len(per_run)} run(s){spread}"
    out = results_dir / f"{cfg['name']}.json"  # results/<table>/<row id>.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{cfg['name']} on {where}: " + ", ".join(
        f"{m} {summary[m]:.2f}" + (f" ± {summary[m + '_std']:.2f}" if len(per_run) > 1 else "")
        for m in per_run[0]), flush=True)
    return result
