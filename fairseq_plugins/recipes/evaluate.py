"""Translate a test set with fairseq-generate, detokenize, and score with sacrebleu's Python API
(language models: ``evaluate_lm``, bits per character or perplexity from fairseq-eval-lm).

    fairseq-plugins-evaluate bpt-table7:bpt-k4                    # averages, generates, scores
    fairseq-plugins-evaluate ROW --checkpoint path/to/checkpoint.pt   # exactly that checkpoint
    fairseq-plugins-evaluate bpt-table1:bpt-sst5 --checkpoint s1.pt ... --checkpoint s10.pt   # their mean

Without ``--checkpoint`` the row's runs are found under ``--runs-dir`` by their run keys (one per
seed for a row with ``seeds``), and the averaged (``average_last``) or best checkpoint of each is scored.

Two scores, each printed and saved with its sacrebleu signature and the test set it is on:

- ``sacrebleu``: detokenized hypotheses (sacremoses) against the untokenized references that
  ``fairseq-plugins-prepare-data`` kept (``{subset}.raw.{tgt}``: for WMT, the text of sacrebleu's own test
  set), with the tokenizer the config names (``sacrebleu_tokenize``: BPT Table 7 ``intl``;
  default ``13a``, ``zh`` for a Chinese target); the reportable number.
- ``tokenized``: Moses-tokenized hypotheses against the tokenized references with
  ``tokenize="none"``, i.e. multi-bleu.perl's number. Hyphens are split (``@-@``), which
  is the compound splitting of the usual WMT14 En-De tokenized BLEU.

Lower-cased corpora (IWSLT14) are scored lower-cased. Document-level rows also record which
target context the translations were made with (``--target-context``). Results go to
``results/<table>/<row id>.json`` and name the data folder that was scored.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from ..command_line import command_parser
from . import evaluate_classification
from .config import ConfigError, generate_flags, load_config, run_key, seed_configs, target_context
from .data.sentencepiece_segmentation import SENTENCEPIECE_WORD_START
from .data.text_processing import unsegment_chinese
from .tools import MissingTool, Tools
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
    if not references:
        raise ConfigError(f"{raw_ref} holds no sentence: BLEU over nothing is no score (prepare the data again)")
    hyps = read_hypotheses(generate_out)
    if sorted(hyps) != list(range(len(references))):
        raise ValueError(f"fairseq-generate produced {len(hyps)} hypotheses for {len(references)} "
                         f"references of {subset}; ids must be 0..{len(references) - 1}")
    tokenized = [hyps[i] for i in range(len(references))]
    detokenized = detokenize(tokenized, tgt)
    ref_tok = [join_subwords(line, meta.get("bpe", "subword-nmt"))
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


def checkpoint_path(cfg, run_dir: Path) -> Path:
    """The checkpoint a row scores in its run: the average of the last ``average_last``, or the best."""
    n = cfg["average_last"]
    return run_dir / (f"checkpoint_avg{n}.pt" if n else "checkpoint_best.pt")


def average_command(cfg, run_dir: Path) -> List[str]:
    """The command that makes the row's averaged checkpoint ([] when it scores checkpoint_best.pt)."""
    n = cfg["average_last"]
    return ["fairseq-plugins-average-checkpoints", str(run_dir), "--last", str(n), "--output",
            str(checkpoint_path(cfg, run_dir))] if n else []


def checkpoint_for(cfg, run_dir: Path) -> Path:
    """The row's checkpoint in its run, averaged first (once) when the row averages."""
    averaged = checkpoint_path(cfg, run_dir)
    if cfg["average_last"] and not averaged.exists():
        import torch  # here: the dry runs of the table scripts need no torch

        from .average_checkpoints import average, last_checkpoints

        paths = last_checkpoints(run_dir, cfg["average_last"])
        print("averaging " + ", ".join(p.name for p in paths), flush=True)
        torch.save(average(paths), averaged)
    return averaged


def row_checkpoints(cfg, runs_dir: Path, given: List[Path]) -> List[Path]:
    """What a row scores: the checkpoints given, exactly (classifiers and taggers: one or more, e.g. one
    per seed, scored as their mean; the other tasks: one), else its runs' under ``runs_dir`` by run key
    (every seed's for classifiers and taggers, the last seed's for the other tasks)."""
    runs = seed_configs(cfg)
    every_seed = cfg["task"].get("task") in evaluate_classification.TASKS
    if given:
        if len(given) > 1 and not every_seed:
            raise ConfigError(f"{cfg['name']} scores one checkpoint, got --checkpoint {len(given)} times")
        return list(given)
    return [checkpoint_path(run, runs_dir / run_key(run)) for run in (runs if every_seed else runs[-1:])]


def trained_checkpoints(cfg, runs_dir: Path) -> List[Path]:
    """The row's checkpoints in its runs under ``runs_dir``, averaged first where the row averages
    (a run folder that does not exist is left as its path, for the caller to name)."""
    return [checkpoint_for(cfg, c.parent) if c.parent.is_dir() else c for c in row_checkpoints(cfg, runs_dir, [])]


def check_checkpoint(cfg, checkpoint: Path) -> None:
    """Refuse a checkpoint that is not the row's model: another architecture, or another number of
    classes (a classifier scored against the wrong label set reads as a low accuracy, not an error)."""
    import torch

    def field(section, name):  # fairseq saves a section as a dict, a DictConfig or (legacy models) a Namespace
        return section.get(name) if hasattr(section, "get") else getattr(section, name, None)

    state = torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)
    saved = state.get("cfg") or {}
    model, task = field(saved, "model") or {}, field(saved, "task") or {}
    arch = field(model, "arch") or field(model, "_name") or getattr(state.get("args"), "arch", None)
    if arch is not None and arch != cfg["arch"]:
        raise ConfigError(f"{checkpoint} is a {arch} model; {cfg['table']}:{cfg['id']} scores {cfg['arch']}")
    wanted, classes = cfg["task"].get("num-classes"), field(task, "num_classes")
    if wanted is not None and classes not in (None, wanted):
        raise ConfigError(f"{checkpoint} was trained with {classes} classes; {cfg['table']}:{cfg['id']} has {wanted}")


def generate_command(cfg, data: Path, checkpoint: Path, subset: str, cpu: bool, extra: List[str] = (),
                     tools: Optional[Tools] = None) -> List[str]:
    return [(tools or Tools())("fairseq-generate"), str(data), "--path", str(checkpoint), "--gen-subset", subset,
            *remove_bpe_flags(data), *generate_flags(cfg), *(["--cpu"] if cpu else []), *extra]


def segmentation(data: Path) -> str:
    """How the data-bin's text is segmented (prep.json's ``bpe``; subword-nmt before it is prepared)."""
    prep = data / "prep.json"
    return json.loads(prep.read_text()).get("bpe", "subword-nmt") if prep.exists() else "subword-nmt"


def remove_bpe_flags(data: Path) -> List[str]:
    """fairseq-generate's flags that join the data-bin's subwords back into tokens."""
    return ["--remove-bpe", "sentencepiece"] if segmentation(data) == "sentencepiece" else ["--remove-bpe"]


def join_subwords(line: str, segmented_by: str) -> str:
    """A reference line of the data-bin's text, its subwords joined as ``--remove-bpe`` joins them."""
    if segmented_by == "sentencepiece":
        return line.replace(" ", "").replace(SENTENCEPIECE_WORD_START, " ").strip()
    return line.replace("@@ ", "").removesuffix("@@")


def generate(cfg, data: Path, checkpoint: Path, subset: str, cpu: bool, extra: List[str] = ()) -> str:
    cmd = generate_command(cfg, data, checkpoint, subset, cpu, extra)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-generate failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def evaluate(cfg, data: Path, checkpoints: List[Path], subset: str, results_dir: Path, extra: List[str] = ()) -> dict:
    """Score a row's checkpoints (``row_checkpoints``) and write ``results/<table>/<row id>.json``."""
    for checkpoint in checkpoints:
        check_checkpoint(cfg, checkpoint)
    if cfg["task"].get("task") in evaluate_classification.TASKS:
        return evaluate_classification.evaluate(cfg, data, checkpoints, subset, results_dir)
    (checkpoint,) = checkpoints
    if cfg["task"].get("task") == "language_modeling":
        from . import evaluate_lm

        return evaluate_lm.evaluate(cfg, data, checkpoint, subset, results_dir, extra, cpu=local_devices() == 0)
    out = generate(cfg, data, checkpoint, subset, cpu=local_devices() == 0, extra=extra)
    work = results_dir / cfg["name"]
    work.mkdir(parents=True, exist_ok=True)
    (work / f"generate-{subset}.txt").write_text(out, encoding="utf-8")
    result = {"config": cfg["name"], "table": cfg["table"], "row": cfg["row"], "column": cfg["column"],
              "run": checkpoint.parent.name, "checkpoint": str(checkpoint), "data": str(data), "subset": subset,
              "target_context": target_context(cfg, extra),
              **score(out, data, subset, work, cfg.get("sacrebleu_tokenize"))}
    out_json = results_dir / f"{cfg['name']}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    context = f"; target context: {result['target_context']}" if result["target_context"] else ""
    print(f"{cfg['name']} on {result['test_set']}{context}\n"
          f"  SacreBLEU {result['sacrebleu']:.2f}  {result['sacrebleu_signature']}\n"
          f"  tokenized BLEU {result['tokenized']:.2f}  {result['tokenized_signature']}", flush=True)
    return result


def main(argv=None) -> dict:
    from .train import split_passthrough

    ours, extra = split_passthrough(argv)
    p = command_parser(description=__doc__)
    p.add_argument("config", metavar="ROW", help="TABLE:ROW_ID, e.g. bpt-table7:bpt-k4 (TABLE: an id or a table file)")
    p.add_argument("--data", type=Path, help="data-bin directory (default: data-bin/<corpus>)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="where the row's runs are, by run key (when no --checkpoint is given)")
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="the checkpoint to score, used as given (classifiers and taggers: repeat it to score "
                        "the mean of several, e.g. one per seed)")
    p.add_argument("--subset", default="test", help="the split to score")
    p.add_argument("--results-dir", type=Path, default=Path("results"), help="results/<table>/<row id>.json")
    args = p.parse_args(ours)
    try:
        cfg = load_config(args.config)
        given = row_checkpoints(cfg, args.runs_dir, args.checkpoint) if args.checkpoint else \
            trained_checkpoints(cfg, args.runs_dir)
        data = args.data or default_data_dir(cfg)
        missing = [str(c) for c in given if not c.exists()]
        if missing:
            raise ConfigError(f"{', '.join(missing)} does not exist: train first (fairseq-plugins-train {args.config})")
        return evaluate(cfg, data, given, args.subset, args.results_dir, extra)
    except (ConfigError, MissingTool) as err:
        sys.exit(f"fairseq-plugins-evaluate: {err}")


if __name__ == "__main__":
    main()
