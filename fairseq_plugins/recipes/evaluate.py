"""Translate a test set with fairseq-generate, detokenize, and score with sacrebleu's Python API
(language models: ``evaluate_lm``, bits per character or perplexity from fairseq-eval-lm).

    fairseq-plugins-evaluate configs/bpt/table7_bpt_k4.yaml        # averages, generates, scores
    fairseq-plugins-evaluate CONFIG --checkpoint path/to/checkpoint.pt

Two scores, each printed and saved with its sacrebleu signature and the test set it is on:

- ``sacrebleu``: detokenized hypotheses (sacremoses) against the untokenized references that
  ``fairseq-plugins-prepare-data`` kept (``{subset}.raw.{tgt}``: for WMT, the text of sacrebleu's own test
  set), with the tokenizer the config names (``sacrebleu_tokenize``: BPT Table 7 ``intl``;
  default ``13a``, ``zh`` for a Chinese target); the reportable number.
- ``tokenized``: Moses-tokenized hypotheses against the tokenized references with
  ``tokenize="none"``, i.e. multi-bleu.perl's number. Hyphens are split (``@-@``), which
  is the compound splitting of the usual WMT14 En-De tokenized BLEU.

Lower-cased corpora (IWSLT14) are scored lower-cased. Document-level configs also record which
target context the translations were made with (``--target-context``). Results go to
``results/<config name>.json``.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from ..command_line import command_parser
from . import evaluate_classification
from .config import generate_flags, load_config, run_key, seed_configs, target_context
from .data.text_processing import unsegment_chinese
from .train import default_data_dir, local_devices


def read_hypotheses(generate_out: str) -> Dict[int, str]:
    """Sentence id -> hypothesis (after --remove-bpe) from fairseq-generate's ``D-`` lines."""
    hyps = {}
    for line in generate_out.splitlines():
        if line.startswith("D-"):
            sid, _score, *text = line.split("\t")
            hyps[int(sid[2:])] = text[0] if text else ""
    return hyps


def detokenize(lines: List[str], lang: str) -> List[str]:
    """Moses detokenization; Chinese also loses the spaces its word segmentation put in."""
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    out = [detok.detokenize(line.split()) for line in lines]
    return [unsegment_chinese(line) for line in out] if lang == "zh" else out


def default_tokenize(target_lang: str) -> str:
    """sacrebleu's tokenizer for detokenized text in ``target_lang`` when a config names none."""
    return "zh" if target_lang == "zh" else "13a"


def bleu(hypotheses: List[str], references: List[str], tokenize: str, lowercase: bool) -> dict:
    """Corpus BLEU through sacrebleu's Python API: {"score", "signature"}."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize=tokenize, lowercase=lowercase)
    result = metric.corpus_score(hypotheses, [references])
    return {"score": result.score, "signature": str(metric.get_signature())}


def score(generate_out: str, data: Path, subset: str, out_dir: Path, tokenize: Optional[str] = None) -> dict:
    """Score fairseq-generate output against the references prepared beside ``data``."""
    meta = json.loads((data / "prep.json").read_text())
    tgt, lowercase = meta["target_lang"], meta["lowercase"]
    raw_ref = data / f"{subset}.raw.{tgt}"
    tok_ref_bpe = data / "text" / f"{subset}.{tgt}"
    references = raw_ref.read_text(encoding="utf-8").splitlines()
    hyps = read_hypotheses(generate_out)
    if sorted(hyps) != list(range(len(references))):
        raise ValueError(f"fairseq-generate produced {len(hyps)} hypotheses for {len(references)} "
                         f"references of {subset}; ids must be 0..{len(references) - 1}")
    tokenized = [hyps[i] for i in range(len(references))]
    detokenized = detokenize(tokenized, tgt)
    ref_tok = [line.replace("@@ ", "").removesuffix("@@")
               for line in tok_ref_bpe.read_text(encoding="utf-8").splitlines()]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, lines in (("hyp.tok", tokenized), ("hyp.detok", detokenized), ("ref.tok", ref_tok)):
        (out_dir / f"{subset}.{name}.{tgt}").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    detok = bleu(detokenized, references, tokenize or default_tokenize(tgt), lowercase)
    tok = bleu(tokenized, ref_tok, "none", lowercase)
    prepared = f"{meta['corpus']} {subset} (prepared by fairseq-plugins-prepare-data)"
    test_set = meta.get("origins", {}).get(subset, prepared)
    trained = {"training_pairs": meta["sentences"]["train"], "paper_training_pairs": meta["paper_training_pairs"]} \
        if "paper_training_pairs" in meta else {}
    return {"sentences": len(references), "test_set": test_set, **trained,
            "sacrebleu": detok["score"], "sacrebleu_signature": detok["signature"],
            "tokenized": tok["score"], "tokenized_signature": tok["signature"]}


def checkpoint_for(cfg, run_dir: Path) -> Path:
    """The averaged checkpoint of the config (made once), or checkpoint_best.pt."""
    n = cfg["average_last"]
    if n == 0:
        return run_dir / "checkpoint_best.pt"
    averaged = run_dir / f"checkpoint_avg{n}.pt"
    if not averaged.exists():
        import torch  # here: the dry runs of the table scripts need no torch

        from .average_checkpoints import average, last_checkpoints

        paths = last_checkpoints(run_dir, n)
        print("averaging " + ", ".join(p.name for p in paths), flush=True)
        torch.save(average(paths), averaged)
    return averaged


def generate(cfg, data: Path, checkpoint: Path, subset: str, cpu: bool, extra: List[str] = ()) -> str:
    exe = shutil.which("fairseq-generate")
    if exe is None:
        raise RuntimeError("fairseq-generate not found on PATH: install fairseq with fairseq-plugins-install-fairseq")
    cmd = [exe, str(data), "--path", str(checkpoint), "--gen-subset", subset, "--remove-bpe",
           *generate_flags(cfg), *(["--cpu"] if cpu else []), *extra]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-generate failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def evaluate(cfg, data: Path, checkpoint: Path, subset: str, results_dir: Path, extra: List[str] = ()) -> dict:
    if cfg["task"].get("task") == "language_modeling":
        from . import evaluate_lm

        return evaluate_lm.evaluate(cfg, data, checkpoint, subset, results_dir, extra, cpu=local_devices() == 0)
    if cfg["task"].get("task") in evaluate_classification.TASKS:  # every seed's run of the same checkpoint name
        runs = [checkpoint.parent.parent / run_key(c) / checkpoint.name for c in seed_configs(cfg)]
        return evaluate_classification.evaluate(cfg, data, runs if cfg.get("seeds") else [checkpoint], subset,
                                                results_dir)
    out = generate(cfg, data, checkpoint, subset, cpu=local_devices() == 0, extra=extra)
    work = results_dir / cfg["name"]
    work.mkdir(parents=True, exist_ok=True)
    (work / f"generate-{subset}.txt").write_text(out, encoding="utf-8")
    result = {"config": cfg["name"], "table": cfg["table"], "row": cfg["row"], "column": cfg["column"],
              "run": checkpoint.parent.name, "checkpoint": str(checkpoint), "subset": subset,
              "target_context": target_context(cfg, extra),
              **score(out, data, subset, work, cfg.get("sacrebleu_tokenize"))}
    (results_dir / f"{cfg['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
    context = f"; target context: {result['target_context']}" if result["target_context"] else ""
    print(f"{cfg['name']} on {result['test_set']}{context}\n"
          f"  SacreBLEU {result['sacrebleu']:.2f}  {result['sacrebleu_signature']}\n"
          f"  tokenized BLEU {result['tokenized']:.2f}  {result['tokenized_signature']}", flush=True)
    return result


def main(argv=None) -> dict:
    from .train import split_passthrough

    ours, extra = split_passthrough(argv)
    p = command_parser(description=__doc__)
    p.add_argument("config", type=Path, help="the experiment's YAML (configs/<paper>/<row>.yaml)")
    p.add_argument("--data", type=Path, help="data-bin directory (default: data-bin/<corpus>)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where the runs were trained (default: runs)")
    p.add_argument("--checkpoint", type=Path, help="default: the run's averaged (or best) checkpoint")
    p.add_argument("--subset", default="test", help="the data-bin split to translate (default: test)")
    p.add_argument("--results-dir", type=Path, default=Path("results"),
                   help="where the scores' JSON goes (default: results)")
    args = p.parse_args(ours)
    cfg = load_config(args.config)
    data = args.data or default_data_dir(cfg)
    checkpoint = args.checkpoint or checkpoint_for(cfg, args.runs_dir / run_key(seed_configs(cfg)[-1]))
    if not checkpoint.exists():
        sys.exit(f"{checkpoint} does not exist: train first (fairseq-plugins-train {args.config})")
    return evaluate(cfg, data, checkpoint, args.subset, args.results_dir, extra)


if __name__ == "__main__":
    main()
