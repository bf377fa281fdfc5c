"""fairseq_plugins: multi-scale and sparse-attention translation models for fairseq 0.12.2.

Load with ``fairseq-train --user-dir fairseq_plugins ...``. fairseq imports this package,
then its ``models/`` and ``tasks/`` folders, which register the architectures.

This file must not import fairseq: ``python -m fairseq_plugins.fairseq_fixes`` runs
before fairseq is importable.
"""

import warnings

__version__ = "0.2.0"

# Two warnings that fairseq 0.12.2 causes on every command with today's hydra and torch and that
# say nothing a user can act on (fairseq_fixes.py removes the others at their source). Each is
# matched by its message, and appended after the user's own filters (-W, PYTHONWARNINGS) so that
# those still win.
KNOWN_WARNINGS = (
    # hydra: fairseq validates its config against the dataclass schema stored under the same name;
    # moving the schema into the config's defaults list would change fairseq-hydra-train's configs
    r"\s*'[^']*' is validated against ConfigStore schema with the same name",
    # torch: fairseq's data loaders ask for pinned memory, which only a GPU uses
    r"'pin_memory' argument is set as true but no accelerator is found",
)
for _message in KNOWN_WARNINGS:
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, append=True)
