"""The prepared GPU check (``bench.gpu_check``) and its kernel profile (``bench.kernel_profile``)
on the CPU: the package list and its check, the report and its header, pytest's summary read
back, a step killed at its limit with its children, the budget, and one decode step profiled on
a tiny model. The GPU machine runs the steps themselves."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check, gpu_header, kernel_profile
from bench.gpu_check import (
    Check,
    Step,
    StepResult,
    parse_args,
    run_steps,
    step_limit,
    write_report,
)
from bench.gpu_packages import Package, check_packages, parse_packages, read_packages
from bench.processes import run_command
from bench.pytest_summary import parse_pytest
from bench.served_twins import NEAR_TIE, Completion, compare

H100 = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.65.06", "cuda": "13.0",
        "torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3", "cpu": "AMD EPYC 9454",
        "cpu_cores": 16, "platform": "Linux", "commit": "feed" * 10, "date": "2026-11-27",
        "slug": "nvidia-h100-80gb-hbm3"}
PYTEST_OUTPUT = """\
bringing up nodes...
.FsE..                                                                   [100%]
=================================== FAILURES ===================================
>   assert 1 == 2
=========================== short test summary info ============================
FAILED tests/test_a.py::test_fail - AssertionError: one is not two
ERROR tests/test_a.py::test_err - RuntimeError: fixture broke
SKIPPED [3] tests/test_a.py:4: CPU only: the C++ kernels
4 failed, 120 passed, 3 skipped, 967 deselected, 2 warnings, 1 error in 81.43s (0:01:21)
"""


def test_package_lines_name_their_module_and_flags() -> None:
    packages = parse_packages("# a comment\n\nstarlette==1.10.0\n"
                              "rpds-py==2026.9.1 rpds  # its import name\n"
                              "Jinja2==3.1.6 jinja2 (preinstalled)\nninja==1.13.2 (optional)\n"
                              "typing-inspection==0.4.5\n")
    assert packages == [Package("starlette", "1.10.0", "starlette"),
                        Package("rpds-py", "2026.9.1", "rpds"),
                        Package("Jinja2", "3.1.6", "jinja2", preinstalled=True),
                        Package("ninja", "1.13.2", "ninja", optional=True),
                        Package("typing-inspection", "0.4.5", "typing_inspection")]


@pytest.mark.parametrize("line", ["starlette", "starlette>=1.0", "a==1 b c", "a==1 (later)"])
def test_a_malformed_package_line_is_an_error(line: str) -> None:
    with pytest.raises(ValueError, match="line 1"):
        parse_packages(line)


def test_every_required_package_listed_imports_here() -> None:
    statuses = check_packages([p for p in read_packages() if not p.optional])
    assert [s.package.name for s in statuses if s.missing] == []


def test_the_check_tells_missing_packages_from_other_versions() -> None:
    missing, other, same = check_packages([
        Package("no-such-package-tidal", "1.0", "no_such_package_tidal"),
        Package("pytest", "0.0.1", "pytest"), Package("pytest", pytest.__version__, "pytest")])
    assert missing.missing and missing.found is None and "ModuleNotFoundError" in missing.error
    assert other.other_version and not other.missing and other.found == pytest.__version__
    assert not same.missing and not same.other_version


def test_packages_prints_the_wheels_to_carry(capsys: pytest.CaptureFixture[str]) -> None:
    packages = read_packages()
    assert gpu_check.main(["--packages"]) == 0
    carried = capsys.readouterr().out.split()
    assert carried == [f"{p.name}=={p.version}" for p in packages if not p.preinstalled]
    assert "openai==" + next(p.version for p in packages if p.name == "openai") in carried
    assert not any(line.startswith("numpy==") for line in carried)
    gpu_check.main(["--packages", "all"])
    assert len(capsys.readouterr().out.split()) == len(packages)


def test_pytest_output_gives_counts_failures_and_skips() -> None:
    outcome = parse_pytest(PYTEST_OUTPUT)
    assert outcome.counts == {"failed": 4, "passed": 120, "skipped": 3, "deselected": 967,
                              "errors": 1}
    assert outcome.failures == ["FAILED tests/test_a.py::test_fail - AssertionError: one is "
                                "not two", "ERROR tests/test_a.py::test_err - RuntimeError: "
                                "fixture broke"]
    assert outcome.skips == ["SKIPPED [3] tests/test_a.py:4: CPU only: the C++ kernels"]
    assert parse_pytest("collected 0 items\n\nno tests ran in 0.01s\n").counts == {}
    assert parse_pytest("killed halfway\n").final_line == ""


def test_a_killed_suite_still_names_its_failures_so_far() -> None:
    """pytest ``-v`` under xdist prints a line per test; a run killed before its summary is
    read from those."""
    output = ("bringing up nodes...\n"
              "[gw0] [  1%] PASSED tests/test_a.py::test_one \n"
              "[gw1] [  2%] FAILED tests/test_b.py::test_two[bf16] \n"
              "[gw0] [  3%] SKIPPED tests/test_a.py::test_cpu \n"
              "[gw1] [  4%] ERROR tests/test_b.py::test_three \n")
    outcome = parse_pytest(output)
    assert outcome.counts == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}
    assert outcome.failures == ["FAILED tests/test_b.py::test_two[bf16]",
                                "ERROR tests/test_b.py::test_three"]


def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(child.pid, flush=True)\ntime.sleep(60)\n")
    run = run_command([sys.executable, "-c", script], 3, tmp_path / "step.log")
    assert run.timed_out and run.wall_s < 20
    grandchild = int(run.output.split()[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild):  # killed with its group; init reaps it
        assert time.monotonic() < deadline, "the step's own child outlived it"
        time.sleep(0.1)
    done = run_command([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], 30,
                       tmp_path / "quick.log")
    assert (done.returncode, done.output, done.timed_out) == (3, "hi\n", False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def _check(tmp_path: Path, *argv: str) -> Check:
    check = Check(parse_args(["--out-dir", str(tmp_path / "results"), *argv]), tmp_path / "logs")
    check.header = dict(H100)
    return check


def test_steps_run_in_turn_and_the_report_is_rewritten_after_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    check = _check(tmp_path, "--commit", "abc123", "--limit", "suite=2")
    report = tmp_path / "results" / "gpu_check-nvidia-h100-80gb-hbm3.md"

    def first(check: Check, limit: float) -> StepResult:
        return StepResult("packages", "passed", 1.5, limit, "54 listed: 0 required missing")

    def hung(check: Check, limit: float) -> StepResult:
        assert "| packages | passed | 1.5 |" in report.read_text()  # written before this
        run = run_command([sys.executable, "-c", "import time; time.sleep(60)"], limit,
                          check.log("suite"))
        return gpu_check.failed_run("suite", run, limit, "pytest")

    def last(check: Check, limit: float) -> StepResult:
        return StepResult("served", "passed", 3.0, limit, "int4: 4/4 texts alike", "| a |")

    results = run_steps(check, [Step("packages", first), Step("suite", hung),
                                Step("served", last)])
    assert [(r.name, r.status) for r in results] == [
        ("packages", "passed"), ("suite", "timeout"), ("served", "passed")]
    assert results[1].limit_s == 2 and (tmp_path / "logs" / "gpu_suite.log").is_file()
    paths = write_report(check, done=True)
    assert paths == [report, tmp_path / "out" / "gpu_check.md"]
    text = report.read_text()
    assert text == paths[1].read_text()
    for expected in ("# GPU check: NVIDIA H100 80GB HBM3", "driver 580.65.06", "CUDA 13.0",
                     "torch 2.11.0+cu130, Triton 3.6.0, Python 3.12.3", "commit: abc123",
                     "AMD EPYC 9454, 16 cores", "| suite | timeout |", "killed at its 2 s limit",
                     "## served: passed (3.0 s)", "total wall time: "):
        assert expected in text


def test_a_missing_required_package_leaves_the_rest_skipped(tmp_path: Path) -> None:
    check = _check(tmp_path)
    missing = StepResult("packages", "failed", 1.0, 90, "1 required missing", data={
        "missing": ["xgrammar"]})
    results = run_steps(check, [Step("packages", lambda c, limit: missing),
                                Step("suite", lambda c, limit: pytest.fail("ran"))])
    assert results[1].status == "skipped" and "required package" in results[1].summary


def test_the_budget_cuts_a_step_to_what_the_later_ones_leave(tmp_path: Path) -> None:
    check = _check(tmp_path, "--budget", "400")
    later = ["roofline", "profile", "served"]
    kept = sum(gpu_check.RESERVES_S[s] for s in later)
    assert step_limit(check, "suite", later) == pytest.approx(400 - kept, abs=1)
    assert step_limit(check, "served", []) == gpu_check.LIMITS_S["served"]
    check.started -= 390  # ten seconds left: a step gets them, never more
    assert step_limit(check, "roofline", ["served"]) == pytest.approx(10, abs=1)


def test_the_header_names_this_machine_and_commit(tmp_path: Path) -> None:
    header = gpu_header.collect_header("cpu")
    assert header["slug"] == "cpu" and header["python"] == ".".join(
        map(str, sys.version_info[:3]))
    assert header["cpu_cores"] == os.cpu_count() and header["torch"]
    check = _check(tmp_path)
    check.header = {**header, "commit": None}
    assert "- commit: unknown" in gpu_check.render_report(check)
    check.args.commit = "0123abc"
    assert "- commit: 0123abc" in gpu_check.render_report(check)
    assert write_report(check)[0].name == "gpu_check-cpu.md"


def test_served_text_is_compared_by_leading_characters_and_tokens() -> None:
    twin = Completion("To be or not", ["To", " be", " or", " not"], [-1.0, -0.5, -0.25, -2.0])
    served = Completion("To be, or", ["To", " be", ",", " or"], [-1.01, -0.45, -0.3, -1.0])
    result = compare("HAMLET:", served, twin)
    assert (result.same_text, result.chars, result.tokens) == (False, 5, 2)
    assert result.max_logprob_diff == pytest.approx(0.05)
    assert not result.agrees  # a server's completion has no margins to excuse it
    assert compare("x", twin, twin).same_text and compare("x", twin, twin).agrees


def test_served_tokens_may_part_from_the_twin_only_at_a_near_tie() -> None:
    twin = Completion("ab", ["a", "b"], [-0.1, -0.2], margins=[2.9, 1.8])
    served = Completion("ax", ["a", "x"], [-0.1, -0.5])
    assert not compare("p", served, twin).agrees
    twin.margins[1] = NEAR_TIE / 2
    assert compare("p", served, twin).agrees
    assert not compare("p", Completion("a", ["a"], [-0.1]), twin).agrees  # one token short


def test_kernel_profile_of_a_tiny_model_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = kernel_profile.main(["--device", "cpu", "--tiny", "--cpu-kernels", "off",
                                  "--batch", "1", "--batch", "3", "--warmup", "1", "--top", "5",
                                  "--model-root", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["unit"] == "CPU op" and result["dtype"] == "float32"
    assert [b["batch"] for b in result["batches"]] == [1, 3]
    for b in result["batches"]:
        assert b["kernels"] > 10 and 0 < b["kernel_us"] <= 1.05 * b["profiled_wall_us"]
        assert b["eager_ms"] > 0 and b["graph_ms"] is None
        totals = [row["total_us"] for row in b["top"]]
        assert len(totals) == 5 and totals == sorted(totals, reverse=True)
        assert 0 < sum(row["share"] for row in b["top"]) <= 1 + 1e-9
    text = kernel_profile.markdown(result)
    assert "| CPU op | calls | total us | share |" in text and "**Batch 3**" in text


@pytest.mark.slow
def test_the_check_rehearsed_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile and the served comparison through the whole machinery: children, JSON,
    the report (on the CPU the twin and the server run the same ops: identical texts)."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    code = gpu_check.main(["--device", "cpu", "--only", "profile", "--only", "served",
                           "--only", "matmul", "--served", "int8", "--profile-args",
                           "--batch 2", "--out-dir", str(tmp_path)])
    text = (tmp_path / "gpu_check-cpu.md").read_text()
    assert code == 0, text
    assert "| profile | passed |" in text and "| served | passed |" in text
    assert "| matmul | passed |" in text and "| lm_head | 1024x64 | 8 |" in text
    assert (tmp_path / "out" / "gpu_check-matmul.json").is_file()
    assert "int8: 4/4 texts alike" in text and (tmp_path / "out" / "gpu_check.md").is_file()
