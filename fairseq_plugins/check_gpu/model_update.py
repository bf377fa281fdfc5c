"""One training update of each model against the transformer's, on one device.

    python -m fairseq_plugins.check_gpu.model_update --out models.json [--size base]

Every model of the plugin and fairseq's transformer are built at the same size (pre-norm,
the demo's model options) and trained on the same synthetic batch (``--tokens`` source tokens
in sentences of ``--length``), one update (forward, backward, Adam step) at a time, the
models in alternation; prints and writes each model's median time per update, its ratio to
the transformer's and its peak memory. A model that fails is reported with its error, and
the others go on. ``build_model`` and ``train_step`` are also what ``scripts/benchmark_*``
time on the CPU.
"""

import argparse
import functools
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from fairseq_plugins.check_gpu.runner import PROGRESS
from fairseq_plugins.command_line import command_parser

MODELS = {  # name: (arch, options), with the demo's options
    "transformer": ("transformer", {}),
    "bpt": ("bpt_transformer", dict(graph_k=4, graph_rel_clip=3)),
    "segtree": ("segtree_transformer", {}),
    "transformer_slowfast": ("transformer_slowfast", dict(fast_embed_dim=32, fast_ffn_embed_dim=128)),
    "ms_transformer": ("ms_transformer", dict(encoder_scale_alpha=0.5)),
}
SIZES = {
    "base": dict(encoder_embed_dim=512, encoder_ffn_embed_dim=2048, encoder_attention_heads=8, encoder_layers=6),
    "tiny": dict(encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=2, encoder_layers=1),
}
AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register_models() -> None:
    import fairseq_plugins.models.bpt_transformer  # noqa: F401 (each registers its model)
    import fairseq_plugins.models.ms_transformer  # noqa: F401
    import fairseq_plugins.models.segtree_transformer  # noqa: F401
    import fairseq_plugins.models.transformer_slowfast  # noqa: F401


def build_model(arch: str, options: dict, size: dict, dicts):
    """``arch`` with fairseq's defaults, then ``size`` (encoder and decoder alike) and
    ``options``, pre-norm; ``dicts``: {"en": source, "de": target} dictionaries."""
    register_models()
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    args = parser.parse_args([])
    decoder = {k.replace("encoder", "decoder"): v for k, v in size.items()}
    for k, v in {**size, **decoder, **options, "max_source_positions": 1024, "max_target_positions": 1024}.items():
        setattr(args, k, v)
    # the same pre-norm layout for the baseline as for TranSFormer
    args.encoder_normalize_before = args.decoder_normalize_before = True
    ARCH_CONFIG_REGISTRY[arch](args)
    task = argparse.Namespace(source_dictionary=dicts["en"], target_dictionary=dicts["de"])
    torch.manual_seed(0)
    return ARCH_MODEL_REGISTRY[arch].build_model(args, task)


def train_step(model, optimizer, batch, pad, autocast_dtype=None):
    optimizer.zero_grad()
    device = batch["src_tokens"].device.type
    with torch.autocast(device, autocast_dtype) if autocast_dtype else nullcontext():
        logits, _ = model(batch["src_tokens"], batch["src_lengths"], batch["prev_output_tokens"])
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), batch["target"],
                                                 ignore_index=pad)
    loss.backward()
    optimizer.step()


def synthetic_batch(vocab: int, tokens: int, length: int, device):
    """Dictionaries of ``vocab`` words and sentences of ``length`` random words (both sides)."""
    from fairseq.data import Dictionary

    dicts = {}
    for lang in ("en", "de"):
        d = Dictionary()
        for i in range(vocab):
            d.add_symbol(f"{lang}{i}")
        d.finalize()
        dicts[lang] = d
    gen = torch.Generator().manual_seed(0)
    sentences = max(1, tokens // length)

    def words(d):
        body = torch.randint(d.nspecial, len(d), (sentences, length - 1), generator=gen)
        return torch.cat([body, torch.full((sentences, 1), d.eos())], 1)

    source, target = words(dicts["en"]), words(dicts["de"])
    previous = torch.cat([target[:, -1:], target[:, :-1]], 1)  # eos moved to the front
    batch = dict(src_tokens=source, src_lengths=torch.full((sentences,), length),
                 prev_output_tokens=previous, target=target)
    return dicts, {key: value.to(device) for key, value in batch.items()}


def alternate_updates(steps: Dict[str, Callable[[], None]], updates: int, device: torch.device,
                      after_update: Callable[[int], None] = lambda update: None
                      ) -> Tuple[Dict[str, List[float]], Dict[str, float], Dict[str, str]]:
    """Runs every step ``updates + 1`` times, the steps alternating within each round; the first
    round warms up (kernels compile, graphs are built) and is not timed. Returns each step's
    timed seconds, its peak allocated MiB (on a GPU; else 0) and, for a step that raised (out of
    memory, say), its error: that step is dropped and the others go on."""
    times = {name: [] for name in steps}
    peaks = {name: 0.0 for name in steps}
    errors, live = {}, dict(steps)
    for update in range(updates + 1):
        for name, step in list(live.items()):
            try:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**20)
                if update:
                    times[name].append(time.perf_counter() - start)
            except Exception as error:  # reported; the other steps go on
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                del live[name]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        after_update(update)
    return times, peaks, errors


def run(args) -> Dict:
    device = torch.device(args.device)
    dicts, batch = synthetic_batch(args.vocab, args.tokens, args.length, device)
    pad = dicts["de"].pad()
    autocast_dtype = AUTOCAST[args.dtype]
    models, optimizers, results = {}, {}, {}
    for name in args.models:
        arch, options = MODELS[name]
        try:
            models[name] = build_model(arch, options, SIZES[args.size], dicts).to(device)
            optimizers[name] = torch.optim.Adam(models[name].parameters(), lr=1e-4)
        except Exception as error:  # a model that cannot be built is reported, the others run
            results[name] = {"status": f"{type(error).__name__}: {error}"}
    steps = {name: functools.partial(train_step, models[name], optimizers[name], batch, pad, autocast_dtype)
             for name in models}
    times, peaks, errors = alternate_updates(
        steps, args.updates, device,
        lambda update: print(f"{PROGRESS} update {update}/{args.updates} of every model done", flush=True))
    results.update({name: {"status": error} for name, error in errors.items()})
    models = {name: model for name, model in models.items() if name not in errors}
    base = statistics.median(times["transformer"]) if times.get("transformer") else None
    for name in models:
        seconds = statistics.median(times[name])
        results[name] = {"status": "ok", "seconds_per_update": seconds,
                         "seconds_each_update": times[name],
                         "vs_transformer": seconds / base if base else None}
        if device.type == "cuda":
            results[name]["peak_mib"] = peaks[name]
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    settings.update(sentences=int(batch["src_tokens"].size(0)), **SIZES[args.size])
    return {"settings": settings, "results": results}


def markdown(result: Dict) -> str:
    s = result["settings"]
    lines = [f"{s['size']} size ({s['encoder_layers']}+{s['encoder_layers']} layers, d "
             f"{s['encoder_embed_dim']}), {s['sentences']} sentences of {s['length']} tokens, "
             f"{s['dtype']}{' autocast' if s['dtype'] != 'float32' else ''}, one update (forward, "
             f"backward, Adam) per model in alternation, median of {s['updates']} after one warm-up.",
             "", "| model | s / update | x transformer | peak MiB | status |", "|---|---|---|---|---|"]
    for name, r in result["results"].items():
        seconds = f"{r['seconds_per_update']:.4f}" if "seconds_per_update" in r else "-"
        ratio = f"{r['vs_transformer']:.2f}x" if r.get("vs_transformer") else "-"
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
        lines.append(f"| {name} | {seconds} | {ratio} | {peak} | {r['status'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True,
                   help="JSON file of the results")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="models to measure (default: all)")
    p.add_argument("--size", choices=sorted(SIZES), default="base",
                   help="model size (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8192, help="source tokens per batch")
    p.add_argument("--length", type=int, default=64, help="tokens per sentence")
    p.add_argument("--vocab", type=int, default=8000,
                   help="vocabulary of the synthetic batch (default: %(default)s)")
    p.add_argument("--dtype", choices=list(AUTOCAST), default="bfloat16",
                   help="float32, or mixed precision (autocast) in bfloat16 / float16")
    p.add_argument("--device", default="cuda",
                   help="torch device (default: %(default)s)")
    p.add_argument("--updates", type=int, default=5,
                   help="timed updates per model (default: %(default)s)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if "transformer" not in args.models:
        raise SystemExit("model_update: the transformer is the baseline: keep it in --models")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0 if all(r["status"] == "ok" for r in result["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
