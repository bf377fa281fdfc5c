"""TranSFormer's cost against the stock transformer of the same (slow) size, in one run.

    python -m scripts.benchmark_slowfast                      # base sizes (512/2048, 6+6 layers)
    python -m scripts.benchmark_slowfast --size tiny --updates 3

Measures, on real Multi30K En-De batches (word-level source vocabulary, so every word
is one subword): training time per update (forward, backward, Adam step; median over
``--updates``, models interleaved so that load on a shared machine hits all alike) and
forward FLOPs per sentence counted by ``torch.utils.flop_counter.FlopCounterMode``.
Prints ratios against the ``transformer`` measured in the same run (the paper: about
+15% training time, 1.1G -> 1.4G FLOPs for base) and writes them as JSON.
"""

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fairseq_plugins.check_gpu.model_update import build_model, train_step
from fairseq_plugins.recipes.data import multi30k
from fairseq_plugins.recipes.data.download import locate
from fairseq_plugins.recipes.data.readers import read_plain

REPO = Path(__file__).resolve().parents[1]
TOKEN = re.compile(r"\w+|[^\w\s]")

SIZES = {
    "base": dict(encoder_embed_dim=512, encoder_ffn_embed_dim=2048, encoder_attention_heads=8, encoder_layers=6),
    "tiny": dict(encoder_embed_dim=64, encoder_ffn_embed_dim=128, encoder_attention_heads=4, encoder_layers=2),
}
MODELS = {
    "transformer": ("transformer", {}),
    "slow-only": ("transformer_slowfast", dict(no_fast_branch=True)),
    "transformer_slowfast": ("transformer_slowfast", {}),
}


def read_training_text(raw_dir: Optional[Path]) -> Dict[str, List[str]]:
    """Multi30K's training text per language, word-tokenized (``raw_dir``: a local copy, else
    downloaded once into the cache, as the demo does)."""
    files = locate(multi30k.FILES, raw_dir)
    return {lang: [" ".join(TOKEN.findall(line)) for line in read_plain(files[f"train.{lang}"])]
            for lang in ("en", "de")}


def build_batch(max_tokens: int, raw_dir: Optional[Path] = None):
    """Dictionaries and one left-padded batch of about ``max_tokens`` source tokens."""
    from fairseq.data import Dictionary, data_utils

    text = read_training_text(raw_dir)
    en, de = text["en"], text["de"]
    dicts = {}
    for lang, lines in (("en", en), ("de", de)):
        d = Dictionary()
        for line in lines:
            for w in line.split():
                d.add_symbol(w)
        d.finalize()
        dicts[lang] = d
    src, tgt, tokens = [], [], 0
    for s, t in zip(en, de):
        if tokens + len(s.split()) + 1 > max_tokens:
            break
        src.append(dicts["en"].encode_line(s, add_if_not_exist=False).long())
        tgt.append(dicts["de"].encode_line(t, add_if_not_exist=False).long())
        tokens += len(src[-1])
    pad_en, pad_de, eos = dicts["en"].pad(), dicts["de"].pad(), dicts["de"].eos()
    batch = dict(
        src_tokens=data_utils.collate_tokens(src, pad_en, left_pad=True),
        src_lengths=torch.tensor([len(s) for s in src]),
        prev_output_tokens=data_utils.collate_tokens(tgt, pad_de, eos, move_eos_to_beginning=True),
        target=data_utils.collate_tokens(tgt, pad_de),
    )
    return dicts, batch


def forward_flops(model, batch) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from fairseq_plugins.recipes.measure_flops import CPU_ATTENTION  # self-attention's CPU kernel counted too

    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        model(batch["src_tokens"], batch["src_lengths"], batch["prev_output_tokens"])
    model.train()
    return counter.get_total_flops()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="base")
    p.add_argument("--max-tokens", type=int, default=2048, help="source tokens per batch")
    p.add_argument("--updates", type=int, default=5, help="timed updates per model (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "slowfast.json")
    p.add_argument("--raw-dir", type=Path, help="local Multi30K raw files (default: download once into the cache)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    dicts, batch = build_batch(args.max_tokens, args.raw_dir)
    sentences = batch["src_tokens"].size(0)
    pad = dicts["de"].pad()
    models = {name: build_model(arch, opts, SIZES[args.size], dicts) for name, (arch, opts) in MODELS.items()}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4, betas=(0.9, 0.997)) for name, m in models.items()}
    print(f"{sentences} sentences, {int(batch['src_lengths'].sum())} source tokens per batch, "
          f"{args.size} sizes, {args.threads} thread(s)", file=sys.stderr)  # fmt: skip

    times = {name: [] for name in models}
    for step in range(args.updates + 1):
        for name, model in models.items():
            start = time.perf_counter()
            train_step(model, optimizers[name], batch, pad)
            if step:  # step 0 warms up
                times[name].append(time.perf_counter() - start)
        print(f"update {step}/{args.updates} done", file=sys.stderr)

    results = {}
    for name, model in models.items():
        results[name] = dict(
            params=sum(q.numel() for q in model.parameters()),
            seconds_per_update=statistics.median(times[name]),
            seconds_each_update=times[name],  # the spread shows how noisy the machine was
            gflops_per_sentence=forward_flops(model, batch) / sentences / 1e9,
        )
    base = results["transformer"]
    print(f"{'model':22} {'params':>11} {'s/update':>9} {'x time':>7} {'GFLOPs/sent':>12} {'x FLOPs':>8}")
    for name, r in results.items():
        r["time_ratio"] = r["seconds_per_update"] / base["seconds_per_update"]
        r["flops_ratio"] = r["gflops_per_sentence"] / base["gflops_per_sentence"]
        print(f"{name:22} {r['params']:>11,} {r['seconds_per_update']:>9.3f} {r['time_ratio']:>7.3f} "
              f"{r['gflops_per_sentence']:>12.4f} {r['flops_ratio']:>8.3f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(size=args.size, sentences=sentences, source_tokens=int(batch["src_lengths"].sum()),
                threads=args.threads, updates=args.updates, torch=torch.__version__)  # fmt: skip
    args.out.write_text(json.dumps(dict(meta=meta, results=results), indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
