"""Score a language model with fairseq-eval-lm as the papers report it.

``fairseq-eval-lm`` prints the mean loss per token in base 2 over the subset's tokens, every
line's ``</s>`` included (``Loss (base 2): ...``). That is the result's unit:

* enwik8, text8, text: bits per character (``bpc``); a token is a byte (enwik8) or a
  character (text8), the newline one of them, and ``</s>`` ends a document only
  (``fairseq_plugins.recipes.data.language_modeling``), so the mean is over the split's
  characters (the test split: plus the corpus's final ``</s>``). A data-bin of the earlier
  format (the newline as ``</s>``) is refused with the reason.
* PTB, WikiText-2: perplexity (``ppl`` = 2 ** loss) over words and ``</s>``.

Evaluation context: the config's ``evaluate:`` section holds fairseq-eval-lm's flags. With
``tokens-per-sample: l`` and no ``context-window`` the subset is cut into non-overlapping blocks
of l tokens, each scored from its own start (the original BPT code's ``eval_length = length``;
the SegTree paper's equal-length sequences); ``context-window: c`` scores blocks of l - c new
tokens, each after the c tokens before it (the sliding window of Transformer-XL and Adaptive
Span; c = l - 1 is one token at a time). ``subset: valid`` scores the dev split (a table's dev
column).
"""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from .config import USER_DIR, to_flags
from .data.language_modeling import CORPORA, check_format
from .tools import Tools

_LOSS = re.compile(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)")
_TOKENS = re.compile(r"Evaluated ([0-9,]+) tokens in ([0-9.]+)s")
_SKIPPED = re.compile(r"([0-9]+) samples have invalid sizes and will be skipped, max_positions=([0-9]+)")


def metric_of(cfg) -> str:
    if cfg["data"] not in CORPORA:
        raise ValueError(f"{cfg['name']}: data {cfg['data']!r} is not a language-modelling corpus "
                         f"({', '.join(CORPORA)})")
    return CORPORA[cfg["data"]].metric


def eval_lm_flags(cfg, subset: str) -> List[str]:
    options = {k: v for k, v in cfg["evaluate"].items() if k != "subset"}
    return ["--user-dir", str(USER_DIR), "--gen-subset", subset, *to_flags(cfg["task"]), *to_flags(options)]


def parse(output: str) -> dict:
    """The loss, token count and speed; a loss over only part of the subset (fairseq-eval-lm
    skips the blocks longer than the model's positions and reports a loss of 0 over 0 tokens)
    is refused, naming the blocks skipped and the model's maximum."""
    loss, tokens, skipped = _LOSS.search(output), _TOKENS.search(output), _SKIPPED.search(output)
    if skipped is not None:
        raise ValueError(f"fairseq-eval-lm skipped {skipped.group(1)} blocks longer than the model's "
                         f"{skipped.group(2)} positions, so its loss is not the subset's: evaluate with "
                         f"tokens-per-sample <= {skipped.group(2)}")
    if loss is None or tokens is None:
        raise ValueError(f"no loss line in fairseq-eval-lm's output:\n{output[-3000:]}")
    count = int(tokens.group(1).replace(",", ""))
    if count == 0:
        raise ValueError("fairseq-eval-lm scored 0 tokens: the subset is empty")
    return {"loss_base2": float(loss.group(1)), "tokens": count,
            "tokens_per_second": count / max(float(tokens.group(2)), 1e-9)}


def eval_lm_command(cfg, data: Path, checkpoint: Path, subset: str, cpu: bool = False, extra: List[str] = (),
                    tools: Optional[Tools] = None) -> List[str]:
    """The fairseq-eval-lm command that scores a row (the row's ``evaluate: {subset}`` wins over ``subset``)."""
    subset = cfg["evaluate"].get("subset", subset)
    return [(tools or Tools())("fairseq-eval-lm"), str(data), "--path", str(checkpoint), *eval_lm_flags(cfg, subset),
            *(["--cpu"] if cpu else []), *extra]


def evaluate(cfg, data: Path, checkpoint: Path, subset: str, results_dir: Path, extra: List[str] = (),
             cpu: bool = False) -> dict:
    cmd = eval_lm_command(cfg, data, checkpoint, subset, cpu, extra)
    subset = cfg["evaluate"].get("subset", subset)
    metric = metric_of(cfg)
    check_format(data)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-eval-lm failed:\n{proc.stderr[-4000:]}")
    scores = parse(proc.stdout + proc.stderr)
    value = scores["loss_base2"] if metric == "bpc" else 2 ** scores["loss_base2"]
    length = cfg["evaluate"].get("tokens-per-sample", cfg["task"].get("tokens-per-sample"))
    window = cfg["evaluate"].get("context-window", 0)
    signature = (f"fairseq-eval-lm, {scores['tokens']:,} tokens ({CORPORA[cfg['data']].unit}, </s> counted), "
                 f"blocks of {length}" + (f", {window} tokens of context" if window else ", non-overlapping"))
    result = {"config": cfg["name"], "table": cfg["table"], "row": cfg["row"], "column": cfg["column"],
              "run": checkpoint.parent.name, "checkpoint": str(checkpoint), "data": str(data), "subset": subset,
              "test_set": f"{cfg['data']} {subset}", metric: value, f"{metric}_signature": signature, **scores}
    out = results_dir / f"{cfg['name']}.json"  # results/<table>/<row id>.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{cfg['name']} on {result['test_set']}: {metric} {value:.4f}  ({signature})", flush=True)
    return result
