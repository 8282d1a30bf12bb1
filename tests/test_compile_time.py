"""``benchmarks/compile_time.py``: Triton's specialization rule, the kernel variants SCAPE's schedule compiles, and
the command's ``--tiny`` run.

The variants are counted by the rule, without a GPU: every launch the ops would make on CUDA is recorded with its
specialization key (``compile_time.recording``), and each distinct key of a kernel is one compilation. The GPU
command reads Triton's own count beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import lightning_scape.kernels as K
from benchmarks import compile_time as ct
from lightning_scape.kernels._triton import slot_block

REPO = Path(__file__).resolve().parents[1]

# Variants compiled over the dense warm-up and the whole default density ramp (C = 4096, k from 1024 down to the
# final density's), both SCAPE methods of the scale run (benchmarks.scale: d = 0.01, and the int8 wire at
# d = 0.025), fp32 parameters. Each bound is what the kernels' launches can still vary in (docs/kernels.md,
# "Compile time"); 69 variants before k, k_explore, the exploration offset, the step and the slot counts were
# taken out of the keys and the slot blocks floored at 256:
RAMP_VARIANTS = {
    # _select_config's configurations the ramp passes through: the plain selection (k > 512) and the prefilter
    # with 512, 256, 128 and 64 candidate groups (k down to 41). Was 21: their classes of k, k_explore and offset.
    "_select_kernel": 5,
    # slot_block(k): 1024, 512, 256. Was 10: five powers of two, times k divisible by 16 or not.
    "_ef_compact_kernel": 3,
    # The same three slot blocks, with and without weight decay (the matrices' and the vectors' param groups).
    "_scatter_decay_kernel": 6,
    # One launch configuration. Was 8: classes of the slot count, k, the step and the mask rows' address.
    "_sparse_adams_kernel": 1,
    # The dense steps: n is a bucket's region, a multiple of the chunk size.
    "_dense_adams_kernel": 1,
    # The int8 wire: BLOCK, k's power of two (1024 down to 128), times k divisible by 16 or not; the dense steps'
    # group of 256 is one of them. Left specialized: the dense steps read whole buckets through it.
    "_round_int8_kernel": 8,
}


def small_model() -> nn.Module:
    """Two buckets of whole 4096-coordinate chunks at W = 2 (a matrix group of 432 chunk rows a rank, a vector group
    of one), so the schedule's k, k_explore and offsets are the 110M-parameter model's."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(768, 2304), nn.Linear(2304, 768), nn.LayerNorm(768))


def test_slot_blocks_are_powers_of_two_from_256_to_1024() -> None:
    assert [slot_block(k) for k in (0, 1, 41, 255, 256, 257, 410, 512, 513, 1024, 4096)] == [
        *(256, 256, 256, 256, 256, 512, 512, 512, 1024, 1024, 1024)
    ]


def test_the_rule_is_tritons_own() -> None:
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this triton has no native specialize_impl to compare with")
    t = torch.zeros(64)
    i16 = torch.zeros(64, dtype=torch.int16)
    values = [0, 1, 2, 15, 16, 17, 48, -16, 2**31 - 1, 2**31, 2**40, 0.5, 1.0, True, None, t, t[1:], t[4:], i16[8:]]
    values.append(i16[1:])
    for value in values:
        for specialize, align in ((True, True), (False, True), (True, False)):
            ours = ct.arg_key(value, specialize, align)
            theirs = native_specialize_impl(BaseBackend, value, False, specialize, align)
            if isinstance(value, torch.Tensor):  # the dtype is spelled differently; the key must agree
                assert ours[1] == theirs[1], (value.data_ptr() % 16, specialize, align, ours, theirs)
            else:
                assert tuple(ours) == tuple(theirs), (value, specialize, align, ours, theirs)


def test_recording_keys_the_launches_and_puts_every_kernel_back() -> None:
    kernel_before = ct.kernels()["_ef_compact_kernel"]
    gen = torch.Generator().manual_seed(0)
    C, rows = 4096, 3
    with ct.recording(run_kernels=False) as log:
        for k in (41, 48, 300):  # 48 is divisible by 16, 41 is not: one key; 300 has a larger slot block
            e, g = torch.randn(rows * C, generator=gen), torch.randn(rows * C, generator=gen)
            mask = torch.rand(rows, C, generator=gen).argsort(dim=1)[:, :k].to(torch.int16).contiguous()
            e_ref, out, out_ref = e.clone(), torch.empty(rows * k), torch.empty(rows * k)
            K.ef_compact(e, g, mask, C, out)  # on CPU tensors: recorded as on CUDA, computed by the ref
            K.ef_compact_ref(e_ref, g, mask, C, out_ref)
            assert torch.equal(out, out_ref) and torch.equal(e, e_ref)
    assert log.variants() == {"_ef_compact_kernel": 2} and log.calls == {"_ef_compact_kernel": 3}
    (sig_a, opts), (sig_b, _) = sorted(log.keys["_ef_compact_kernel"], key=str)
    assert dict(opts)["num_warps"] == 8
    assert {sig_a[-1], sig_b[-1]} == {("constexpr", 256), ("constexpr", 512)}  # SLOT_BLOCK
    assert sig_a[4] == ("i32", None)  # k: not specialized
    assert ct.kernels()["_ef_compact_kernel"] is kernel_before
    assert not K.use_triton(torch.zeros(1))  # the dispatch is the CPU's again


@pytest.mark.dist
def test_the_default_ramp_compiles_few_variants() -> None:
    # About 15 s: 432 steps of each method on two simulated ranks (launches recorded, nothing computed).
    shared = ct.schedule_shared(False, torch.device("cpu"), small_model())
    keys: dict[str, set[ct.Key]] = {}
    for method in ct.METHODS:
        _, log = ct.schedule_launches(method, shared, 1000, run_kernels=False, compute=False)
        assert log.calls["_select_kernel"] > 500  # the whole ramp: a mask per bucket and rank at every step
        for kernel, ks in log.keys.items():
            keys.setdefault(kernel, set()).update(ks)
    variants = {kernel: len(ks) for kernel, ks in keys.items()}
    assert set(variants) == set(RAMP_VARIANTS), variants
    over = {kernel: n for kernel, n in variants.items() if n > RAMP_VARIANTS[kernel]}
    assert not over, f"more variants than bounded (docs/kernels.md, 'Compile time'): {over}"


@pytest.mark.dist
def test_tiny_command_compiles_counts_and_times_on_the_cpu() -> None:
    pytest.importorskip("litgpt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "LIGHTNING_SCAPE_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_time", "--tiny", "--methods", ",".join(ct.METHODS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "NOT a measurement" in out and "(empty)" in out
    for method in ct.METHODS:
        assert f"\n{method}: 1 dense warm-up + 5 ramp steps on 2 simulated ranks" in out
    assert "_select_kernel" in out and "_round_int8_kernel" in out
    assert "SCAPE sparse step / fused AdamW step" in out and "specialized as before (ratio" in out
