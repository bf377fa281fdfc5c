"""The registered tasks: every module of this package (``registration.register_all``, which
first checks that the installed fairseq carries our fixes; ``--user-dir`` imports the tasks
before the models)."""

from fairseq_plugins.registration import register_all

register_all(__name__, __path__)
