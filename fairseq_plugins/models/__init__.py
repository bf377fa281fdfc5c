"""The registered models. fairseq's --user-dir imports every module of this folder.

Importing the models first checks that the installed fairseq carries our fixes, so a
half-set-up environment fails here with the command that repairs it, not deep inside fairseq.
"""

from fairseq_plugins.fairseq_fixes import require_fixed

require_fixed()
