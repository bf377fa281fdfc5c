"""The registered tasks.

Every task module is imported here, not only by ``--user-dir``: fairseq skips a user dir
whose package is already imported, and the tasks would then silently stay unregistered.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
