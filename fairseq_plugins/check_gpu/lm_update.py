"""One training update of the language models at long contexts: ``bpt_lm`` against
``transformer_lm`` of the same size, on one device.

    python -m fairseq_plugins.check_gpu.lm_update --out lm.json [--contexts 1024 8192] [--ks 4 64]

The workload BPT was built for (paper section 4.2: character-level language modelling at a
context of up to 8,192). Every batch holds ``--tokens`` tokens (``--tokens / context``
sequences of random bytes); one update is forward, cross-entropy, backward and an Adam step.
At each context the models alternate, one warm-up update each, then the median of
``--updates``; the ratio of tokens per second to ``transformer_lm``'s (fairseq's attention with
its dense causal mask), time per token against the shortest context, and the peak memory
(on a GPU: the allocator's peak during the updates). A model that fails (out of memory at a
long context, say) is reported with its error and the others go on. ``build_lm`` and
``lm_update_step`` are also what ``scripts/benchmark_lm.py`` times on the CPU.
"""

import argparse
import json
import statistics
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from fairseq_plugins.check_gpu.model_update import alternate_updates
from fairseq_plugins.check_gpu.runner import PROGRESS
from fairseq_plugins.command_line import command_parser

VOCAB = 256  # bytes
BASELINE = "transformer_lm"
AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lm_specs(ks: Sequence[int], checkpointed_ks: Sequence[int] = (),
             recomputed_ks: Sequence[int] = ()) -> Dict[str, tuple]:
    """name -> (arch, options); ``checkpointed_ks``: BPT also with ``--checkpoint-activations``
    (each layer's activations recomputed in the backward: memory for time); ``recomputed_ks``:
    BPT also with ``--graph-recompute-norms-ffn`` (the layer norms and the FFN's hidden states
    recomputed), alone and with ``--checkpoint-activations`` (the least memory)."""
    specs = {BASELINE: ("transformer_lm", ["--decoder-normalize-before"])}
    specs.update({f"bpt_lm k{k}": ("bpt_lm", ["--graph-k", str(k)]) for k in ks})
    checkpoint, recompute = "--checkpoint-activations", "--graph-recompute-norms-ffn"
    variants = [(checkpointed_ks, "checkpointed", [checkpoint]),
                (recomputed_ks, "recompute-norms-ffn", [recompute]),
                (recomputed_ks, "checkpointed + recompute-norms-ffn", [checkpoint, recompute])]
    for variant_ks, label, options in variants:
        specs.update({f"bpt_lm k{k} {label}": ("bpt_lm", ["--graph-k", str(k), *options]) for k in variant_ks})
    return specs


def build_lm(arch: str, options: Sequence[str], layers: int, dim: int, heads: int, context: int,
             backend: str = "auto"):
    """``arch`` for ``--task language_modeling`` over a byte dictionary, ``layers`` x d ``dim``
    (FFN 4 d), no dropout, BPT on ``backend``."""
    import fairseq_plugins.models  # noqa: F401 (registers the plugin's models)
    from fairseq import options as fairseq_options, tasks

    data = Path(tempfile.mkdtemp())
    (data / "dict.txt").write_text("".join(f"{b} 1\n" for b in range(VOCAB)))
    graph = ["--graph-attention-backend", backend] if arch == "bpt_lm" else []
    parsed = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), [
        str(data), "--task", "language_modeling", "--arch", arch, "--tokens-per-sample", str(context),
        "--decoder-layers", str(layers), "--decoder-embed-dim", str(dim), "--decoder-input-dim", str(dim),
        "--decoder-output-dim", str(dim), "--decoder-ffn-embed-dim", str(4 * dim),
        "--decoder-attention-heads", str(heads), "--dropout", "0", *graph, *options])
    task = tasks.setup_task(parsed)
    torch.manual_seed(0)
    return task.build_model(parsed)


def lm_update_step(model, tokens: int, context: int, autocast_dtype=None) -> Callable[[], None]:
    """One update's closure over a fixed batch of random bytes on the model's device."""
    device = next(model.parameters()).device
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(context)
    batch = torch.randint(4, 4 + VOCAB, (max(1, tokens // context), context + 1), generator=gen).to(device)

    def step():
        model.train()
        optimizer.zero_grad()
        with torch.autocast(device.type, autocast_dtype) if autocast_dtype else nullcontext():
            logits, _ = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                     batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
    return step


def run(args) -> Dict:
    device = torch.device(args.device)
    specs = lm_specs(args.ks, args.checkpointed_ks, args.recomputed_ks)
    autocast_dtype = AUTOCAST[args.dtype]
    results = {name: {} for name in specs}
    for context in args.contexts:
        steps = {}
        for name, (arch, options) in specs.items():
            try:
                model = build_lm(arch, options, args.layers, args.dim, args.heads, context, args.backend)
                steps[name] = lm_update_step(model.to(device), args.tokens, context, autocast_dtype)
            except Exception as error:  # reported; the other models go on
                results[name][str(context)] = {"status": f"{type(error).__name__}: {str(error)[:300]}"}
        times, peaks, errors = alternate_updates(steps, args.updates, device)
        for name, error in errors.items():
            results[name][str(context)] = {"status": error}
        for name in (n for n in steps if n not in errors):
            seconds = statistics.median(times[name])
            results[name][str(context)] = {
                "status": "ok", "seconds": seconds, "all_seconds": times[name],
                "tokens_per_second": max(1, args.tokens // context) * context / seconds,
                **({"peak_mib": peaks[name]} if device.type == "cuda" else {})}
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{PROGRESS} context {context} of {args.contexts} done", flush=True)
    return {"settings": {key: value for key, value in vars(args).items() if key != "out"}, "results": results}


def markdown(result: Dict) -> str:
    s = result["settings"]
    lines = [f"{s['layers']} layers, d {s['dim']}, {s['heads']} heads, {s['tokens']} tokens per batch, "
             f"{s['dtype']}{' autocast' if s['dtype'] != 'float32' else ''}, BPT backend {s['backend']}; one "
             f"update (forward, backward, Adam) per model in alternation, median of {s['updates']} after "
             "one warm-up.", "",
             f"| model | context | s / update | tokens / s | vs {BASELINE} | time per token vs shortest context "
             f"| peak MiB | vs {BASELINE} | status |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = result["results"].get(BASELINE, {})
    for name, by_context in result["results"].items():
        first = next((r for r in by_context.values() if r["status"] == "ok"), None)
        for context in map(str, s["contexts"]):
            r, b = by_context.get(context, {"status": "not run"}), base.get(context, {})
            if r["status"] != "ok":
                lines.append(f"| {name} | {context} | - | - | - | - | - | - | {r['status'].replace('|', '/')} |")
                continue
            ok = b.get("status") == "ok"
            ratio = f"{r['tokens_per_second'] / b['tokens_per_second']:.2f}x" if ok else "-"
            peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
            peak_ratio = f"{r['peak_mib'] / b['peak_mib']:.2f}x" if ok and "peak_mib" in r else "-"
            lines.append(f"| {name} | {context} | {r['seconds']:.4f} | {r['tokens_per_second']:.0f} | {ratio} | "
                         f"{first['tokens_per_second'] / r['tokens_per_second']:.2f} | {peak} | {peak_ratio} | ok |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True,
                   help="JSON file of the results")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                   help="context lengths to measure (default: %(default)s)")
    p.add_argument("--ks", type=int, nargs="+", default=[4, 16, 64],
                   help="BPT's k values (default: %(default)s)")
    p.add_argument("--checkpointed-ks", type=int, nargs="*", default=[4],
                   help="k values also measured with --checkpoint-activations (default: %(default)s)")
    p.add_argument("--recomputed-ks", type=int, nargs="*", default=[4],
                   help="k values also measured with the norms and FFN recomputed (default: %(default)s)")
    p.add_argument("--layers", type=int, default=12, help="BPT Table 9's enwik8 model: 12 layers, d 512, 8 heads")
    p.add_argument("--dim", type=int, default=512,
                   help="embedding dimension (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch, every context")
    p.add_argument("--dtype", choices=list(AUTOCAST), default="bfloat16",
                   help="float32, or mixed precision (autocast) in bfloat16 / float16")
    p.add_argument("--backend", default="auto", help="--graph-attention-backend of bpt_lm")
    p.add_argument("--device", default="cuda",
                   help="torch device (default: %(default)s)")
    p.add_argument("--updates", type=int, default=5,
                   help="timed updates per model and context (default: %(default)s)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.tokens < max(args.contexts):
        raise SystemExit("lm_update: --tokens must hold at least one sequence of the longest context")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0 if all(r["status"] == "ok" for by in result["results"].values() for r in by.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
