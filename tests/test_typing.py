"""mypy sees the kernel seam and the traffic kinds: a wrong argument, a drift or a misspelt kind is a type error.

Each op's signature is written once, on its reference; its launcher and its entry point are declared
``@signature_of(<op>_ref)`` (``kernels/_signature.py``). One mypy run with the project's configuration on
a small file checks that correct calls pass, that wrong ones are reported on the lines marked ``# E``,
and that a function declared with an op's signature but drifting from it is rejected.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

import pytest

import lightning_scape.kernels as K

mypy_api = pytest.importorskip("mypy.api")

_REPO = Path(__file__).resolve().parents[1]

# Lines ending in "# E" must be reported by mypy, and no other line may be.
_CHECKED = '''
from torch import Tensor

import lightning_scape.kernels as K
from lightning_scape.comm import ByteCounters, Wire
from lightning_scape.kernels._signature import signature_of


def correct(p: Tensor, v: Tensor, mask: Tensor, hyper: K.AdamSHyper) -> Tensor:
    K.scatter_decay(p, v, mask, 4096, 0.5)
    K.scatter_decay_ref(p, v, mask, chunk_size=4096, decay=0.5)
    K.scatter_decay_triton(p, v, mask, 4096, 0.5)
    K.ef_compact(p, v, mask, 4096, v)
    K.sparse_adams(p, p, p, v, mask, 4096, v, hyper)
    K.dense_adams(p, p, None, hyper)
    K.chunk_topk_ref(p, 8, k=3, k_explore=0, explore_offset=0)
    return K.select_mask(p, p, 0.9, "momentum", 4096, 40, 4, 0)


def wrong(p: Tensor, v: Tensor, mask: Tensor, hyper: K.AdamSHyper) -> None:
    K.scatter_decay(p, v, mask, "4096", 0.5)  # E
    K.scatter_decay_triton(p, v, mask, 4096, 0.5, 1)  # E
    K.ef_compact_ref(p, v, mask, 4096)  # E
    K.dense_adams(p, p, p, 0.9)  # E
    K.sparse_adams_triton(p, p, p, v, mask, 4096.0, v, hyper)  # E
    K.chunk_topk(p, 8, k=3, k_explore=0, offset=0)  # E
    ok: bool = K.select_mask_ref(p, p, 0.9, "momentum", 4096, 40, 4, 0)  # E


def traffic(counters: ByteCounters, wire: Wire, t: Tensor) -> None:
    counters.add("dense", 8)
    wire.all_reduce_sum("values", t)
    counters.add("dens", 8)  # E
    print(counters.step_sent["indicies"])  # E
    wire.all_gather("param", t, t)  # E


@signature_of(K.scatter_decay_ref)  # E
def drifted_type(params: Tensor, values: Tensor, mask: Tensor, chunk_size: int, decay: int) -> None:
    """A launcher whose decay drifted to int."""


@signature_of(K.chunk_topk_ref)  # E
def drifted_name(scores: Tensor, chunk_size: int, k: int, k_explore: int, offset: int) -> Tensor:
    """An entry point whose explore_offset drifted to offset."""
    return scores
'''


def test_mypy_checks_calls_and_signatures_of_the_kernel_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checked = tmp_path / "kernel_seam.py"
    checked.write_text(textwrap.dedent(_CHECKED).lstrip())
    expected = {i for i, line in enumerate(checked.read_text().splitlines(), 1) if line.endswith("# E")}
    # From the repository root mypy resolves lightning_scape from the sources. The options are the project's
    # own (no --follow-imports=silent): mypy keys its cache by them, so this run and `mypy` share the warm
    # default cache and take about a second each, where differing options made each invalidate the other.
    monkeypatch.chdir(_REPO)
    stdout, stderr, status = mypy_api.run(["--config-file", str(_REPO / "pyproject.toml"), "--no-pretty", str(checked)])
    # Only the line numbers: a fresh cache entry may replay the errors of an earlier run under its tmp path.
    reported = {int(m.group(1)) for m in re.finditer(r"^\S*kernel_seam\.py:(\d+): error:", stdout, re.M)}
    assert status == 1, stdout + stderr
    assert reported == expected, stdout


def test_each_op_and_its_ref_and_launcher_have_one_signature_at_run_time() -> None:
    # mypy holds the source to one signature; this holds what runs to it (annotations compare as written).
    ops = [n for n in K.__all__ if f"{n}_ref" in K.__all__ and f"{n}_triton" in K.__all__]
    assert len(ops) == 7, ops
    for name in ops:
        entry, ref, launcher = (getattr(K, name + suffix) for suffix in ("", "_ref", "_triton"))
        assert inspect.signature(entry) == inspect.signature(ref) == inspect.signature(launcher), name
