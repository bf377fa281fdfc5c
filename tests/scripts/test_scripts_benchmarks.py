"""Every benchmark script in ``scripts/`` runs end to end in a tiny mode (a benchmark nobody runs breaks silently).

Each runs as a user runs it (``python -m scripts.<name>``), with sizes small enough for seconds on
one core, and must write its results file. The numbers themselves are not checked here.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.cli import MULTI30K, REPO



def run_script(name: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", f"scripts.{name}", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, f"scripts.{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.cli
def test_benchmark_graph_attention_tiny(tmp_path):
    out = tmp_path / "graph_attention"
    run_script("benchmark_graph_attention", "--lengths", "64", "128", "--ks", "1", "--tokens", "128",
               "--repeats", "1", "--threads", "1", "2", "--out", out)  # fmt: skip
    table = out.with_suffix(".md").read_text()
    assert "| op |" in table and "| layer |" in table  # both parts ran, the layer part included
    assert "| op | 128 | 1 | 2 |" in table  # every length at every thread count


def _resident(megabytes: int):
    """Fresh anonymous memory with every page written: resident whatever the allocator holds
    (freed heap memory that earlier tests left resident would hide a torch allocation)."""
    import mmap

    block = mmap.mmap(-1, megabytes << 20)
    for offset in range(0, megabytes << 20, mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_memory_measure_sees_a_step_that_stays_below_an_earlier_peak():
    """The graph benchmark's peak memory of a step: building a large graph can peak higher
    than the step, and a peak counted from the process's earlier high-water mark then reads 0."""
    from scripts.benchmark_graph_attention import reset_peak_rss, rss_mb

    _resident(256).close()  # a 256 MB peak before the step
    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    base = rss_mb("VmRSS")
    step = _resident(64)  # the step: 64 MB
    assert 56 < rss_mb() - base < 200
    step.close()


@pytest.mark.cli
def test_benchmark_multiscale_attention_tiny(tmp_path):
    out = tmp_path / "multiscale"
    run_script("benchmark_multiscale_attention", "--lengths", "64", "--heads", "2", "--head-dim", "8",
               "--repeats", "1", "--masked-max-length", "64", "--device", "cpu", "--out", out)  # fmt: skip
    assert json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow
@pytest.mark.cli
def test_benchmark_slowfast_tiny(tmp_path):
    out = tmp_path / "slowfast.json"
    run_script("benchmark_slowfast", "--size", "tiny", "--max-tokens", "128", "--updates", "1", "--out", out,
               "--raw-dir", MULTI30K)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"transformer", "slow-only", "transformer_slowfast"}
    assert results["transformer"]["time_ratio"] == 1.0


@pytest.mark.cli
def test_triton_work_model_tiny(tmp_path):
    """The estimate's counted inputs at the setting the GPU review estimated by hand (BPT
    n 8192, k 4: 16.3% tile fill, 1,202 FlexAttention blocks per head), the compiled
    kernels' tile loops read from their sm_90a SASS, every assumption listed, and each time
    an ESTIMATE range, against FA2, FA3 and flex."""
    pytest.importorskip("triton")
    out = tmp_path / "work_model"
    run_script("triton_work_model", "--lengths", "8192", "--ks", "4", "--glue-tokens", "100", "--out", out)
    table = out.with_suffix(".md").read_text()
    assert "ESTIMATES" in table and "## ESTIMATE at n 8192, k 4" in table
    for name in ("clock", "issue_width", "issue_efficiency", "tensor_flop_per_cycle", "fa2_rate", "fa3_rate", "hbm",
                 "l2_reuse", "aten_launch_s", "triton_launch_s", "flex_fraction"):
        assert f"| {name} |" in table
    for kernel in ("forward", "backward_query", "backward_key"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {kernel} | 64 x 32 |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        loop, nested, per_tile, tensor_core = (int(c) for c in cells[8:12])
        assert loop > 100 and tensor_core > 0  # the tile loop, found in the SASS, with its products
        assert sum(int(c) for c in cells[11:19]) == loop  # every instruction in one class
        # the dQ kernel's loop over a tile's edge types runs several times a tile (6.6 at k 4)
        assert (nested > 0 and per_tile > loop + 4 * nested) if kernel == "backward_query" else (
            nested == 0 and per_tile == loop)
    for label in ("FlashAttention-2 (SDPA)", "FlashAttention-3", "FlexAttention"):
        assert next(line for line in table.splitlines() if line.startswith(f"| {label}")).endswith("x |")
    row = next(line for line in table.splitlines() if line.startswith("| 8192 | 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "16.3%" and cells[5] == "1202"
    low, high = (float(x) for x in cells[11].strip("*").split("-"))
    assert 0 < low < high
    assert "Triton kernel launches" in table


@pytest.mark.slow
@pytest.mark.cli
def test_benchmark_models_tiny(tmp_path):
    """As users train: a joint BPE data-bin, shared embeddings, fairseq-train's own words per second."""
    out = tmp_path / "models"
    proc = run_script("benchmark_models", "--raw-dir", MULTI30K, "--data-dir", tmp_path / "data", "--sizes", "tiny",
                      "--bpe-merges", "200", "--train-sentences", "300", "--models", "transformer", "bpt_transformer",
                      "--updates", "1", "--rounds", "1", "--train-updates", "4", "--log-interval", "2",
                      "--threads", "1", "--profile-split", "--split-rounds", "1", "--out", out)  # fmt: skip
    run = json.loads(out.with_suffix(".json").read_text())["runs"]["tiny"]
    results, trained = run["results"], run["fairseq_train"]
    assert set(results) == set(trained) == {"transformer", "bpt_transformer"}
    assert results["transformer"]["time_ratio"] == trained["transformer"]["time_ratio"] == 1.0
    assert all(t["words_per_second"] > 0 for t in trained.values())
    # one joined dictionary: the shared embeddings are one matrix, so BPT adds only its own weights
    dictionary = (tmp_path / "data" / "dict.en.txt").read_text()
    assert dictionary == (tmp_path / "data" / "dict.de.txt").read_text()
    assert run["meta"]["dictionary"] == len(dictionary.splitlines()) + 4
    split = proc.stdout[proc.stdout.index("| part |"):]
    assert "| projections |" in split and "| model body |" in split
    # BPT's attention core: the C++ kernel where it built, else the torch backend's gather
    assert "| graph attention kernel |" in split or "| relative keys (gather) |" in split
    floor = run["floors"]["bpt_transformer"]
    assert run["floors"]["transformer"] is None and floor["floor_ratio"] > 1.0
    assert f"| bpt_transformer | {floor['span_seconds']:.3f} | {floor['floor_ratio']:.2f}x |" in proc.stdout
