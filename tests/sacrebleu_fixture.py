"""A sacrebleu cache (its SACREBLEU folder) holding tiny WMT test sets, so that the data preparation
reads its dev/test sets through sacrebleu's own code with no network (CI has none).

tests/fixtures/sacrebleu holds each set's unpacked archive where sacrebleu unpacks it
(``<set>/raw/...``); ``sacrebleu_cache`` copies it to a scratch folder and adds the archive file
itself under the name sacrebleu gives it, which is how sacrebleu sees that a set is downloaded.
sacrebleu then writes its plain-text files (``<set>/<set>.<pair>.src`` ...) there as usual.
"""

import os
import shutil
import tarfile
from pathlib import Path
from typing import Dict

FIXTURE = Path(__file__).parent / "fixtures" / "sacrebleu"


def sacrebleu_cache(tmp_path: Path) -> Path:
    """A filled sacrebleu cache folder under tmp_path (for the SACREBLEU environment variable)."""
    from sacrebleu.dataset import DATASETS

    cache = Path(tmp_path) / "sacrebleu"
    shutil.copytree(FIXTURE, cache)
    for raw in sorted(cache.rglob("raw")):
        name = str(raw.parent.relative_to(cache))  # "wmt14", "wmt14/full", ...
        dataset = DATASETS[name]
        (url,) = dataset.data
        with tarfile.open(raw / dataset._get_tarball_filename(url), "w:gz") as tar:
            for member in sorted(p for p in raw.iterdir() if p.is_dir()):
                tar.add(member, arcname=member.name)
    return cache


def sacrebleu_env(tmp_path: Path) -> Dict[str, str]:
    """The environment of a subprocess that uses the fixture cache (sacrebleu reads SACREBLEU once,
    when imported, so the scripts run as processes of their own)."""
    return {**os.environ, "SACREBLEU": str(sacrebleu_cache(tmp_path)), "OMP_NUM_THREADS": "1"}
