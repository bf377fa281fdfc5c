"""Multi-Scale Transformer: per-head window widths and their distribution across layers."""
