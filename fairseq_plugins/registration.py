"""What fairseq's ``--user-dir`` reaches first: the ``models`` and ``tasks`` packages register
every module they hold through ``register_all``.

Importing either package first checks that the installed fairseq carries our fixes, so a
half-set-up environment fails there, in one line, with the command that repairs it, not deep
inside fairseq; fairseq's commands then print the plugin's refusals (a ``CommandError``: a
missing fix, an option no model can take) in one line, as their own errors. ``--user-dir``
registers the tasks before the models, so whichever comes first checks.

Every module is imported, not only those ``--user-dir`` names: fairseq skips a user dir whose
package is already imported (by a script or a test that imported one model), and the others
would then silently stay unregistered.
"""

import importlib
import pkgutil
from typing import Iterable

from fairseq_plugins.command_line import print_command_errors_in_one_line
from fairseq_plugins.fairseq_fixes import require_fixed


def register_all(package: str, path: Iterable[str]) -> None:
    """Check the fixes, then import every module of ``package`` (its ``__path__``)."""
    print_command_errors_in_one_line()
    require_fixed()
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")
