"""What a fairseq-train log says about a run: its parameter count and its speed.

fairseq prints ``num. model params: N`` once, a ``train_inner`` progress line every
``--log-interval`` updates (``wps=`` training target words, or tokens, per second) and a
``train`` summary per epoch; the demo, the language-model study and the model benchmark all
read their speeds from these lines, so they read them here.
"""

import re
from typing import List, Tuple

_PARAMS = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
_INNER = re.compile(r"\| train_inner \|.*\bwps=([\d.]+).*\bnum_updates=(\d+)")
_EPOCH = re.compile(r"\| train \|.*\| wps ([\d.]+) .*\| num_updates (\d+)")


def model_params(log: str) -> int:
    """The model's parameter count; ValueError when the log has none."""
    params = _PARAMS.search(log)
    if params is None:
        raise ValueError("no 'num. model params' line in the fairseq-train log")
    return int(params.group(1).replace(",", ""))


def progress(log: str) -> List[Tuple[float, int]]:
    """(words per second, updates so far) of every progress line, in order."""
    return [(float(wps), int(updates)) for wps, updates in _INNER.findall(log)]


def epoch_summaries(log: str) -> List[Tuple[float, int]]:
    """(words per second, updates so far) of every epoch's summary line, in order."""
    return [(float(wps), int(updates)) for wps, updates in _EPOCH.findall(log)]
