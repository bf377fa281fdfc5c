"""The registered tasks.

fairseq's ``--user-dir`` registers the tasks before the models, so the check that the installed
fairseq carries our fixes runs here first (see ``models/__init__.py``): a fairseq without them
ends the command with the one line that names the command to run.

Every task module is imported here, not only by ``--user-dir``: fairseq skips a user dir
whose package is already imported, and the tasks would then silently stay unregistered.
"""

import importlib
import pkgutil

from fairseq_plugins.command_line import print_command_errors_in_one_line
from fairseq_plugins.fairseq_fixes import require_fixed

print_command_errors_in_one_line()  # the refusal below, and the tasks' own, in one line
require_fixed()

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
