"""The GPU test modules ``check_gpu`` runs, each in its own process (pytest ``--pyargs``)."""
