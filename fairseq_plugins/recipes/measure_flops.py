"""FLOPs of a table row's model, counted in-process (TranSFormer's Table 8), for tables with
``measure: flops``: nothing is trained; each row's model is built from its config and one
forward pass of one sentence pair is counted with ``torch.utils.flop_counter.FlopCounterMode``.

The row's ``evaluate`` section describes the sentence (``source-length`` subwords in,
``target-length`` subwords out with teacher forcing, each source subword a word of
``letters-per-subword`` letters, so the fast branch reads ``letters-per-subword + 1``
characters per subword with the word-end "_") and the vocabulary (``dictionary-size``
symbols, the output layer's size); ``part`` says whether the number is the whole model's
(default), the encoder's or the decoder's (the others are in the row's note).

torch counts 2 FLOPs per multiply-add of the matrix products (linear layers, attention's
batched products, convolutions); element-wise work (softmax, norms, activations) and
embedding look-ups count nothing. Only the forward pass is counted (``backward: true`` adds
the backward pass of the summed logits).
"""

import argparse
import inspect
import json
from pathlib import Path
from typing import Dict, List

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

from .config import ConfigError, to_flags

SETTINGS = ("source-length", "target-length", "letters-per-subword", "dictionary-size", "part", "backward")
PARTS = ("model", "encoder", "decoder")  # what the table's number counts
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# torch's counter has formulas for the GPU kernels of scaled_dot_product_attention, not for the CPU
# one that fairseq's self-attention reaches on CPU (it would count 0): the same formulas, so that a
# count is the same on either device
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: inspect.unwrap(flop_counter.sdpa_flop),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        inspect.unwrap(flop_counter.sdpa_backward_flop),
}


def synthetic_dictionary(size: int, letters_per_subword: int) -> Dictionary:
    """``size`` symbols (fairseq's 4 specials included), each a distinct whole word of
    ``letters_per_subword`` letters."""
    d = Dictionary()
    n = size - len(d)
    if n < 1 or len(LETTERS) ** letters_per_subword < n:
        raise ConfigError(f"dictionary-size {size} does not fit words of {letters_per_subword} letters")
    for i in range(n):
        word = ""
        for _ in range(letters_per_subword):
            i, r = divmod(i, len(LETTERS))
            word += LETTERS[r]
        d.add_symbol(word)
    return d


def build_model(cfg: Dict, dictionary: Dictionary) -> torch.nn.Module:
    """The row's model (its ``arch`` and ``model`` options) over ``dictionary`` on both sides."""
    import fairseq_plugins.models  # noqa: F401  (registers the plugin, as --user-dir would)

    model_cls = ARCH_MODEL_REGISTRY[cfg["arch"]]
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    model_cls.add_args(parser)
    args = parser.parse_args(to_flags(cfg["model"]))
    args.arch = cfg["arch"]
    ARCH_CONFIG_REGISTRY[cfg["arch"]](args)
    task = argparse.Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return model_cls.build_model(args, task)


def settings(cfg: Dict) -> Dict:
    missing = [k for k in SETTINGS[:4] if k not in cfg["evaluate"]]
    unknown = set(cfg["evaluate"]) - set(SETTINGS)
    if missing or unknown:
        raise ConfigError(f"{cfg['name']}: a FLOPs row's evaluate section needs {', '.join(SETTINGS[:4])} "
                          f"(and may set part, backward); missing {missing}, unknown {sorted(unknown)}")
    s = {"part": "model", "backward": False, **cfg["evaluate"]}
    if s["part"] not in PARTS:
        raise ConfigError(f"{cfg['name']}: part {s['part']!r} is not one of {PARTS}")
    return s


def count_flops(model: torch.nn.Module, dictionary: Dictionary, source_length: int, target_length: int,
                backward: bool = False) -> Dict[str, int]:
    """FLOPs of one forward pass (and backward, if asked) of one sentence pair: of the whole
    model, the encoder and the decoder (keys ``model``, ``encoder``, ``decoder``)."""
    first = dictionary.nspecial
    src = torch.arange(first, first + source_length - 1) % (len(dictionary) - first) + first
    src_tokens = torch.cat([src, torch.tensor([dictionary.eos()])]).unsqueeze(0)
    prev = torch.arange(first, first + target_length - 1) % (len(dictionary) - first) + first
    prev_output_tokens = torch.cat([torch.tensor([dictionary.eos()]), prev]).unsqueeze(0)
    model.eval()
    with torch.set_grad_enabled(backward), FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        logits = model(src_tokens, torch.tensor([source_length]), prev_output_tokens)[0]
        if backward:
            logits.sum().backward()
    by_module = counter.get_flop_counts()
    root = type(model).__name__
    return {
        "model": counter.get_total_flops(),
        "encoder": sum(by_module.get(f"{root}.encoder", {}).values()),
        "decoder": sum(by_module.get(f"{root}.decoder", {}).values()),
    }


def measure_row(cfg: Dict) -> Dict:
    """The row's results JSON: GFLOPs (the table's metric) and how they were counted."""
    s = settings(cfg)
    dictionary = synthetic_dictionary(s["dictionary-size"], s["letters-per-subword"])
    torch.manual_seed(1)
    model = build_model(cfg, dictionary)
    flops = count_flops(model, dictionary, s["source-length"], s["target-length"], s["backward"])
    passes = "forward and backward" if s["backward"] else "forward"
    giga = {part: flops[part] / 1e9 for part in PARTS}
    return {
        "gflops": giga[s["part"]],
        "part": s["part"],
        **{f"{part}_gflops": giga[part] for part in PARTS},
        "parameters": sum(p.numel() for p in model.parameters()),
        "measured_on": (f"{s['part']}, {passes} of one pair, {s['source-length']} -> {s['target-length']} subwords "
                        f"({s['letters-per-subword']} letters each), {s['dictionary-size']} types; torch "
                        f"FlopCounterMode, 2 per multiply-add; " + ", ".join(f"{p} {giga[p]:.2f}G" for p in PARTS)),
    }


def plan(cfg: Dict, results_dir: Path) -> str:
    s = settings(cfg)
    return (f"  measured in-process: {'forward and backward' if s['backward'] else 'forward'} FLOPs ({s['part']}) of "
            f"{cfg['arch']} {' '.join(to_flags(cfg['model']))} on {s['source-length']} -> {s['target-length']} "
            f"subwords    # -> {results_dir / cfg['name']}.json")


def measure(configs: List[Dict], results_dir: Path, dry_run: bool) -> None:
    """Each row's results JSON, skipping rows already measured."""
    for cfg in configs:
        print(plan(cfg, results_dir), flush=True)
        out = results_dir / f"{cfg['name']}.json"
        if dry_run or out.exists():
            continue
        result = measure_row(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"  {cfg['name']}: {result['gflops']:.2f} GFLOPs ({result['measured_on']})", flush=True)
