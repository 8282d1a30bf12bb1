"""README.md's test command is what .ci/run runs, and its set-up commands install the torch that CI tests.

The test command is the ```bash block right after the line that names `.ci/run` (wherever it stands in the
README, whatever it runs).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)\n```$", re.M | re.S)
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


def test_readme_setup_commands_install_the_torch_ci_tests() -> None:
    ci_pins = set(TORCH_PIN.findall(CI.read_text()))
    assert len(ci_pins) == 1, ci_pins
    installs = [cmd for _, cmd in _bash_blocks() if "pip install" in cmd]
    assert installs
    for cmd in installs:
        assert set(TORCH_PIN.findall(cmd)) == ci_pins, cmd
