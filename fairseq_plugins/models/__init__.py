"""The registered models.

Importing the models first checks that the installed fairseq carries our fixes, so a
half-set-up environment fails here, in one line, with the command that repairs it, not deep
inside fairseq.

Every model module is imported here, not only by ``--user-dir``: fairseq skips a user dir
whose package is already imported (e.g. by a script or a test that imported one model), and
the other models would then silently stay unregistered.
"""

import importlib
import pkgutil

from fairseq_plugins.command_line import print_command_errors_in_one_line
from fairseq_plugins.fairseq_fixes import require_fixed

# fairseq's commands (which import this package through --user-dir) print the plugin's refusals, a
# CommandError such as a missing fix or an option no model can take, in one line as its own commands do
print_command_errors_in_one_line()
require_fixed()

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
