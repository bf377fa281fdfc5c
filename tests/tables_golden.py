"""Every table row's resolved experiment, normalised, for the golden-resolution test.

    python -m tests.tables_golden --write            # rewrite tests/fixtures/tables/resolved.json
    python -m tests.tables_golden --diff [TABLE...]  # the rows that resolve differently, and how

What a row resolves to: the fairseq-train flags at the paper's GPU count, the run it trains in,
its seeds, and the flags of its evaluation (fairseq-generate for translation, fairseq-eval-lm for
language models, the in-process scorer's options for classifiers and taggers, the measurement's
settings for a computed table: the only entry of a measured figure's point), with the
checkpoint averaging and the sacrebleu tokenizer. Flags are kept as a sorted mapping, so an
equivalent reordering of a config is not a change; any value that changes is.
"""

import json
import sys
from pathlib import Path

from fairseq_plugins.recipes.config import (
    FIGURES,
    USER_DIR,
    all_configs,
    generate_flags,
    run_key,
    seed_configs,
    train_flags,
)
from fairseq_plugins.recipes.evaluate_lm import eval_lm_flags

GOLDEN = Path(__file__).parent / "fixtures" / "tables" / "resolved.json"


def flag_map(flags):
    """['--a', '1', '--b', '--c', 'x y'] -> {'--a': '1', '--b': True, '--c': 'x y'}, user dir normalised."""
    out, key = {}, None
    for token in flags:
        if token.startswith("--"):
            key = token
            out[key] = True
        elif key is not None:
            out[key] = "<user-dir>" if token == str(USER_DIR) else token
            key = None
        else:
            raise ValueError(f"value {token!r} without a flag in {flags}")
    return dict(sorted(out.items()))


def evaluation(cfg):
    if cfg.get("measure"):  # a computed table (TranSFormer's Table 8): what is measured, and how
        return {"measure": cfg["measure"], "settings": dict(sorted(cfg["evaluate"].items()))}
    task = cfg["task"].get("task")
    if task == "language_modeling":
        return {"fairseq-eval-lm": flag_map(eval_lm_flags(cfg, cfg["evaluate"].get("subset", "test")))}
    if task in ("sentence_prediction", "sequence_tagging"):
        return {"scorer": dict(sorted(cfg["evaluate"].items()))}
    return {"fairseq-generate": flag_map(generate_flags(cfg)), "sacrebleu_tokenize": cfg.get("sacrebleu_tokenize")}


def resolve_all(configs=None):
    rows = {}
    for cfg in all_configs() if configs is None else configs:
        key = f"{cfg['table']} | {cfg['row']} | {cfg['column']}"
        if cfg["measure"] in FIGURES:  # a figure's point: no fairseq run, the figure's model by name
            rows[key] = {"reported": cfg["reported"], "evaluate": evaluation(cfg)}
            continue
        runs = seed_configs(cfg)
        rows[key] = {
            "data": cfg["data"], "gpus": cfg["gpus"], "reported": cfg["reported"],
            "train": flag_map(train_flags(runs[-1], cfg["gpus"])),
            "runs": [run_key(run) for run in runs],
            "average_last": cfg["average_last"], "evaluate": evaluation(cfg),
        }
    return dict(sorted(rows.items()))


def diff(tables):
    """Print every row of ``tables`` (all when empty) that resolves differently from the golden file."""
    from fairseq_plugins.recipes.config import load_table

    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    configs = [c for t in tables for c in load_table(t)["configs"]] if tables else None
    resolved = json.loads(json.dumps(resolve_all(configs)))
    prefixes = tuple(f"{c['table']} | " for c in configs) if configs else ("",)
    for key in sorted(set(golden) | set(resolved)):
        if not key.startswith(prefixes) or golden.get(key) == resolved.get(key):
            continue
        old, new = golden.get(key, {}), resolved.get(key, {})
        print(key)
        for field in sorted(set(old) | set(new)):
            if old.get(field) != new.get(field):
                print(f"  {field}: {old.get(field)} -> {new.get(field)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        GOLDEN.write_text(json.dumps(resolve_all(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {GOLDEN}")
    elif sys.argv[1:2] == ["--diff"]:
        diff(sys.argv[2:])
    else:
        sys.exit("usage: python -m tests.tables_golden --write | --diff [TABLE...]")
