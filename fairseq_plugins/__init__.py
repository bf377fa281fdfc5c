"""fairseq_plugins: multi-scale and sparse-attention translation models for fairseq 0.12.2.

Load with ``fairseq-train --user-dir fairseq_plugins ...``. fairseq imports this package,
then its ``models/`` and ``tasks/`` folders, which register the architectures.

This file must not import fairseq: ``python -m fairseq_plugins.fairseq_fixes`` runs
before fairseq is importable.
"""

__version__ = "0.2.0"
