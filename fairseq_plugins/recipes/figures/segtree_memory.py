"""SegTree Figure 2: peak memory of one training step against sequence length, SegTree-Transformer
(``segtree_lm``) and the Transformer of the same size (``transformer_lm_matched``).

Settings (SegTree paper, Appendix A.3, Table 4): 1: 6 layers, d 320, FFN 1024, vocabulary
28,913, batch 16; 2: 12 layers, d 768, FFN 3072, vocabulary 30,522, batch 8; fp32 both. The
paper gives neither the heads (8 and 12 here: SegTree's code uses 8 at d 320, and 12 is
BERT-base's at d 768, whose vocabulary setting 2 has) nor the lengths of its figure.

One step is forward, cross-entropy and backward of a batch of random tokens (dropout 0), after a
warm-up step (graphs are built and cached once per length). Its peak is the most memory the
step allocates beyond what was allocated before it (parameters; the gradients are freed first,
so they count): on CUDA ``torch.cuda.max_memory_allocated``; on CPU the CPU allocator's own
allocation and free events, recorded by ``torch.profiler`` with ``profile_memory=True`` and
summed in order (``peak_allocated_bytes``).

A row of a ``measure: peak-memory`` table sets ``evaluate: {model, setting, length}``.
"""

import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from . import row_settings

# SegTree Appendix A.3, Table 4 (heads: see the module docstring)
SETTINGS = {
    1: {"layers": 6, "vocab": 28913, "dim": 320, "ffn": 1024, "batch": 16, "heads": 8},
    2: {"layers": 12, "vocab": 30522, "dim": 768, "ffn": 3072, "batch": 8, "heads": 12},
}
MODELS = {"Transformer": "transformer_lm_matched", "SegTree-Transformer": "segtree_lm"}
BASELINE = "Transformer"
KEYS = {"model": str, "setting": int, "length": int}  # a table row's evaluate section


def peak_allocated_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The most memory allocated during ``step()`` beyond what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def allocator(device: torch.device) -> str:
    """Whose peak ``peak_allocated_bytes`` reads on ``device``."""
    if device.type == "cuda":
        return "CUDA allocator (torch.cuda.max_memory_allocated)"
    return "CPU allocator events (torch.profiler, profile_memory=True)"


def build_lm(arch: str, setting: Dict[str, int], length: int, device: torch.device):
    """``arch`` at ``setting``'s sizes over a vocabulary of ``setting['vocab']`` symbols."""
    import fairseq_plugins.models  # noqa: F401 (registers the plugin's models)
    from fairseq import options, tasks

    dim = str(setting["dim"])
    with tempfile.TemporaryDirectory() as data:  # the task reads only its dictionary
        (Path(data) / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(setting["vocab"] - 4)))
        parsed = options.parse_args_and_arch(options.get_training_parser(), [
            data, "--task", "language_modeling", "--arch", arch, "--tokens-per-sample", str(length),
            "--decoder-layers", str(setting["layers"]), "--decoder-embed-dim", dim, "--decoder-input-dim", dim,
            "--decoder-output-dim", dim, "--decoder-ffn-embed-dim", str(setting["ffn"]),
            "--decoder-attention-heads", str(setting["heads"]), "--share-decoder-input-output-embed",
            "--dropout", "0", "--attention-dropout", "0"])
        task = tasks.setup_task(parsed)
    torch.manual_seed(0)
    return task.build_model(parsed).to(device), task.source_dictionary


def training_step(model, vocab: int, batch: int, length: int, device: torch.device) -> Callable[[], None]:
    """Forward, cross-entropy and backward of ``batch`` random sequences of ``length`` tokens."""
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(4, vocab, (batch, length + 1), generator=gen).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])[0]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()

    return step


def measure_model(name: str, setting_id: int, length: int, device: torch.device) -> Dict:
    """The step peak and the parameters' bytes of the figure's model ``name`` at one point."""
    setting = SETTINGS[setting_id]
    model, dictionary = build_lm(MODELS[name], setting, length, device)
    step = training_step(model, len(dictionary), setting["batch"], length, device)
    step()  # warm-up: graph caches, allocator pools
    model.zero_grad(set_to_none=True)
    peak = peak_allocated_bytes(step, device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"setting {setting_id} n {length} {name}: step peak {peak / 2**20:.1f} MiB, "
          f"parameters {params / 2**20:.1f} MiB", flush=True)
    return {"setting": setting_id, "length": length, "model": name, "peak_step_bytes": peak,
            "parameter_bytes": params}


def compare(setting_id: int, length: int, device: torch.device) -> List[Dict]:
    """Every model at one point, each with its ratio to the Transformer's peak."""
    rows = [measure_model(name, setting_id, length, device) for name in MODELS]
    base = next(r for r in rows if r["model"] == BASELINE)["peak_step_bytes"]
    for row in rows:
        row["ratio"] = row["peak_step_bytes"] / base
    return rows


def settings(cfg: Dict) -> Dict:
    return row_settings(cfg, KEYS, {"model": tuple(MODELS), "setting": tuple(SETTINGS)})


def plan(s: Dict) -> str:
    sizes = ", ".join(f"{k} {v}" for k, v in SETTINGS[s["setting"]].items())
    return (f"peak memory of one training step (forward, cross-entropy, backward, fp32) of {s['model']} "
            f"({MODELS[s['model']]}), setting {s['setting']} ({sizes}), {s['length']} tokens")


def measure(todo: List[Tuple[Dict, Dict]], device: torch.device) -> Iterator[Tuple[Dict, Dict]]:
    """(row, results JSON) of each row: the step's peak in MiB (the table's metric)."""
    for cfg, s in todo:
        row = measure_model(s["model"], s["setting"], s["length"], device)
        yield cfg, {"peak_mib": row["peak_step_bytes"] / 2**20, **row, "device": str(device),
                    "measured_on": f"{plan(s)}; {allocator(device)}; parameters "
                                   f"{row['parameter_bytes'] / 2**20:.1f} MiB"}
