"""The registered models.

Importing the models first checks that the installed fairseq carries our fixes, so a
half-set-up environment fails here with the command that repairs it, not deep inside fairseq.

Every model module is imported here, not only by ``--user-dir``: fairseq skips a user dir
whose package is already imported (e.g. by a script or a test that imported one model), and
the other models would then silently stay unregistered.
"""

import importlib
import pkgutil

from fairseq_plugins.fairseq_fixes import require_fixed

require_fixed()

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
