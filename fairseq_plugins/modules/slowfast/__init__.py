"""TranSFormer (slow-fast): the two-branch encoder, its character-level fast branch, the GCNs and
relative PE, and the fusion between the branches."""
