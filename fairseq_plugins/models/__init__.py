"""The registered models: every module of this package (``registration.register_all``, which
first checks that the installed fairseq carries our fixes)."""

from fairseq_plugins.registration import register_all

register_all(__name__, __path__)
