"""TranSFormer (slow-fast): the character-level fast branch, its GCNs and relative PE, and the
fusion with the slow branch."""
