"""How the graph attention op meets autocast (fairseq's ``--amp``), in one place.

Under autocast the op behaves like ``scaled_dot_product_attention``: it runs in autocast's
lower precision, so float32 query, key and value are cast to autocast's dtype (other dtypes
are left as they are); ``rel_key``, a float32 parameter in a mixed-precision model, is not
cast here: each backend reads it in the precision it computes the relative term in (the
Triton kernels keep an fp32 table), so its gradient comes back in its own dtype. The
backends themselves then run with autocast off, forward and backward, so that their
internal products have exactly the dtypes they were written for.
"""

import contextlib
import functools

import torch


# Whether a device type has autocast, asked of torch once per type: ``torch.amp.is_autocast_available``
# is a C function that ``torch.compile`` could not trace before torch 2.13 (a graph break inside
# every BPT layer), while a lookup in this dict traces. The usual types are asked at import.
_HAS_AUTOCAST = {kind: torch.amp.is_autocast_available(kind) for kind in ("cpu", "cuda", "meta", "xpu", "mps")}


def has_autocast(kind: str) -> bool:
    """Whether device type ``kind`` has autocast (meta has none)."""
    if kind not in _HAS_AUTOCAST:
        _HAS_AUTOCAST[kind] = torch.amp.is_autocast_available(kind)
    return _HAS_AUTOCAST[kind]


def autocast_dtype(device: torch.device):
    """Autocast's dtype on ``device`` where autocast is on there, else None."""
    kind = device.type
    if has_autocast(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def autocast_inputs(*tensors: torch.Tensor):
    """The tensors as the op computes with them under the caller's autocast state."""
    dtype = autocast_dtype(tensors[0].device)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in tensors)


def autocast_off(device: torch.device):
    """A context with autocast off on ``device`` (nothing to do where it has none, e.g. meta)."""
    if has_autocast(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def backward_without_autocast(backward):
    """For an ``autograd.Function``'s backward, which runs under the autocast state of
    whoever calls ``.backward()`` (on CPU, in that thread): run it with autocast off too."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        device = next(g.device for g in grads if g is not None)
        with autocast_off(device):
            return backward(ctx, *grads)
    return run
