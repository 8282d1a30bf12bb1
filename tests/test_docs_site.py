"""The documentation site: it builds with no warning (broken links, anchors, docstrings griffe cannot read), every
page of ``docs/`` is in its navigation, and every name ``import lightning_scape`` exports has a reference entry."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

import lightning_scape

ROOT = Path(__file__).resolve().parents[1]
# Exports that are not a class or function to document: the version string and the Trainer's subpackage (its
# classes have entries of their own).
NOT_DOCUMENTED = {"__version__", "pytorch"}


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_every_page_of_docs_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(_nav_pages(config["nav"])) == pages


def test_every_export_has_a_reference_entry() -> None:
    entries = set(re.findall(r"^::: (\S+)$", (ROOT / "docs" / "reference.md").read_text(), flags=re.M))
    missing = {f"lightning_scape.{name}" for name in lightning_scape.__all__ if name not in NOT_DOCUMENTED} - entries
    assert not missing, f"add these to docs/reference.md: {sorted(missing)}"
    trainer = {f"lightning_scape.pytorch.{name}" for name in ("ScapeStrategy", "ScapeFSDPStrategy")}
    assert trainer <= entries


def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("ScapeStrategy", "ScapeConfig", "AdamS", "density"):  # a class, its arguments, an option
        assert name in reference
