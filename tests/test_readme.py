"""README.md's test command is what .ci/run runs, its set-up commands install the torch that CI tests, and its
usage lines are the package's API.

The test command is the ```bash block right after the line that names `.ci/run` (wherever it stands in the
README, whatever it runs). The usage lines are the README's first ```python block: the Trainer, Fabric and the
FSDP form, built as written (nothing is launched).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from helpers import PYTHON, child_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)\n```$", re.M | re.S)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)\n```$", re.M | re.S)
TORCH_PIN = re.compile(r"\btorch==([\w.+]+)")


def _bash_blocks() -> list[tuple[str, str]]:
    """Every ```bash block of the README: (the last non-blank line before it, its commands)."""
    text = README.read_text()
    blocks = []
    for m in BASH_BLOCK.finditer(text):
        before = [line for line in text[: m.start()].splitlines() if line.strip()]
        blocks.append((before[-1] if before else "", m.group(1)))
    return blocks


def readme_test_command() -> list[str]:
    """The lines of the README's test command: the bash block that follows the line naming `.ci/run`."""
    found = [cmd for intro, cmd in _bash_blocks() if ".ci/run" in intro]
    assert len(found) == 1, f"README.md: expected one ```bash block after a line naming .ci/run, found {len(found)}"
    return [line for line in found[0].splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command() -> None:
    cmd = readme_test_command()
    ci = CI.read_text().splitlines()
    assert any(ci[i : i + len(cmd)] == cmd for i in range(len(ci))), (cmd, ci)


def test_the_test_command_runs_lint_types_and_both_test_lanes() -> None:
    script = " ".join(readme_test_command())
    if "tests/run_all.sh" in script:
        script += "\n" + (ROOT / "tests" / "run_all.sh").read_text()
    for step in ("ruff check", "ruff format --check", "mypy", '-m "not dist"', "-m dist"):
        assert step in script, f"README.md's test command does not run {step}"


def test_readme_setup_commands_install_the_torch_ci_tests() -> None:
    ci_pins = set(TORCH_PIN.findall(CI.read_text()))
    assert len(ci_pins) == 1, ci_pins
    installs = [cmd for _, cmd in _bash_blocks() if "pip install" in cmd]
    assert installs
    for cmd in installs:
        assert set(TORCH_PIN.findall(cmd)) == ci_pins, cmd


def test_the_readme_usage_lines_build_what_they_say(tmp_path: Path) -> None:
    usage = PYTHON_BLOCK.search(README.read_text())
    assert usage is not None, "README.md: no ```python block"
    for form in ('Trainer(strategy="scape"', "Fabric(strategy=lightning_scape.ScapeStrategy(", "ScapeFSDPStrategy("):
        assert form in usage.group(1), f"README.md's first python block lacks {form}"
    check = (
        "\nfrom lightning_scape.fabric import ScapeFSDPStrategy as FSDPForm, ScapeStrategy as FabricForm\n"
        "from lightning_scape.pytorch import ScapeStrategy as TrainerForm\n"
        "assert isinstance(trainer.strategy, TrainerForm), type(trainer.strategy)\n"
        "assert type(fabric.strategy) in (FabricForm, FSDPForm), type(fabric.strategy)\n"
        "print('built')\n"
    )
    script = tmp_path / "usage.py"
    script.write_text(usage.group(1) + check)
    # A fresh interpreter: `import lightning_scape` in the block must be what registers "scape".
    proc = subprocess.run([PYTHON, str(script)], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
