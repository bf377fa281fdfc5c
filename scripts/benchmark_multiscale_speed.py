"""Multi-Scale Figure 4: test time per batch of 128 sentences, Multi-Scale Transformer against
the Transformer (and a BiLSTM), at the sentence lengths of IMDB, MR and the MTL-16 average,
measured in the same run.

    python -m scripts.benchmark_multiscale_speed
    python -m scripts.benchmark_multiscale_speed --repeats 3 --lengths AVG=109

The models, the lengths (IMDB 201, MR 21, AVG 109 tokens) and the timing are
``fairseq_plugins.recipes.figures.multiscale_speed``'s (also the rows of
``fairseq-plugins-reproduce ms-figure4``); ``--lengths NAME=N`` replaces the lengths. Ratios are
against the Transformer of the same run.
"""

import argparse
import json
from pathlib import Path
from typing import List

import torch

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.recipes.figures.multiscale_speed import BASELINE, BATCH, DATASETS, build_models, test_batch_seconds
from scripts.benchmark_graph_attention import machine_line

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.benchmark_multiscale_speed"


def write_outputs(out: Path, setup: str, rows: List[dict]) -> None:
    lines = [f"# Multi-Scale Figure 4: test time per batch of {BATCH}\n", f"{setup}.\n",
             "| dataset | tokens | model | ms per batch | / Transformer |", "|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['length']} | {r['model']} | {1000 * r['seconds']:.1f} | {r['ratio']:.2f} |"
              for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "batch": BATCH, "rows": rows}, indent=1) + "\n",
                                        encoding="utf-8")

    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(models)
    for i, name in enumerate(models):
        ms = [1000 * next(r["seconds"] for r in rows if r["dataset"] == d and r["model"] == name) for d in datasets]
        ax.bar([j + i * width for j in range(len(datasets))], ms, width, label=name)
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(datasets))])
    ax.set_xticklabels([f"{d} ({next(r['length'] for r in rows if r['dataset'] == d)})" for d in datasets])
    ax.set_ylabel(f"ms per test batch of {BATCH}")
    ax.set_title("Multi-Scale Figure 4 (" + setup.split("; ")[1] + ")", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')}, .json and .png")


def parse_length(text: str):
    name, _, value = text.partition("=")
    if not name or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=TOKENS with TOKENS >= 1, got {text!r}")
    return name, int(value)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=parse_length, nargs="+", default=list(DATASETS.items()),
                   help="NAME=TOKENS per dataset (default: IMDB=201 MR=21 AVG=109)")
    p.add_argument("--repeats", type=int, default=5, help="timed batches per model and length (median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None,
                   help="output prefix (default benchmarks/multiscale_speed_<device type>)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    device = torch.device(args.device)
    models = build_models(device)
    rows = []
    for dataset, length in args.lengths:
        seconds = test_batch_seconds(models, length, args.repeats, device)
        for name, s in seconds.items():
            rows.append({"dataset": dataset, "length": length, "model": name, "seconds": s,
                         "ratio": s / seconds[BASELINE]})
            print(f"{dataset} ({length} tokens) {name}: {1000 * s:.1f} ms per batch, "
                  f"{s / seconds[BASELINE]:.2f} x the Transformer", flush=True)
    setup = f"{machine_line(COMMAND).rstrip('.')}; device {device.type.upper()}; fp32, median of {args.repeats}"
    write_outputs(args.out or REPO / "benchmarks" / f"multiscale_speed_{device.type}", setup, rows)
    return rows


if __name__ == "__main__":
    main()
