"""The papers' measured figures as table rows (``measure: peak-memory | mirrored-summation |
test-time``): nothing is trained by fairseq; each row names one point of a figure's line in its
``evaluate`` section (the model by the figure's name for it, and the point's settings), the
figure's module measures it in-process, and the row's results JSON holds the table's metric and
``measured_on``, so that ``fairseq-plugins-results-table`` prints it as any other row.

One module per figure holds the figure's measuring core; ``scripts/`` wraps the same core into
the benchmarks' Markdown, JSON and plots.
"""

import importlib
import json
from pathlib import Path
from typing import Dict, List

from ..config import ConfigError

MODULES = {  # measure kind -> the module that measures its rows
    "peak-memory": "segtree_memory",  # SegTree Figure 2
    "mirrored-summation": "mirrored_summation",  # Multi-Scale Figure 2
    "test-time": "multiscale_speed",  # Multi-Scale Figure 4
}
_KINDS = {int: "an integer", float: "a number", str: "a string"}


def row_settings(cfg: Dict, keys: Dict[str, type], choices: Dict[str, tuple] = None) -> Dict:
    """The row's ``evaluate`` section, checked: exactly ``keys`` (name -> type), each of its type
    and, where ``choices`` names it, one of them; returned with Python names (``test_samples``)."""
    given = cfg["evaluate"]
    missing = [k for k in keys if k not in given]
    unknown = sorted(set(given) - set(keys))
    if missing or unknown:
        raise ConfigError(f"{cfg['name']}: a {cfg['measure']} row's evaluate section sets {', '.join(keys)}; "
                          f"missing {missing}, unknown {unknown}")
    for key, kind in keys.items():
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ConfigError(f"{cfg['name']}: evaluate.{key} must be {_KINDS[kind]}, got {value!r}")
        if key in (choices or {}) and value not in choices[key]:
            raise ConfigError(f"{cfg['name']}: evaluate.{key} must be one of {list(choices[key])}, got {value!r}")
    return {k.replace("-", "_"): given[k] for k in keys}


def device_of(cpu: bool):
    """CUDA where there is one, unless asked for the CPU (``--gpus 0``)."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def measure(kind: str, configs: List[Dict], results_dir: Path, dry_run: bool, cpu: bool) -> None:
    """Each row's results JSON, skipping rows already measured; the plan first, every row checked."""
    module = importlib.import_module(f".{MODULES[kind]}", __name__)
    device = device_of(cpu)
    todo = []
    for cfg in configs:
        settings = module.settings(cfg)
        out = results_dir / f"{cfg['name']}.json"
        print(f"  measured in-process on {device.type.upper()}: {module.plan(settings)}    # -> {out}", flush=True)
        if not dry_run and _stale(out, settings, device):
            todo.append((cfg, settings))
    settings_of = {cfg["name"]: settings for cfg, settings in todo}
    for cfg, result in module.measure(todo, device):
        out = results_dir / f"{cfg['name']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        result = dict(result, settings=settings_of[cfg["name"]])
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"  {cfg['name']}: {result['measured_on']}", flush=True)


def _stale(out: Path, settings: Dict, device) -> bool:
    """Whether ``out`` must be measured: missing, or measured with other settings (a tiny run's
    ``--`` overrides) or on another device, which would otherwise pass for this run's point."""
    if not out.exists():
        return True
    earlier = json.loads(out.read_text(encoding="utf-8"))
    if earlier.get("settings") != settings or earlier.get("device") != str(device):
        print(f"    {out.name} was measured with other settings or on another device: measuring again", flush=True)
        return True
    return False
