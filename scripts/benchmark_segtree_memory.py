"""SegTree Figure 2: peak memory of one training step against sequence length, SegTree-Transformer
(``segtree_lm``) and the Transformer of the same size (``transformer_lm_matched``), measured in
the same run.

    python -m scripts.benchmark_segtree_memory                          # the paper's two settings
    python -m scripts.benchmark_segtree_memory --settings 1 --lengths 64 128 256 512

Settings (SegTree paper, Appendix A.3, Table 4): 1: 6 layers, d 320, FFN 1024, vocabulary
28,913, batch 16; 2: 12 layers, d 768, FFN 3072, vocabulary 30,522, batch 8; fp32 both. The
paper gives neither the heads (8 and 12 here: SegTree's code uses 8 at d 320, and 12 is
BERT-base's at d 768, whose vocabulary setting 2 has) nor the lengths of its figure (powers of
two here, ``--lengths``).

One step is forward, cross-entropy and backward of a batch of random tokens (dropout 0), after a
warm-up step (graphs are built and cached once per length). Its peak is the most memory the
step allocates beyond what was allocated before it (parameters; the gradients are freed first,
so they count): on CUDA ``torch.cuda.max_memory_allocated``; on CPU the CPU allocator's own
allocation and free events, recorded by ``torch.profiler`` with ``profile_memory=True`` and
summed in order (``peak_allocated_bytes``). The Markdown, JSON and PNG go to ``benchmarks/``;
ratios are against the Transformer at the same length and setting.
"""

import argparse
import json
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch.profiler import ProfilerActivity, profile

from fairseq_plugins.command_line import import_extra
from scripts.benchmark_graph_attention import machine_line

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.benchmark_segtree_memory"
# SegTree Appendix A.3, Table 4 (heads: see the module docstring)
SETTINGS = {
    1: {"layers": 6, "vocab": 28913, "dim": 320, "ffn": 1024, "batch": 16, "heads": 8},
    2: {"layers": 12, "vocab": 30522, "dim": 768, "ffn": 3072, "batch": 8, "heads": 12},
}
MODELS = {"Transformer": "transformer_lm_matched", "SegTree-Transformer": "segtree_lm"}
BASELINE = "Transformer"


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


def measure(setting_id: int, length: int, device: torch.device) -> List[dict]:
    setting = SETTINGS[setting_id]
    rows = []
    for name, arch in MODELS.items():
        model, dictionary = build_lm(arch, setting, length, device)
        step = training_step(model, len(dictionary), setting["batch"], length, device)
        step()  # warm-up: graph caches, allocator pools
        model.zero_grad(set_to_none=True)
        peak = peak_allocated_bytes(step, device)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append({"setting": setting_id, "length": length, "model": name, "peak_step_bytes": peak,
                     "parameter_bytes": params})
        print(f"setting {setting_id} n {length} {name}: step peak {peak / 2**20:.1f} MiB, "
              f"parameters {params / 2**20:.1f} MiB", flush=True)
        del model, step
    base = next(r for r in rows if r["model"] == BASELINE)["peak_step_bytes"]
    for row in rows:
        row["ratio"] = row["peak_step_bytes"] / base
    return rows


def write_outputs(out: Path, device: torch.device, rows: List[dict]) -> None:
    where = "CUDA allocator (torch.cuda.max_memory_allocated)" if device.type == "cuda" else \
        "CPU allocator events (torch.profiler, profile_memory=True)"
    setup = f"{machine_line(COMMAND).rstrip('.')}; device {device}; {where}"
    lines = [f"# SegTree Figure 2: peak memory of one training step ({device.type.upper()})\n",
             f"{setup}.\n",
             "Forward, cross-entropy and backward, fp32, dropout 0, after a warm-up step; the peak is what the step "
             "allocates beyond the parameters (gradients included). Settings: SegTree Appendix A.3 Table 4.\n",
             "| setting | n | model | step peak MiB | / Transformer | parameters MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['length']} | {r['model']} | {r['peak_step_bytes'] / 2**20:.1f} | "
                     f"{r['ratio']:.3f} | {r['parameter_bytes'] / 2**20:.1f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "settings": SETTINGS, "rows": rows}, indent=1)
                                        + "\n", encoding="utf-8")

    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows})
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4), squeeze=False)
    for ax, setting_id in zip(axes[0], settings):
        for name in MODELS:
            sel = [r for r in rows if r["setting"] == setting_id and r["model"] == name]
            ax.plot([r["length"] for r in sel], [r["peak_step_bytes"] / 2**20 for r in sel], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(f"peak {device.type.upper()} memory of a step (MiB)")
        ax.set_title(f"Setting {setting_id}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SegTree Figure 2 ({device.type.upper()}): memory vs. sequence length", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')}, .json and .png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", type=int, nargs="+", choices=sorted(SETTINGS), default=sorted(SETTINGS),
                   help="the paper's settings to measure (Appendix A.3 Table 4)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                   help="sequence lengths (the paper's figure does not list them)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None,
                   help="output prefix (default benchmarks/segtree_memory_<device type>)")
    args = p.parse_args(argv)
    if min(args.lengths) < 2:
        p.error("--lengths must be at least 2")
    device = torch.device(args.device)
    rows = [row for s in args.settings for n in args.lengths for row in measure(s, n, device)]
    write_outputs(args.out or REPO / "benchmarks" / f"segtree_memory_{device.type}", device, rows)
    return rows


if __name__ == "__main__":
    main()
