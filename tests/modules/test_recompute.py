"""``recompute_rows``: a row-wise sublayer recomputed chunk by chunk in the backward gives the
forward's output and gradients (float64), redraws the forward's dropout masks, and saves no
inner activation; ``recompute_norms``: the same outputs and gradients, the norm's output not
kept."""

import weakref

import pytest
import torch
from torch import nn

from fairseq_plugins.modules.common import recompute as recompute_module
from fairseq_plugins.modules.common.recompute import chunk_rows, recompute_norms, recompute_rows

WIDTH = 24


def _ffn(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, WIDTH), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(WIDTH, 8)).double()


def _run(fn, x, recompute):
    x = x.detach().requires_grad_()
    out = recompute_rows(fn, x, WIDTH) if recompute else fn(x)
    out.sin().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in fn.parameters()]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows of [rows, 2, 8] inputs: several chunks, the last one shorter."""
    monkeypatch.setattr(recompute_module, "CHUNK_ELEMENTS", 3 * 2 * WIDTH)


def test_chunks_hold_the_widest_tensor_within_the_budget(small_chunks):
    x = torch.zeros(10, 2, 8)
    assert chunk_rows(x, WIDTH) == 3
    assert chunk_rows(torch.zeros(10, 2, 8), 10**9) == 1  # never zero rows


def test_recomputed_rows_match_the_plain_sublayer_in_float64(small_chunks):
    x = torch.randn(10, 2, 8, dtype=torch.float64)
    fn = _ffn()
    out, grad_x, grads = _run(fn, x, recompute=False)
    fn.zero_grad()
    out_r, grad_x_r, grads_r = _run(fn, x, recompute=True)
    torch.testing.assert_close(out_r, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_x_r, grad_x, rtol=1e-12, atol=1e-12)
    for g_r, g in zip(grads_r, grads):
        torch.testing.assert_close(g_r, g, rtol=1e-12, atol=1e-12)


def test_the_backward_redraws_the_forwards_dropout_masks(small_chunks, monkeypatch):
    """With dropout, the gradients equal those of the same chunks run without recomputation
    (the masks drawn in the same order): the recomputed masks are the forward's."""
    x = torch.randn(10, 2, 8, dtype=torch.float64)
    fn = _ffn(dropout=0.5)
    torch.manual_seed(1)
    out_r, grad_x_r, grads_r = _run(fn, x, recompute=True)
    monkeypatch.setattr(recompute_module, "checkpoint", lambda f, chunk, **_: f(chunk))
    fn.zero_grad()
    torch.manual_seed(1)
    out, grad_x, grads = _run(fn, x, recompute=True)
    torch.testing.assert_close(out_r, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_x_r, grad_x, rtol=1e-12, atol=1e-12)
    for g_r, g in zip(grads_r, grads):
        torch.testing.assert_close(g_r, g, rtol=1e-12, atol=1e-12)


def saved_widths(run):
    """The last dims of the tensors autograd saves while ``run()`` builds its graph."""
    widths = []

    def pack(t):
        widths.append(t.size(-1) if t.dim() else 0)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return widths


def test_no_inner_activation_is_saved(small_chunks):
    x = torch.randn(10, 2, 8, dtype=torch.float64, requires_grad=True)
    fn = _ffn()
    assert WIDTH in saved_widths(lambda: fn(x))
    assert WIDTH not in saved_widths(lambda: recompute_rows(fn, x, WIDTH))


def test_without_gradients_it_is_the_sublayer(small_chunks, monkeypatch):
    monkeypatch.setattr(recompute_module, "checkpoint", None)  # never called
    x = torch.randn(10, 2, 8, dtype=torch.float64)
    fn = _ffn()
    with torch.no_grad():
        torch.testing.assert_close(recompute_rows(fn, x, WIDTH), fn(x))


class NormedProjections(nn.Module):
    """A pre-norm layer's layer norm and three projections; ``kept`` holds weak references to
    the storage of the norm's outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8).double()
        self.projections = nn.ModuleList(nn.Linear(8, 8).double() for _ in range(3))
        self.kept = []

    def forward(self, x):
        y = self.norm(x)
        self.kept.append(weakref.ref(y.untyped_storage()))
        return tuple(proj(y) for proj in self.projections)


def _run_projections(fn, x, recompute):
    x = x.detach().requires_grad_()
    outputs = recompute_norms(fn, x) if recompute else fn(x)
    norm_alive = fn.kept[-1]() is not None
    sum(o.sin().sum() for o in outputs).backward()
    return [o.detach() for o in outputs], x.grad, [p.grad.clone() for p in fn.parameters()], norm_alive


def test_recomputed_norms_match_and_their_outputs_are_not_kept():
    x = torch.randn(10, 2, 8, dtype=torch.float64)
    fn = NormedProjections()
    outs, grad_x, grads, alive = _run_projections(fn, x, recompute=False)
    assert alive  # kept by the projections for their weight gradients
    fn.zero_grad()
    outs_r, grad_x_r, grads_r, alive_r = _run_projections(fn, x, recompute=True)
    assert not alive_r
    for got, want in zip([*outs_r, grad_x_r, *grads_r], [*outs, grad_x, *grads]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
