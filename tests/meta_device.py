"""Run a computation with every tensor on the ``meta`` device, where a CPU tensor mixed into
it raises as it would on CUDA.

Meta tensors have no values, so what needs them cannot run there: host reads
(``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``torch.equal``) and ops whose output
shape depends on values (``nonzero``, boolean-mask indexing). ``HostReads`` records those
during a CPU run of the same computation, per call site, and replays them in the meta run.
The recording's call sites list every host synchronisation of the computation.
"""

import sys
from collections import defaultdict, deque
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# results needed on the host: replayed as recorded
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.equal}
# outputs whose shape depends on values (no gradient): replayed as empty tensors of that shape
SHAPED = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.unique,
          torch.Tensor.unique}
_TORCH_DIR = str(Path(torch.__file__).parent)


def call_site() -> str:
    """file:line of the innermost caller outside torch and this module."""
    frame = sys._getframe(1)
    while frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _bool_masks(args):
    """The boolean tensors of a __getitem__ index."""
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return [i for i in index if isinstance(i, torch.Tensor) and i.dtype == torch.bool]


class HostReads(TorchFunctionMode):
    """Records host reads and value-dependent shapes (``replay=None``), or replays a
    recording (the ``recorded`` of a recording run) in the same order per call site."""

    def __init__(self, replay=None):
        super().__init__()
        self.replay = replay
        self.recorded = defaultdict(deque)
        self.replayed = []  # call sites read back from meta tensors: host syncs on a GPU

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or (func is torch.Tensor.to and _to_cpu(args, kwargs)):
            return self._value(func, args, kwargs)
        if func in SHAPED or (func is torch.Tensor.repeat_interleave
                              and "output_size" not in kwargs):
            return self._shaped(func, args, kwargs)
        if func is torch.Tensor.__getitem__ and _bool_masks(args):
            return self._masked_index(func, args, kwargs)
        return func(*args, **kwargs)

    def _next(self, site):
        queue = self.replay.get(site)
        if not queue:
            raise AssertionError(f"{site}: a value read on the meta run was not recorded on CPU")
        self.replayed.append(site)
        return queue.popleft()

    def _value(self, func, args, kwargs):
        if self.replay is not None and args[0].is_meta:
            return self._next(call_site())
        result = func(*args, **kwargs)
        if self.replay is None:
            self.recorded[call_site()].append(result)
        return result

    def _shaped(self, func, args, kwargs):
        if self.replay is not None and args[0].is_meta:
            shapes = self._next(call_site())
            made = [torch.empty(s, dtype=d, device="meta") for s, d in shapes]
            return made[0] if len(made) == 1 else tuple(made)
        result = func(*args, **kwargs)
        if self.replay is None:
            outputs = result if isinstance(result, tuple) else (result,)
            self.recorded[call_site()].append([(o.shape, o.dtype) for o in outputs])
        return result

    def _masked_index(self, func, args, kwargs):
        """t[mask]: the mask becomes integer indices of the recorded count (differentiable)."""
        if self.replay is None:
            counts = [int(m.sum()) for m in _bool_masks(args)]
            self.recorded[call_site()].append(counts)
            return func(*args, **kwargs)
        if not args[0].is_meta:
            return func(*args, **kwargs)
        counts = iter(self._next(call_site()))
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        replaced = []
        for i in index:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                count = next(counts)
                replaced += [torch.zeros(count, dtype=torch.long, device="meta")] * i.dim()
            else:
                replaced.append(i)
        return func(args[0], tuple(replaced), **kwargs)
