"""docs/lightning.md's Trainer and Fabric examples run as written, and print what the page shows.

Every ```python block of the page whose first line is ``# NAME.py`` is saved as ``NAME.py`` and run with
``python NAME.py`` (two CPU processes each, started by Lightning); the ```text block after it shows lines of
its output, and the byte counts among them must be what the run printed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON, child_env

from lightning_scape.examples.workloads import free_port

DOC = Path(__file__).resolve().parent.parent / "docs" / "lightning.md"
EXAMPLE = re.compile(r"```python\n(# (\w+\.py)[^\n]*\n.*?)```(.*?)```text\n(.*?)```", re.S)
BYTES_LINE = re.compile(r"^(last step|whole run): sent ([\d,]+) bytes, DDP would send ([\d,]+)$", re.M)
EXAMPLES = ("train_trainer.py", "train_fabric.py")
SUMMARY = re.compile(r"```text\n(lightning_scape: SCAPE run summary.*?)```", re.S)


def _examples() -> dict[str, tuple[str, str]]:
    """Example name -> (its code, the output the page shows after it)."""
    return {m.group(2): (m.group(1), m.group(4)) for m in EXAMPLE.finditer(DOC.read_text())}


def test_the_page_holds_both_examples_with_their_output() -> None:
    assert set(EXAMPLES) <= set(_examples()), sorted(_examples())


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Both examples, started together (each mostly waits for its second process to start)."""
    folder = tmp_path_factory.mktemp("doc_examples")
    procs = {}
    for name, (code, _) in _examples().items():
        (folder / name).write_text(code)
        env = child_env(MASTER_PORT=str(free_port()))
        env.pop("PYTHONWARNINGS")  # a warm-up warning must show, if there were one
        procs[name] = subprocess.Popen(
            [PYTHON, name], cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", EXAMPLES)
def test_the_example_runs_and_prints_the_bytes_the_page_shows(
    name: str, example_runs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    run = example_runs[name]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # The byte lines the page shows are the ones the run printed, to the byte.
    shown = [m.group(0) for m in BYTES_LINE.finditer(_examples()[name][1])]
    assert [m.group(0) for m in BYTES_LINE.finditer(run.stdout)] == shown and len(shown) == 2, run.stdout
    printed = {m.group(1): (int(m.group(2).replace(",", "")), int(m.group(3).replace(",", "")))
               for m in BYTES_LINE.finditer(run.stdout)}  # fmt: skip
    # DDP's 2 (W-1)/W N b for the 2,177 parameters, W = 2: per step, and over the 500 steps.
    ddp_step = 2 * 1 * 2_177 * 4 // 2
    assert printed["last step"][1] == ddp_step and printed["whole run"][1] == 500 * ddp_step
    # A sparse step sends ~1% of the values with indices and parameters; the 30 warm-up steps and the first 120
    # of the ramp send DDP's bytes (the chunks are sized to this small model, so no padding is sent), the other
    # 280 ramp steps and the 70 after it at most 1/4 of the values with their indices and parameters:
    # (4 + 4 + 2) / 4 bytes each.
    assert printed["last step"][0] < ddp_step / 50
    assert 150 * ddp_step < printed["whole run"][0] < 150 * ddp_step + 350 * 2_177 * 10 // 4 // 2
    assert "then 1.01% of the coordinates per step (effective density; density=0.01)" in run.stderr
    notices = run.stderr.replace("(dense_warmup_steps)", "")
    if name == "train_trainer.py":  # the default schedule sends 35% of DDP's bytes here: said before the first step
        assert notices.count("this run has 500 optimizer steps") == 1 and "sends 35% of DDP's bytes" in notices
        assert "ScapeStrategy(dense_warmup_steps=15, density_ramp_steps=200)" in notices
    else:  # Fabric does not know the run's length; a run that left its dense steps hears nothing at the end
        assert "dense_warmup_steps=" not in notices.split("lightning_scape: SCAPE run summary")[0]
    # At the end rank 0 sums the run up, once; the page shows the Trainer example's summary: its bytes and steps
    # are the run's to the byte (the waiting is the machine's).
    assert run.stderr.count("lightning_scape: SCAPE run summary") == 1
    if name == "train_trainer.py":
        (shown,) = SUMMARY.findall(DOC.read_text())
        shown_lines = shown.splitlines()
        logged = run.stderr[run.stderr.index(shown_lines[0]) :].splitlines()[: len(shown_lines)]
        assert [logged[i] for i in (0, 1, 3)] == [shown_lines[i] for i in (0, 1, 3)], logged
