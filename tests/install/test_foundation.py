"""The foundation: fairseq 0.12.2 works on this stack with the fixes, set-up is idempotent.

How the fixes are applied and built into fairseq's wheel: tests/install/test_fairseq_build.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_plugins import fairseq_fixes
from fairseq_plugins.fairseq_fixes import APPLIED
from tests.cli import REPO, USER_DIR, generate, hypotheses, interactive, parse_bleu, run_cli, train


def test_every_fix_is_in_place():
    assert fairseq_fixes.check() == {fix.name: APPLIED for fix in fairseq_fixes.FIXES}
    assert fairseq_fixes.main(["check"]) == 0


def test_fixes_module_does_not_need_fairseq_importable():
    """The fix module and the package root run before fairseq is importable."""
    code = (
        "import sys, fairseq_plugins, fairseq_plugins.fairseq_fixes as f; f.check();"
        "assert 'fairseq' not in sys.modules, 'importing the fixes imported fairseq'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.slow
@pytest.mark.cli
def test_setup_twice_changes_nothing():
    def freeze():
        pip_freeze = [sys.executable, "-m", "pip", "freeze"]
        return subprocess.run(pip_freeze, capture_output=True, text=True, check=True).stdout

    before = freeze()
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "installing" not in out, out
    assert "already" in out and "done" in out
    assert freeze() == before


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory, tiny_data_bin):
    save_dir = tmp_path_factory.mktemp("stock-ckpt")
    log = train(tiny_data_bin, save_dir, "transformer", max_update=20).stdout
    return tiny_data_bin, save_dir, log


@pytest.mark.slow
def test_stock_transformer_trains_with_user_dir_and_generates_bleu(stock_run):
    data_bin, save_dir, log = stock_run
    assert f"user_dir='{USER_DIR}'" in log or str(USER_DIR) in log
    assert "done training" in log
    out = generate(data_bin, save_dir / "checkpoint_last.pt")
    assert 0.0 <= parse_bleu(out) <= 100.0
    n_test = len((data_bin.parent / "raw" / "test.en").read_text().splitlines())
    assert sorted(hypotheses(out)) == list(range(n_test))


@pytest.mark.slow
def test_stock_transformer_interactive(stock_run):
    data_bin, save_dir, _ = stock_run
    out = interactive(data_bin, save_dir / "checkpoint_last.pt", ["a man is walking .", "two dogs play ."])
    hyps = hypotheses(out)
    assert sorted(hyps) == [0, 1] and all(h.strip() for h in hyps.values())


@pytest.mark.slow
def test_training_resumes_from_checkpoint_last(stock_run, tmp_path):
    data_bin, save_dir, _ = stock_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "checkpoint_last.pt").write_bytes((save_dir / "checkpoint_last.pt").read_bytes())
    log = train(data_bin, resumed, "transformer", max_update=25).stdout
    assert "Loaded checkpoint" in log and "@ 20 updates" in log, log[-2000:]
    assert "num_updates 25" in log.replace("=", " ") or "| num_updates 25" in log, log[-2000:]


@pytest.mark.slow
def test_corrupt_checkpoint_is_a_clear_error(stock_run, tmp_path):
    data_bin, _, _ = stock_run
    bad = tmp_path / "checkpoint_bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(RuntimeError) as err:
        run_cli("fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", bad, "--cpu")
    assert "checkpoint_bad.pt" in str(err.value) and "not a valid checkpoint" in str(err.value)


def test_user_dir_imports_the_plugin_package():
    code = (
        "from argparse import Namespace; from fairseq import utils;"
        f"utils.import_user_module(Namespace(user_dir={str(USER_DIR)!r}));"
        "import sys; assert 'fairseq_plugins.models' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path("/"))


def test_every_model_registers_even_when_the_package_was_imported_first():
    """fairseq skips an already-imported --user-dir; importing one model must register all."""
    code = (
        "import fairseq_plugins.models.ms_transformer;"
        "from argparse import Namespace; from fairseq import utils;"
        f"utils.import_user_module(Namespace(user_dir={str(USER_DIR)!r}));"
        "import fairseq_plugins.tasks;"
        "from fairseq.models import ARCH_MODEL_REGISTRY as archs; from fairseq.tasks import TASK_REGISTRY as tasks;"
        "missing = {'bpt_transformer', 'segtree_transformer', 'transformer_slowfast', 'ms_transformer',"
        " 'bpt_document'} - set(archs);"
        "assert not missing, missing; assert 'document_translation' in tasks"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path("/"))
