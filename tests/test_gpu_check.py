"""``benchmarks/gpu_check.py`` on the CPU: the whole command at its tiny size, the kernels in Triton's interpreter."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import FINAL_RTOL, STEP_RTOL, losses_agree

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.dist
def test_tiny_run_checks_the_kernels_trains_on_them_and_writes_the_report(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("litgpt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "LIGHTNING_SCAPE_FORCE"))}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        # --no-scale: the scale run has its own test (tests/test_scale.py), and so has the time it is given.
        [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--no-scale", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and not report["device"]["cuda"]
    assert report["kernel_check"] == {"fp32": [], "bf16": []}
    # The alternatives' check ran (at these chunk sizes they take the default's path; tests/test_kernels.py checks them
    # where they differ, C >= 1024).
    assert report["alternative_check"] == {"fp32": [], "bf16": []}
    assert "scale" not in report
    training = report["training"]
    # The first run trained on the (interpreted) kernels in every bucket, the second on the references.
    assert set(training["kernel"]["bucket_paths"]) == {"triton"}
    assert set(training["reference"]["bucket_paths"]) == {"ref"}
    assert len(training["kernel"]["losses"]) == training["size"]["steps"] == 4
    assert training["agreement"]["agree"]
    # Past the dense warm-up step and the dense ramp step the run is sparse, and it learns.
    assert training["size"]["dense_warmup_steps"] + training["size"]["density_ramp_steps"] < 4
    assert training["kernel"]["losses"][-1] < training["kernel"]["losses"][0]
    md = (tmp_path / "report.md").read_text()
    assert "No CUDA GPU" in md and "Nothing here is a measurement" in md and "Result: **pass**" in md


def test_losses_agree_step_by_step_and_at_the_end() -> None:
    ref = [4.0 - 0.01 * i for i in range(100)]
    assert losses_agree(list(ref), ref)["agree"]
    close = [v * (1 + 0.5 * FINAL_RTOL) for v in ref]
    assert losses_agree(close, ref)["agree"]
    spike = list(ref)
    spike[40] *= 1 + 2 * STEP_RTOL  # one step far off
    assert not losses_agree(spike, ref)["agree"]
    drift = [v * (1 + 2 * FINAL_RTOL) for v in ref]  # every step within STEP_RTOL, the end too far
    result = losses_agree(drift, ref)
    assert not result["agree"] and result["max_step_rel_diff"] <= STEP_RTOL
    assert not losses_agree([*ref[:-1], math.nan], ref)["agree"]
    with pytest.raises(ValueError, match="compare equal, non-empty runs"):
        losses_agree(ref[:10], ref)


def test_an_alternative_selection_kernel_that_raises_is_a_failure_line_not_the_end_of_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU an alternative may not compile or run; the check names it and goes on (the scale run must follow)."""
    import torch

    from benchmarks import bench_kernels

    def broken(*args: object) -> list[str]:
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(bench_kernels, "compare_op", broken)
    failures = bench_kernels.check_alternatives("cpu", torch.float32, 0.1, cases=((64, 0.1, 2),))
    assert failures == [
        f"{op}[{name}] raised" for name in bench_kernels.ALTERNATIVES for op in bench_kernels.SELECT_OPS
    ]
