"""The check of every pinned Triton (``triton_budget``): each version compiled by its own
Triton in a subprocess, a version pip cannot install skipped with its reason on one line,
and the budget itself (``triton_aot.MAX_REGISTERS``). The full check (every version, every
binary, minutes per version) runs in ``.ci/run``; here the installed Triton stands in for a
cached version, on one merge kernel for sm_90a (9 compiles)."""

import importlib.metadata
import json
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from fairseq_plugins.graph_attention import triton_aot, triton_budget  # noqa: E402


def _cached_copy_of_the_installed_triton(cache: Path) -> str:
    """A cache folder whose 'installed' version is the global Triton, linked in: what the
    check finds after pip installed a version once."""
    version = importlib.metadata.version("triton")
    folder = cache / "triton" / version
    folder.mkdir(parents=True)
    (folder / "triton").symlink_to(Path(triton.__file__).parent)
    info = next(Path(triton.__file__).parents[1].glob(f"triton-{version}.dist-info"))
    (folder / info.name).symlink_to(info)  # its entry points name Triton's backends
    return version


@pytest.mark.cli  # triton_budget runs `python -m ...triton_aot` under the cached Triton
def test_each_version_is_compiled_by_the_triton_in_its_own_folder(tmp_path, capsys):
    version = _cached_copy_of_the_installed_triton(tmp_path / "cache")
    out = tmp_path / "budget"
    assert triton_budget.main(["--versions", version, "--cache", str(tmp_path / "cache"), "--capabilities", "90",
                               "--kernels", "merge_grad_kv", "--workers", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())[version]
    # imported from the cache folder (the link), not from site-packages
    assert result["status"] == "checked" and result["triton"] == version
    assert Path(result["triton_path"]) == (tmp_path / "cache" / "triton" / version / "triton").absolute()
    reports = triton_aot.reports_from(result)
    assert {r.configuration.kernel for r in reports} == {"merge_grad_kv"} and len(reports) == 9
    assert all(r.capability == 90 and not r.problems() for r in reports)
    table = out.with_suffix(".md").read_text()
    assert f"| {version} |" in table and "within budget" in table
    assert f"Triton {version}" in capsys.readouterr().out


def test_a_version_pip_cannot_install_is_skipped_with_its_reason_on_one_line(tmp_path, monkeypatch, capsys):
    """No package registry reachable (an index that refuses connections, no config, no
    local wheels): the version is skipped, the check passes, the reason is one line."""
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    assert triton_budget.main(["--versions", "3.6.0", "--cache", str(tmp_path / "cache")]) == 0
    skipped = [line for line in capsys.readouterr().out.splitlines() if "SKIP" in line]
    assert len(skipped) == 1 and "triton==3.6.0" in skipped[0], skipped
    assert not (tmp_path / "cache" / "triton" / "3.6.0").exists()
    assert list((tmp_path / "cache" / "triton").iterdir()) == []  # no half-installed folder left


def _report(registers: int, spills: int = 0) -> triton_aot.CompileReport:
    configuration = triton_aot.Configuration("forward", "bfloat16", 64, 64, 32, 4, 2, False)
    return triton_aot.CompileReport(configuration, 90, registers, spills, 0, 36 * 1024, True)


def test_the_budget_is_240_registers_and_no_spills():
    assert triton_aot.MAX_REGISTERS == 240
    assert not _report(240).problems()
    assert _report(241).problems() == ["241 registers > 240"]
    assert _report(200, spills=8).problems() == ["spills 8 B stores / 0 B loads"]
    assert triton_budget.problems([_report(240), _report(255)]) == [
        f"{_report(255).configuration} sm_90: 255 registers > 240"]


def test_a_launch_that_a_later_triton_changes_is_shown_from_that_version_on():
    """The registers table names each launch of a binary, and the version it starts with."""
    import dataclasses

    capped = _report(200)
    one_stage = dataclasses.replace(capped, configuration=dataclasses.replace(
        capped.configuration, num_stages=1, max_registers=240))
    results = {version: {"status": "checked", "reports": [dataclasses.asdict(report)]}
               for version, report in (("3.7.1", capped), ("3.8.0", one_stage), ("3.9.0", one_stage))}
    row = next(line for line in triton_budget.markdown(results).splitlines()
               if line.startswith("| bfloat16 | forward | 64 |"))
    assert row == ("| bfloat16 | forward | 64 | 64 x 32, 4 w, 2 s; from 3.8.0: 64 x 32, 4 w, 1 s, cap 240 "
                   "| 200 | 200 | 200 |")


SASS = """Function:kernel
--:-:-:-:2\tIMAD R1, R2, R3, RZ;
LBB0:
--:-:-:-:3\tUIADD3 UR5, UR5, 0x1, URZ;
LBB1:
--:-:-:-:4\tHGMMA.64x32x16.F32.BF16 R56, gdesc[UR28], RZ, !UPT;
--:-:-:-:1\t@P0 ISETP.GE.AND P1, PT, R4, R5, PT;
--:-:-:-:2\tLDG.E R6, desc[UR4][R8.64];
--:-:-:-:1\tFFMA R7, R7, R6, R5;
--:-:-:-:6\t@P1 BRA LBB1;
--:-:-:-:3\tUIADD3 UR6, UR6, 0x1, URZ;
--:-:-:-:5\t@P0 BRA LBB0;
--:-:-:-:5\tEXIT;
"""


def test_the_tile_loop_is_the_innermost_loop_with_the_products():
    """Both loops hold the product: the inner one is the tile loop; without products, the
    longest loop."""
    loop = triton_aot.tile_loop(SASS)
    assert loop["total"] == 5 and loop["tensor core"] == 1 and loop["predicate"] == 1
    assert loop["memory"] == 1 and loop["floating point"] == 1 and loop["uniform"] == 0
    assert loop["sync and control"] == 1 and loop["stall_cycles"] == 4 + 1 + 2 + 1 + 6
    assert loop["tensor_flops"] == 2 * 64 * 32 * 16 // 4
    without_products = triton_aot.tile_loop(SASS.replace("HGMMA.64x32x16.F32.BF16", "FMUL"))
    assert without_products["total"] == 8 and without_products["uniform"] == 2
    assert triton_aot.tile_loop("--:-:-:-:5\tEXIT;") is None


def test_a_loop_inside_the_tile_loop_is_counted_as_nested():
    """The dQ kernel's loop over a tile's edge types (no products) lies inside the tile loop:
    its instructions are in the tile loop's once, and in ``nested``."""
    inner = "LBB2:\n--:-:-:-:2\tFADD R9, R9, R7;\n--:-:-:-:3\t@P2 BRA LBB2;\n"
    loop = triton_aot.tile_loop(SASS.replace("--:-:-:-:6\t@P1 BRA LBB1;", inner + "--:-:-:-:6\t@P1 BRA LBB1;"))
    assert loop["total"] == 7 and loop["tensor core"] == 1
    assert loop["nested"] == 2 and loop["nested_stall_cycles"] == 2 + 3
    assert triton_aot.tile_loop(SASS)["nested"] == 0


def test_of_two_loops_with_as_many_products_the_longer_is_the_tile_loop():
    """The dQ kernel's relative-key term runs a short loop after the tile loop with as many
    products at head dim 32: the tile loop is the longer one, not the later one."""
    tile_loop = SASS.split("LBB0:\n")[1].split("--:-:-:-:3\tUIADD3 UR6")[0]
    term = "LBB2:\n--:-:-:-:4\tHGMMA.64x32x16.F32.BF16 R56, gdesc[UR28], RZ, !UPT;\n--:-:-:-:6\t@P1 BRA LBB2;\n"
    loop = triton_aot.tile_loop("Function:kernel\n" + tile_loop + term + "--:-:-:-:5\tEXIT;\n")
    assert loop["total"] == 5 and loop["memory"] == 1
