"""Moving between fairseq's time-first layout and the per-head layout of attention kernels.

fairseq's attention modules take T x B x C tensors; ``F.scaled_dot_product_attention`` and
the plugin's sparse kernels take B x H x T x D. Every attention module of the plugin goes
through these two functions.
"""

import torch


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """T x B x (H * D) -> B x H x T x D (a view when ``x`` allows one)."""
    length, bsz, channels = x.shape
    return x.reshape(length, bsz, num_heads, channels // num_heads).permute(1, 2, 0, 3)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """B x H x T x D -> T x B x (H * D), the inverse of :func:`split_heads`."""
    bsz, heads, length, dim = x.shape
    return x.permute(2, 0, 1, 3).reshape(length, bsz, heads * dim)
