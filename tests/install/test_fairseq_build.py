"""fairseq is installed cleanly: the fixes go into the 0.12.2 sdist, pip installs the built wheel.

These tests read the sdist that scripts/setup.sh cached (it downloads and builds fairseq once
per machine) and the installed fairseq; none of them builds fairseq again.
"""

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

from fairseq_plugins import fairseq_fixes
from fairseq_plugins.fairseq_fixes import APPLIED, MISSING, FairseqFixError, SourceTree
from fairseq_plugins import fairseq_build as build_fairseq_wheel
from tests.cli import REPO


@pytest.fixture(scope="module")
def pristine_sdist(tmp_path_factory):
    """The original fairseq 0.12.2 source, unpacked from the cached sdist."""
    dest = tmp_path_factory.mktemp("sdist")
    with tarfile.open(build_fairseq_wheel.sdist(download=False)) as archive:
        archive.extractall(dest, filter="data")
    return dest / "fairseq-0.12.2"


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_fixes_apply_to_the_original_source_once(pristine_sdist, tmp_path):
    tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path / "src"))
    assert set(fairseq_fixes.check(tree).values()) == {MISSING}
    assert set(fairseq_fixes.apply(tree).values()) == {"applied now"}
    once = _files(tree.root)
    assert set(fairseq_fixes.apply(tree).values()) == {"already applied"}
    assert _files(tree.root) == once
    assert fairseq_fixes.check(tree) == {fix.name: APPLIED for fix in fairseq_fixes.FIXES}
    assert tree.version() == fairseq_fixes.local_version()
    setup_py = (tree.root / "setup.py").read_text()
    assert "torchaudio" not in setup_py and '"hydra-core>=1.3.2"' in setup_py


@pytest.mark.cli
def test_build_script_prepares_the_fixed_source(tmp_path):
    """The script's tiny mode: unpack the cached sdist and fix it, without building."""
    out = subprocess.run([sys.executable, "-m", "fairseq_plugins.fairseq_build", "--prepare", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    tree = SourceTree(out.strip())
    assert set(fairseq_fixes.check(tree).values()) == {APPLIED}


# The fixes that remove a message or a warning, and what each one removes.
WARNING_FIXES = ("tensorboardx_import_message", "hydra_deprecated_api", "torch_amp_autocast", "mha_padding_mask_dtype")


@pytest.fixture(scope="module")
def fixed_and_unfixed(pristine_sdist, tmp_path_factory):
    """Two fixed source trees: one with every fix, one without WARNING_FIXES (to show what they remove)."""
    trees = []
    for name, without in (("fixed", ()), ("unfixed", WARNING_FIXES)):
        tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path_factory.mktemp(name) / "src"))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fairseq_fixes, "FIXES", tuple(f for f in fairseq_fixes.FIXES if f.name not in without))
            fairseq_fixes.apply(tree)
        trees.append(tree)
    return trees


def _python_in(tree, code, *flags, check=True):
    """Run ``code`` with fairseq imported from a source tree (these paths need no build step),
    warnings shown as Python shows them by default."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(tree.root)
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=tree.root.parent, env=env,
                          capture_output=True, text=True, check=check)  # fmt: skip


def test_import_fairseq_does_not_ask_for_tensorboardx(fixed_and_unfixed):
    """The text_to_speech task (imported by `import fairseq`) takes torch's writer, silently."""
    fixed, unfixed = fixed_and_unfixed
    code = "import fairseq.tasks.text_to_speech as t; print(getattr(t.SummaryWriter, '__module__', None))"
    out = _python_in(fixed, code)
    assert "tensorboardX" not in out.stdout + out.stderr
    if importlib.util.find_spec("tensorboard") is not None:
        assert out.stdout.strip() == "torch.utils.tensorboard.writer"
    assert "Please install tensorboardX" in _python_in(unfixed, code).stderr


CONFIG_CODE = """
import warnings
warnings.simplefilter("always", UserWarning)
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf
args = options.parse_args_and_arch(options.get_training_parser(), [
    "data-bin", "--arch", "transformer_iwslt_de_en", "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "100"])
cfg = convert_namespace_to_omegaconf(args)
print(OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg))
"""


def test_config_composes_the_same_without_hydra_deprecations(fixed_and_unfixed):
    fixed, unfixed = (_python_in(tree, CONFIG_CODE) for tree in fixed_and_unfixed)
    assert fixed.stdout == unfixed.stdout and "arch: transformer_iwslt_de_en" in fixed.stdout
    for deprecation in ("hydra.experimental", "version_base", "'# @package _group_'", "strict flag"):
        assert deprecation in unfixed.stderr
        assert deprecation not in fixed.stderr


TRAIN_STEP_CODE = """
import torch
from fairseq.tasks.fairseq_task import FairseqTask
class Model(torch.nn.Linear):
    def set_num_updates(self, num_updates):
        pass
class Optimizer:
    def backward(self, loss):
        loss.backward()
model = Model(2, 1)
FairseqTask.train_step(None, torch.ones(1, 2), model, lambda m, s: (m(s).sum(), 1, {}), Optimizer(), 0)
print(model.weight.grad.tolist())
"""


def test_train_step_uses_torch_autocast(fixed_and_unfixed):
    """A training step (autocast off, as without --amp) gives the same gradients, and no FutureWarning."""
    fixed, unfixed = fixed_and_unfixed
    assert _python_in(fixed, TRAIN_STEP_CODE, "-W", "error::FutureWarning").stdout.strip() == "[[1.0, 1.0]]"
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4):  # torch.cuda.amp is deprecated from 2.4
        out = _python_in(unfixed, TRAIN_STEP_CODE, "-W", "error::FutureWarning", check=False)
        assert out.returncode != 0 and "torch.cuda.amp.autocast(args...)` is deprecated" in out.stderr


MHA_CODE = """
import torch
from fairseq.modules.multihead_attention import MultiheadAttention
torch.manual_seed(0)
mha = MultiheadAttention(8, 2, self_attention=True).double().eval()
x = torch.randn(5, 3, 8, dtype=torch.float64)  # (time, batch, channels), targets padded on the right
padding = torch.arange(5).unsqueeze(0) >= torch.tensor([[5], [3], [4]])
future = torch.triu(torch.full((5, 5), float("-inf"), dtype=torch.float64), 1)
out, _ = mha(x, x, x, key_padding_mask=padding, attn_mask=future)
print(out.tolist())
"""


def test_self_attention_with_padding_and_future_masks_is_the_same_without_a_warning(fixed_and_unfixed):
    fixed, unfixed = fixed_and_unfixed
    expected = _python_in(unfixed, MHA_CODE).stdout
    assert _python_in(fixed, MHA_CODE, "-W", "error::UserWarning").stdout == expected
    out = _python_in(unfixed, MHA_CODE, "-W", "error::UserWarning", check=False)
    assert out.returncode != 0 and "mismatched key_padding_mask and attn_mask" in out.stderr


def test_unknown_source_text_is_refused(pristine_sdist, tmp_path):
    tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path / "src"))
    (tree.root / "fairseq/checkpoint_utils.py").write_text("state = something_else()\n")
    with pytest.raises(FairseqFixError, match="unknown fairseq source in fairseq/checkpoint_utils.py"):
        fairseq_fixes.apply(tree)


def test_other_fairseq_versions_are_refused(pristine_sdist, tmp_path, monkeypatch):
    tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path / "src"))
    (tree.root / "fairseq/version.txt").write_text("0.13.0")
    with pytest.raises(FairseqFixError, match="0.13.0 at .*0.12.2 only"):
        fairseq_fixes.apply(tree)
    monkeypatch.setattr(fairseq_fixes, "installed_fairseq_version", lambda: "0.13.0")
    assert fairseq_fixes.main(["check"]) == 2


def test_the_installed_fairseq_is_the_fixed_wheel_untouched():
    """Version label, declared dependencies, and every installed file as pip's RECORD lists it:
    nothing was edited in place after pip installed the wheel."""
    dist = importlib.metadata.distribution("fairseq")
    assert dist.version == fairseq_fixes.local_version()
    requires = set(dist.requires)
    assert {"hydra-core>=1.3.2", "omegaconf>=2.3.0"} <= requires
    assert not any(r.startswith("torchaudio") for r in requires)
    changed = []
    for f in dist.files:
        if f.hash is None:  # RECORD itself, and files compiled after installation
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b"=").decode()
        if digest != f.hash.value:
            changed.append(str(f))
    assert not changed


def test_token_blocks_in_eos_mode_build_with_the_installed_numpy():
    """What fairseq-interactive and the hub build for a language model: one block per sentence
    (``numpy2_compat_long``; under numpy 2 the unfixed source dies on ``np.compat``)."""
    import numpy as np
    import torch
    from fairseq.data import TokenBlockDataset

    blocks = TokenBlockDataset([torch.tensor([5, 6, 2]), torch.tensor([7, 2])], np.array([3, 2]), None,
                               pad=1, eos=2, break_mode="eos")
    assert len(blocks) == 2 and blocks[1].tolist() == [7, 2]


def test_pip_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_editable_install_of_the_plugin_resolves_offline():
    """`pip install -e .` finds every requirement (fairseq==0.12.2 included) already satisfied."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "-e", "."],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Would install fairseq-multiscale-plugins" in proc.stdout, proc.stdout
