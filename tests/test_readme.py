"""README.md holds exactly two set-up commands, and .ci/run runs the test one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_two_setup_commands_pinning_torch() -> None:
    cmds = _commands()
    assert len(cmds) == 2
    assert all("torch==2.13.0" in c for c in cmds)
    assert "lightning-scape demo" in cmds[0] and "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci
