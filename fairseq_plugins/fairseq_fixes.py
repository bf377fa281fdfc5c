"""Named, idempotent fixes that make fairseq 0.12.2 run on Python >= 3.11 and torch >= 2.6.

fairseq 0.12.2 (2022) is the newest release on PyPI and is broken on today's stack
(see REFERENCE.md section 1). Each fix below edits the installed fairseq at the narrowest
point that removes one breakage on the translation path, and says why it exists.
The edits are plain text replacements: a fix is "applied" when its new text is in place,
"missing" when the original text is found, and anything else means a fairseq source we do
not know, which we refuse to touch.

    python -m fairseq_plugins.fairseq_fixes check   # report; exit 1 if a fix is missing
    python -m fairseq_plugins.fairseq_fixes apply   # apply what is missing; safe to repeat

This module must not import fairseq: before the fixes, ``import fairseq`` raises.
"""

import argparse
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

SUPPORTED_FAIRSEQ_VERSION = "0.12.2"

APPLIED, MISSING = "applied", "missing"


class FairseqFixError(RuntimeError):
    """The installed fairseq is absent, of another version, or its sources are unknown."""


@dataclass(frozen=True)
class TextEdit:
    """Replace ``old`` by ``new`` in one file (relative to a root the fix chooses)."""

    path: str
    old: str
    new: str

    def __post_init__(self):
        # Status detection relies on the new text not containing the old one.
        assert self.old not in self.new, self


@dataclass(frozen=True)
class Fix:
    name: str
    why: str
    edits: Tuple[TextEdit, ...]
    root: Callable[[], Path]


def fairseq_package_dir() -> Path:
    """The installed fairseq package folder, found without importing it."""
    spec = importlib.util.find_spec("fairseq")
    if spec is None or not spec.submodule_search_locations:
        raise FairseqFixError(
            "fairseq is not installed; run scripts/setup.sh (it installs fairseq==0.12.2)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def fairseq_dist_info_dir() -> Path:
    """The installed fairseq's .dist-info folder (its METADATA drives pip's resolver)."""
    dist = importlib.metadata.distribution("fairseq")
    metadata = next(f for f in dist.files if f.name == "METADATA" and "dist-info" in str(f))
    return Path(metadata.locate()).parent


def installed_fairseq_version() -> str:
    try:
        return importlib.metadata.version("fairseq")
    except importlib.metadata.PackageNotFoundError as e:
        raise FairseqFixError(
            "fairseq is not installed; run scripts/setup.sh (it installs fairseq==0.12.2)"
        ) from e


def _dataclass_default_edits(path: str, fields: List[Tuple[str, str]]) -> Tuple[TextEdit, ...]:
    return tuple(
        TextEdit(path, f"{name}: {typ} = {typ}()", f"{name}: {typ} = field(default_factory={typ})")
        for name, typ in fields
    )


FIXES = (
    Fix(
        name="dataclass_defaults",
        why=(
            "Python 3.11 rejects dataclass fields whose default is an unhashable instance "
            "(another dataclass); `import fairseq` raises ValueError. Use default_factory."
        ),
        edits=_dataclass_default_edits(
            "dataclass/configs.py",
            [
                ("common", "CommonConfig"),
                ("common_eval", "CommonEvalConfig"),
                ("distributed_training", "DistributedTrainingConfig"),
                ("dataset", "DatasetConfig"),
                ("optimization", "OptimizationConfig"),
                ("checkpoint", "CheckpointConfig"),
                ("bmuf", "FairseqBMUFConfig"),
                ("generation", "GenerationConfig"),
                ("eval_lm", "EvalLMConfig"),
                ("interactive", "InteractiveConfig"),
                ("ema", "EMAConfig"),
            ],
        )
        + _dataclass_default_edits(
            "models/transformer/transformer_config.py",
            [("encoder", "EncDecBaseConfig"), ("decoder", "DecoderConfig")],
        )
        + (
            TextEdit(
                "models/transformer/transformer_config.py",
                "quant_noise: QuantNoiseConfig = field(default=QuantNoiseConfig())",
                "quant_noise: QuantNoiseConfig = field(default_factory=QuantNoiseConfig)",
            ),
        ),
        root=fairseq_package_dir,
    ),
    Fix(
        name="hydra_init_default_factory",
        why=(
            "hydra_init registers each FairseqConfig group from `field.default`, which is "
            "MISSING once the groups use default_factory; build the default instead."
        ),
        edits=(
            TextEdit(
                "dataclass/initialize.py",
                "v = FairseqConfig.__dataclass_fields__[k].default\n",
                "fld = FairseqConfig.__dataclass_fields__[k]\n"
                "        v = fld.default_factory() if callable(fld.default_factory) else fld.default\n",
            ),
        ),
        root=fairseq_package_dir,
    ),
    Fix(
        name="torch_load_weights_only",
        why=(
            "torch >= 2.6 loads with weights_only=True by default, which refuses the "
            "argparse.Namespace and config objects fairseq checkpoints hold; fairseq-generate "
            "and resuming training fail. Checkpoints are the user's own files: load them fully. "
            "While at that line, a file torch cannot read is reported as 'not a valid "
            "checkpoint' with its path, instead of a bare unpickling error."
        ),
        edits=(
            TextEdit(
                "checkpoint_utils.py",
                '        state = torch.load(f, map_location=torch.device("cpu"))\n',
                "        try:\n"
                '            state = torch.load(f, map_location=torch.device("cpu"), weights_only=False)\n'
                "        except Exception as e:\n"
                '            raise RuntimeError(f"{path} is not a valid checkpoint: {e}") from e\n',
            ),
            TextEdit(
                "checkpoint_utils.py",
                '"cpu")\n            ),\n        )',
                '"cpu")\n            ),\n            weights_only=False,\n        )',
            ),
        ),
        root=fairseq_package_dir,
    ),
    Fix(
        name="bettertransformer_fast_path",
        why=(
            "Loading a checkpoint turns on 0.12.2's BetterTransformer inference path, which "
            "calls torch._transformer_encoder_layer_fwd with a signature torch has since "
            "changed ('Mask Type should be defined'). Upstream removed the path; we never "
            "enable it, so layers always run their ordinary forward."
        ),
        edits=(
            TextEdit(
                "modules/transformer_layer.py",
                "        self.load_to_BT = True\n",
                "        self.load_to_BT = False  # fairseq_plugins: fast path disabled\n",
            ),
        ),
        root=fairseq_package_dir,
    ),
    Fix(
        name="dependency_pins",
        why=(
            "fairseq's metadata requires torchaudio (pip then installs a torchaudio built for "
            "another torch, whose import raises OSError, or a second torch) and pins "
            "hydra-core<1.1 / omegaconf<2.1, which fail on Python 3.11. Translation never "
            "imports torchaudio; hydra-core 1.3.2 and omegaconf 2.3.0 work once the fixes above "
            "are in. Rewrite the installed metadata so pip keeps the working set."
        ),
        edits=(
            TextEdit("METADATA", "Requires-Dist: torchaudio>=0.8.0\n", ""),
            TextEdit(
                "METADATA",
                "Requires-Dist: hydra-core<1.1,>=1.0.7\n",
                "Requires-Dist: hydra-core>=1.3.2\n",
            ),
            TextEdit("METADATA", "Requires-Dist: omegaconf<2.1\n", "Requires-Dist: omegaconf>=2.3.0\n"),
        ),
        root=fairseq_dist_info_dir,
    ),
)


def _edit_status(text: str, edit: TextEdit) -> str:
    if edit.new and edit.new in text:
        return APPLIED
    if edit.old in text:
        return MISSING
    if not edit.new:  # a pure deletion is applied once the old text is gone
        return APPLIED
    raise FairseqFixError(f"unknown fairseq source in {edit.path}: expected {edit.old!r}")


def _check_version() -> None:
    version = installed_fairseq_version()
    if version != SUPPORTED_FAIRSEQ_VERSION:
        raise FairseqFixError(
            f"fairseq {version} is installed; these fixes are written for "
            f"fairseq {SUPPORTED_FAIRSEQ_VERSION} only. Install it with scripts/setup.sh."
        )


def fix_status(fix: Fix) -> str:
    """APPLIED when every edit of the fix is in place, else MISSING."""
    root = fix.root()
    statuses = {_edit_status((root / e.path).read_text(), e) for e in fix.edits}
    return APPLIED if statuses == {APPLIED} else MISSING


def check() -> Dict[str, str]:
    """Status of every fix by name. Raises FairseqFixError for an unknown fairseq."""
    _check_version()
    return {fix.name: fix_status(fix) for fix in FIXES}


def apply() -> Dict[str, str]:
    """Apply the missing fixes; return what each fix did ('applied now' or 'already applied')."""
    _check_version()
    done = {}
    for fix in FIXES:
        if fix_status(fix) == APPLIED:
            done[fix.name] = "already applied"
            continue
        root = fix.root()
        for edit in fix.edits:
            path = root / edit.path
            text = path.read_text()
            if _edit_status(text, edit) == MISSING:
                path.write_text(text.replace(edit.old, edit.new, 1))
        done[fix.name] = "applied now"
    return done


def require_fixed() -> None:
    """Raise a clear error when fairseq runs without our fixes (called when models load)."""
    missing = [name for name, status in check().items() if status != APPLIED]
    if missing:
        raise FairseqFixError(
            f"fairseq is missing fixes {missing}: run `python -m fairseq_plugins.fairseq_fixes apply` "
            "(scripts/setup.sh does it)"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["check", "apply"])
    args = parser.parse_args(argv)
    try:
        report = check() if args.action == "check" else apply()
    except FairseqFixError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"fairseq {installed_fairseq_version()} at {fairseq_package_dir()}")
    for fix in FIXES:
        print(f"  {fix.name:28s} {report[fix.name]}")
    if args.action == "check" and MISSING in report.values():
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
