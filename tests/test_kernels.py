"""The Triton kernels against their pure-PyTorch references, in Triton's CPU interpreter (no GPU needed).

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is decorated: its own ``tl.sum`` and
``tl.cumsum`` when triton is first imported, the kernels when ``lightning_scape.kernels`` is. So this
module sets ``TRITON_INTERPRET=1`` before importing triton, when it is the first import. ``conftest.py`` imports
the package, which imports triton compiled for the GPU, so in any pytest run without ``TRITON_INTERPRET=1`` in
the environment every test here is deselected (:func:`runs_in_another_process`, read by ``conftest.py``) but
``test_kernels_in_a_fresh_interpreter_process``, which runs this file in a fresh process with it set, in the
multi-process lane (``pytest -m dist``). ``TRITON_INTERPRET=1 pytest tests/test_kernels.py`` runs them here.

Exact equality is required wherever the kernel does what the ref does with the same rounding (indices,
error feedback, scatter/decay); the AdamS math is compared with per-dtype tolerances because PyTorch's
CPU ``sqrt`` is not correctly rounded while the kernels use IEEE ``sqrt_rn`` (last-bit differences).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: see the docstring
pytest.importorskip("triton")

import lightning_scape.kernels as K
from lightning_scape import AdamS, ScapeConfig, ScapeEngine
from lightning_scape.kernels._triton import HAS_TRITON, tl, triton

# By module path: the package's ``chunk_topk`` attribute is the op, not its module.
select_module: Any = importlib.import_module("lightning_scape.kernels.chunk_topk")

_REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = [n for n in K.__all__ if n.endswith("_triton") and n != "use_triton"]
_FRESH_PROCESS_TEST = "test_kernels_in_a_fresh_interpreter_process"
# Tests that start their own process, so they run whatever this process imported triton for.
_OWN_PROCESS_TESTS = (_FRESH_PROCESS_TEST, "test_compiled_kernels_match_refs_on_cuda")

# (rows, chunk_size): odd row counts, tiny to default chunks (4096 only with few rows: the interpreter
# runs every program of the grid one after the other in numpy).
SHAPES = [(3, 8), (7, 64), (3, 4096)]
DENSITIES = [1e-3, 1e-2, 0.1, 1.0]


def slots(density: float, chunk_size: int) -> int:
    """k = max(1, round(d * C)), as ScapeConfig.slots_per_chunk."""
    return max(1, round(density * chunk_size))


def random_mask(rows: int, chunk_size: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct chunk-local indices per row, in random (not ascending) order."""
    return torch.rand(rows, chunk_size, generator=gen).argsort(dim=1)[:, :k].to(torch.int16).contiguous()


def runs_in_another_process(item: pytest.Item) -> bool:
    """Whether ``item`` cannot run in this process and runs in a fresh one instead (``conftest.py`` deselects it):
    a test of the interpreted kernels when triton was imported compiled for the GPU before this module."""
    return not K.INTERPRETED and getattr(item, "originalname", item.name) not in _OWN_PROCESS_TESTS


@pytest.fixture(autouse=True)
def interpreted(request: pytest.FixtureRequest) -> None:
    """Skip an in-process test that was selected all the same (see the module docstring)."""
    if runs_in_another_process(request.node):
        pytest.skip(
            f"triton was imported without TRITON_INTERPRET=1 first; {_FRESH_PROCESS_TEST} runs this file in a fresh "
            "process, in the multi-process lane (pytest -m dist)"
        )


@pytest.mark.dist
def test_kernels_in_a_fresh_interpreter_process() -> None:
    if K.INTERPRETED:
        pytest.skip("the kernels are interpreted in this process: the tests of this file run here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "LIGHTNING_SCAPE_"))}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        env=env,
        cwd=_REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # All skipped would exit 0 too: the tests must have run there on interpreted kernels.
    assert "triton was imported without TRITON_INTERPRET=1" not in proc.stdout, proc.stdout[-6000:]


@pytest.fixture
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the dispatching ops hand CPU tensors to the (interpreted) kernels."""
    monkeypatch.setenv("LIGHTNING_SCAPE_FORCE_TRITON", "1")
    monkeypatch.delenv("LIGHTNING_SCAPE_FORCE_REF", raising=False)


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the calls the dispatching ops make to each ``*_triton`` launcher."""
    calls: dict[str, int] = {}
    for name in LAUNCHERS:
        launcher = getattr(K, name)

        def spy(*args: Any, _f: Callable[..., Any] = launcher, _n: str = name, **kwargs: Any) -> Any:
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*args, **kwargs)

        # Each entry point calls the launcher of its own op module: the spy replaces it there.
        monkeypatch.setattr(sys.modules[launcher.__module__], name, spy)
    return calls


@pytest.fixture(params=select_module.SELECT_KERNELS)
def select_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a selection test on each threshold search the kernel has (``LIGHTNING_SCAPE_SELECT_KERNEL``)."""
    monkeypatch.setenv(select_module.SELECT_KERNEL_ENV, request.param)
    return str(request.param)


# ---------------------------------------------------------------- error feedback + compaction


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_ef_compact_equals_ref_exactly(shape: tuple[int, int], density: float, dtype: torch.dtype) -> None:
    rows, C = shape
    k = slots(density, C)
    gen = torch.Generator().manual_seed(rows * C + k)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    e = torch.randn(rows * C, generator=gen, dtype=sdt)
    g = torch.randn(rows * C, generator=gen).to(dtype)
    mask = random_mask(rows, C, k, gen)
    e_ref, out_ref = e.clone(), torch.empty(rows * k, dtype=dtype)
    out = torch.full((rows * k,), 7.0, dtype=dtype)
    K.ef_compact_ref(e_ref, g, mask, C, out_ref)
    K.ef_compact_triton(e, g, mask, C, out)
    assert torch.equal(out, out_ref)
    assert torch.equal(e, e_ref)  # bf16: the cast's rounding error stays in e, bit for bit


# ---------------------------------------------------------------- AdamS on the slots


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    # fp32: a few ulps; bf16: one bf16 ulp (2**-8 relative) where the fp32 values straddle a rounding edge.
    """(rtol, atol) for parameters of ``dtype``."""
    return (1e-5, 1e-6) if dtype == torch.float32 else (8e-3, 1e-5)


@pytest.mark.parametrize("options", [{"catch_up_cap": 6.0}, {"catch_up_cap": 2.0, "bias_correction": False},
                                     {"catch_up_cap": 6.0, "step": 1}],
                         ids=["cap6", "cap2-no-bias-correction", "first-step"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_adams_matches_ref(
    shape: tuple[int, int], density: float, dtype: torch.dtype, options: dict[str, float]
) -> None:
    rows, C = shape
    k = slots(density, C)
    n = rows * C
    gen = torch.Generator().manual_seed(n + k)
    param = torch.randn(n, generator=gen).to(dtype)
    step = int(options.get("step", 13))
    m = torch.randn(n, generator=gen) * 0.01 if step > 1 else torch.zeros(n)
    last = (
        torch.randint(0, step - 1, (n,), generator=gen, dtype=torch.int32)
        if step > 1
        else torch.zeros(n, dtype=torch.int32)
    )
    gbar = (torch.randn(rows * k, generator=gen) * 0.1).to(dtype)
    mask = random_mask(rows, C, k, gen)
    hyper = K.AdamSHyper(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, **{"step": step, **options})
    m_ref, last_ref, out_ref = m.clone(), last.clone(), torch.empty(rows * k, dtype=dtype)
    out = torch.empty(rows * k, dtype=dtype)
    K.sparse_adams_ref(param, m_ref, last_ref, gbar, mask, C, out_ref, hyper)
    K.sparse_adams_triton(param, m, last, gbar, mask, C, out, hyper)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, out_ref, rtol=rtol, atol=atol)
    # The interval update's momentum is a difference of two terms: a few fp32 ulps of b1**tau show absolutely.
    torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-8)
    assert torch.equal(last, last_ref)


# ---------------------------------------------------------------- dense AdamS


@pytest.mark.parametrize("step", [1, 5])  # 1: no previous momentum, nu = g^2
@pytest.mark.parametrize("with_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, 3 * 1024 + 5])
def test_dense_adams_matches_ref(n: int, dtype: torch.dtype, with_grad: bool, step: int) -> None:
    gen = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=gen).to(dtype)
    m = torch.randn(n, generator=gen) * 0.01 if step > 1 else torch.zeros(n)
    grad = torch.randn(n, generator=gen).to(dtype) if with_grad else None
    hyper = K.AdamSHyper(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    p_ref, m_ref = param.clone(), m.clone()
    K.dense_adams_ref(p_ref, m_ref, grad, hyper)
    K.dense_adams_triton(param, m, grad, hyper)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(param, p_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-9)


def test_dense_adams_without_weight_decay_on_a_2d_parameter() -> None:
    gen = torch.Generator().manual_seed(0)
    param, m, grad = torch.randn(33, 31, generator=gen), torch.zeros(33, 31), torch.randn(33, 31, generator=gen)
    hyper = K.AdamSHyper(step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, bias_correction=False)
    p_ref, m_ref = param.clone(), m.clone()
    K.dense_adams_ref(p_ref, m_ref, grad, hyper)
    K.dense_adams_triton(param, m, grad, hyper)
    torch.testing.assert_close(param, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, m_ref, rtol=0, atol=0)


# ---------------------------------------------------------------- scatter + decay


@pytest.mark.parametrize("decay", [0.999, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_decay_equals_ref_exactly(
    shape: tuple[int, int], density: float, dtype: torch.dtype, decay: float
) -> None:
    rows, C = shape
    k = slots(density, C)
    gen = torch.Generator().manual_seed(rows * C - k)
    params = torch.randn(rows * C, generator=gen).to(dtype)
    values = torch.randn(rows * k, generator=gen).to(dtype)
    mask = random_mask(rows, C, k, gen)
    p_ref = params.clone()
    K.scatter_decay_ref(p_ref, values, mask, C, decay)
    K.scatter_decay_triton(params, values, mask, C, decay)
    assert torch.equal(params, p_ref)


def test_scatter_decay_rounds_fp32_values_into_bf16_params_like_the_ref() -> None:
    gen = torch.Generator().manual_seed(3)
    params = torch.randn(5 * 64, generator=gen).bfloat16()
    values = torch.randn(5 * 6, generator=gen)  # fp32 values: the kernel must round to nearest even
    mask = random_mask(5, 64, 6, gen)
    p_ref = params.clone()
    K.scatter_decay_ref(p_ref, values, mask, 64, 0.99)
    K.scatter_decay_triton(params, values, mask, 64, 0.99)
    assert torch.equal(params, p_ref)


# ---------------------------------------------------------------- per-chunk top-k and the fused select


@pytest.mark.usefixtures("select_kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_chunk_topk_equals_ref_exactly(shape: tuple[int, int], density: float, dtype: torch.dtype) -> None:
    rows, C = shape
    k = slots(density, C)
    gen = torch.Generator().manual_seed(rows + C + k)
    # The tie rule must be reproduced: bf16 scores are full of ties, and so are integer-valued fp32 ones.
    if dtype == torch.float32:
        data = [torch.randn(rows * C, generator=gen), torch.randint(-3, 4, (rows * C,), generator=gen).float()]
    else:
        data = [torch.randn(rows * C, generator=gen).to(dtype)] * 2
    # No exploration, a 10% window, and a window that takes every slot.
    for s, ke in zip(data, [0, max(1, k // 10)] if dtype == torch.float32 else [max(1, k // 10), k], strict=True):
        offset = int(torch.randint(0, 3 * C, (1,), generator=gen))
        got = K.chunk_topk_triton(s, C, k, ke, offset)
        assert got.dtype == torch.int16 and got.shape == (rows, k)
        assert torch.equal(got, K.chunk_topk_ref(s, C, k, ke, offset)), (ke, offset)


@pytest.mark.usefixtures("select_kernel")
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_chunk_topk_picks_the_torch_topk_set_on_tie_free_data(shape: tuple[int, int], density: float) -> None:
    rows, C = shape
    k = slots(density, C)
    gen = torch.Generator().manual_seed(11 * C + k)
    scores = torch.randperm(rows * C, generator=gen).float()  # distinct values: no ties
    got = K.chunk_topk_triton(scores, C, k, 0, 0)
    want = torch.topk(scores.view(rows, C), k, dim=1).indices.sort(dim=1).values
    assert torch.equal(got.long(), want)


@pytest.mark.usefixtures("select_kernel")
def test_chunk_topk_fills_ties_in_index_order_and_forces_the_exploration_window() -> None:
    scores = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 3.0, 1.0],  # four 3s for three slots: the lowest three indices
            [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0],  # all equal: the first three
            [9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0],  # one clear winner, then ties at 0
        ]
    ).view(-1)
    assert K.chunk_topk_triton(scores, 8, 3, 0, 0).tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 7]]
    # Window of 1 at offset 6 (+8: taken mod C) forces index 6 in; the other two slots as before.
    assert K.chunk_topk_triton(scores, 8, 3, 1, 14).tolist() == [[1, 2, 6], [0, 1, 6], [0, 6, 7]]
    # Window of 2 wrapping around the chunk end: indices 7 and 0.
    assert K.chunk_topk_triton(scores, 8, 3, 2, 7).tolist() == [[0, 1, 7], [0, 1, 7], [0, 1, 7]]
    for ke, off in [(0, 0), (1, 14), (2, 7)]:
        assert torch.equal(K.chunk_topk_triton(scores, 8, 3, ke, off), K.chunk_topk_ref(scores, 8, 3, ke, off))


@pytest.mark.usefixtures("select_kernel")
def test_chunk_topk_ranks_nan_inf_and_signed_zero_like_the_ref() -> None:
    special = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.0]
    )
    gen = torch.Generator().manual_seed(5)
    C = 16
    for _ in range(15):
        s = special[torch.randint(0, len(special), (3 * C,), generator=gen)]
        k = int(torch.randint(1, C + 1, (1,), generator=gen))
        ke = int(torch.randint(0, k + 1, (1,), generator=gen))
        off = int(torch.randint(0, C, (1,), generator=gen))
        assert torch.equal(K.chunk_topk_triton(s, C, k, ke, off), K.chunk_topk_ref(s, C, k, ke, off))


@pytest.mark.usefixtures("select_kernel")
@pytest.mark.parametrize("statistic", ["momentum", "gradient"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_select_mask_equals_ref_exactly(shape: tuple[int, int], density: float, statistic: str) -> None:
    rows, C = shape
    k = slots(density, C)
    ke = min(k, round(0.1 * k))
    gen = torch.Generator().manual_seed(3 * C + k)
    m = torch.randn(rows * C, generator=gen) * 0.01
    e = torch.randn(rows * C, generator=gen) * 0.01
    offset = int(torch.randint(0, C, (1,), generator=gen))
    ref = K.select_mask_ref(m, e, 0.9, statistic, C, k, ke, offset)
    assert torch.equal(ref, K.chunk_topk_ref(K.mask_scores_ref(m, e, 0.9, statistic), C, k, ke, offset))
    assert torch.equal(K.select_mask_triton(m, e, 0.9, statistic, C, k, ke, offset), ref)


@pytest.mark.usefixtures("select_kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_where_the_group_prefilter_cannot_narrow_or_the_top_is_packed(dtype: torch.dtype) -> None:
    """The kernels' rarer paths: scores that share their top 16 bits (the prefilter on group maxima cannot
    narrow them: the whole chunk is searched, by the second launch of the split kernel), a top-k packed into a
    few adjacent groups (the k-th largest is found among the candidates), a chunk's largest value 16x and 32x
    its k-th largest (the candidate search walks its last binade, or bisects instead), and chunks of ties, for
    chunk_topk and select_mask."""
    rows, C, k = 3, 4096, 41
    gen = torch.Generator().manual_seed(11)
    shared = 1.0 + 1e-6 * torch.randn(rows * C, generator=gen)
    packed = torch.rand(rows * C, generator=gen) * 1e-3
    packed.view(rows, C)[:, 100 : 100 + k + 5] += torch.rand(rows, k + 5, generator=gen) + 1.0
    outliers = [1.0 + torch.rand(rows * C, generator=gen) for _ in range(2)]
    outliers[0].view(rows, C)[:, 7] = 17.0  # 4 binades above the rest
    outliers[1].view(rows, C)[:, 7] = 33.0  # 5 binades
    zeros = torch.zeros(rows * C)  # every chunk one tie
    zeros[C : 2 * C : 3] = 1.0  # but the second: fewer than k at the top, then ties
    for s in (shared.to(dtype), packed.to(dtype), *(o.to(dtype) for o in outliers), zeros.to(dtype)):
        for ke, off in ((0, 0), (4, 4090)):
            assert torch.equal(K.chunk_topk_triton(s, C, k, ke, off), K.chunk_topk_ref(s, C, k, ke, off))
            m = s.float()
            e = torch.zeros_like(m)
            ref = K.select_mask_ref(m, e, 0.9, "momentum", C, k, ke, off)
            assert torch.equal(K.select_mask_triton(m, e, 0.9, "momentum", C, k, ke, off), ref)


if HAS_TRITON:

    @triton.jit
    def _walk_probe(key_ptr: Any, out_ptr: Any, k: Any, n_window: Any, N: tl.constexpr) -> None:  # noqa: N803
        """Store the candidate search's threshold of ``N`` keys, and whether its walk found it."""
        key = tl.load(key_ptr + tl.arange(0, N))
        t, walked = select_module._kth_key_walk(key, k, n_window, 16, select_module.WALK_BINADES)
        tl.store(out_ptr, t)
        tl.store(out_ptr + 1, walked.to(tl.int32))


def _walk(keys: torch.Tensor, k: int, n_window: int = 0) -> tuple[int, bool]:
    out = torch.zeros(2, dtype=torch.int32)
    _walk_probe[(1,)](keys.contiguous(), out, k, n_window, N=keys.numel())
    return int(out[0]), bool(out[1])


def _float_keys(values: torch.Tensor) -> torch.Tensor:
    """The selection's int32 keys of fp32 values without NaN: their bits, magnitude flipped where negative."""
    bits = values.float().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def test_candidate_search_walks_from_the_largest_key_or_bisects_and_finds_the_same_threshold() -> None:
    """The threshold is the k-th largest key with its low 16 bits cleared, whichever way the search went; the
    walk is taken within its binades of the largest key, and refused where it could be wrong."""
    inf_key = 0x7F800000  # the exploration window's key
    gen = torch.Generator().manual_seed(2)
    base = 1.0 + torch.rand(256, generator=gen)  # one binade: [1, 2)
    cases = {  # name: (values, k, window groups at most, the walk is taken)
        "one binade": (base, 10, 0, True),
        "normal": (torch.randn(256, generator=gen).abs(), 10, 0, True),
        "top 4 binades up": (torch.cat([base[:-1], torch.tensor([17.0])]), 10, 0, True),
        "top 5 binades up": (torch.cat([base[:-1], torch.tensor([33.0])]), 10, 0, False),
        "all zero": (torch.zeros(256), 10, 0, True),
        "subnormal": (torch.rand(256, generator=gen) * 1e-39, 10, 0, True),
        "k-th largest negative": (torch.cat([-base[:-3], base[-3:]]), 10, 0, False),
    }
    for name, (values, k, n_window, walks) in cases.items():
        keys = _float_keys(values)
        want = int(keys.sort(descending=True).values[k - 1]) >> 16 << 16
        assert _walk(keys, k, n_window) == (want, walks), name
    # Window groups (key +inf) above the data: fewer than k of them, the walk starts below; k or more, it cannot.
    keys = _float_keys(base)
    keys[:3] = inf_key
    want = int(keys.sort(descending=True).values[9]) >> 16 << 16
    assert _walk(keys, 10, 3) == (want, True)
    keys[:10] = inf_key
    assert _walk(keys, 10, 10) == (inf_key, False)


def test_select_kernel_flag_refuses_an_unknown_search(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(select_module.SELECT_KERNEL_ENV, "wlak")
    with pytest.raises(ValueError, match="choose one of walk, prefilter, split"):
        K.chunk_topk_triton(torch.rand(4096), 4096, 41, 0, 0)


def test_select_kernel_default_is_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(select_module.SELECT_KERNEL_ENV, raising=False)
    assert select_module.selected_kernel() == "walk"
    monkeypatch.setenv(select_module.SELECT_KERNEL_ENV, "")  # set but empty, as a shell's VAR= leaves it
    assert select_module.selected_kernel() == "walk"


# ---------------------------------------------------------------- int8 rounding


@pytest.mark.parametrize(("groups", "group"), [(5, 1), (7, 41), (3, 256), (2, 4096)])
def test_round_int8_equals_ref_exactly(groups: int, group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(groups * group, generator=gen) * torch.rand(groups * group, generator=gen).pow(4)
    x[:group] = 0.0  # a group of zeros: scale 0, codes 0
    x[group : group + 3 * (group > 2)] = torch.tensor([2.0, -1.0, 0.5])[: 3 * (group > 2)]
    outs = []
    for op in (K.round_int8_ref, K.round_int8_triton):
        xi = x.clone()
        codes, scales = torch.empty(x.numel(), dtype=torch.int8), torch.empty(groups)
        op(xi, group, codes, scales)
        outs.append((xi, codes, scales))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_round_int8_ties_to_even_and_keeps_the_error_worked_by_hand() -> None:
    # max |x| = 127: the scale is exactly 1, so the codes are x rounded half to even and the error is x - code.
    x = torch.tensor([127.0, -63.5, 2.5, 0.25, 0.0, -127.0, 1.5, 3.49])
    for op in (K.round_int8_ref, K.round_int8_triton):
        xi, codes, scales = x.clone(), torch.empty(8, dtype=torch.int8), torch.empty(1)
        op(xi, 8, codes, scales)
        assert codes.tolist() == [127, -64, 2, 0, 0, -127, 2, 3]
        assert scales.tolist() == [1.0]
        assert torch.equal(xi, x - codes.float())  # what the codes did not carry
        assert torch.equal(K.decode_int8(codes, scales) + xi, x)  # no mass lost


def test_kernels_reject_shapes_they_would_index_out_of_bounds() -> None:
    mask = torch.zeros(2, 3, dtype=torch.int16)
    with pytest.raises(ValueError, match="out holds"):
        K.ef_compact_triton(torch.zeros(16), torch.zeros(16), mask, 8, torch.zeros(5))
    with pytest.raises(ValueError, match="rows \\* chunk_size"):
        K.scatter_decay_triton(torch.zeros(15), torch.zeros(6), mask, 8, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        K.chunk_topk_triton(torch.zeros(24), 12, 2, 0, 0)
    with pytest.raises(ValueError, match="whole number of groups"):
        K.round_int8_triton(torch.zeros(10), 4, torch.zeros(10, dtype=torch.int8), torch.zeros(2))


# ---------------------------------------------------------------- dispatch


def _all_ops(dtype: torch.dtype) -> None:
    """Call every dispatching op once on tiny CPU tensors of parameter dtype ``dtype``."""
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    C, rows, k = 8, 3, 2
    n = rows * C
    p, g = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    e, m = torch.randn(n, dtype=sdt), torch.randn(n, dtype=sdt)
    mask = K.chunk_topk(K.mask_scores_ref(m, e, 0.9, "momentum"), C, k, 1, 0)
    K.select_mask(m, e, 0.9, "momentum", C, k, 1, 0)
    out = torch.empty(n // C * k, dtype=dtype)
    K.ef_compact(e, g, mask, C, out)
    hyper = K.AdamSHyper(step=2, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, catch_up_cap=8.0)
    last = torch.zeros(n, dtype=torch.int32)
    K.sparse_adams(p, m, last, out, mask, C, out.clone(), hyper)
    K.scatter_decay(p, out, mask, C, 0.99)
    K.dense_adams(p, m, g, hyper)
    K.round_int8(e.clone(), C, torch.empty(n, dtype=torch.int8), torch.empty(rows))


def test_cpu_tensors_run_the_refs_unless_triton_is_forced(
    spies: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIGHTNING_SCAPE_FORCE_TRITON", raising=False)
    _all_ops(torch.float32)
    assert spies == {}


def test_forced_triton_runs_every_kernel(spies: dict[str, int], force_triton: None) -> None:
    _all_ops(torch.float32)
    assert set(spies) == set(LAUNCHERS)


def test_fp64_runs_the_refs_except_for_the_exact_kernels(spies: dict[str, int], force_triton: None) -> None:
    _all_ops(torch.float64)
    # ef_compact and chunk_topk only add, cast and compare: exact in fp64 too. The others apply fp64
    # hyperparameters, which Triton would round to fp32.
    assert set(spies) == {"ef_compact_triton", "chunk_topk_triton"}


def test_force_ref_wins_over_force_triton(
    spies: dict[str, int], force_triton: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_SCAPE_FORCE_REF", "1")
    _all_ops(torch.bfloat16)
    assert spies == {}


def test_non_contiguous_tensors_run_the_ref(spies: dict[str, int], force_triton: None) -> None:
    p, m, g = torch.randn(6, 4).t(), torch.zeros(6, 4).t(), torch.randn(6, 4).t()
    K.dense_adams(p, m, g, K.AdamSHyper(step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0))
    assert spies == {}


def _run_python(code: str, env: dict[str, str]) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "LIGHTNING_SCAPE_"))}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=_REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_package_imports_and_runs_without_triton() -> None:
    out = _run_python(
        """
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        import lightning_scape.kernels as K
        assert not K.HAS_TRITON
        s = torch.randn(4 * 8, device="cpu")
        assert torch.equal(K.chunk_topk(s, 8, 3, 1, 0), K.chunk_topk_ref(s, 8, 3, 1, 0))
        try:
            K.chunk_topk_triton(s, 8, 3, 1, 0)
        except RuntimeError as err:
            print("raised:", err)
        """,
        {},
    )
    assert "raised: triton is not installed" in out


def test_interpret_env_at_import_runs_the_engine_ops_on_kernels() -> None:
    out = _run_python(
        """
        import sys
        import torch
        import lightning_scape.kernels as K
        assert K.INTERPRETED and K.use_triton(torch.zeros(1))
        calls = []
        op = sys.modules[K.chunk_topk_triton.__module__]  # the entry point calls its own module's launcher
        real = op.chunk_topk_triton
        op.chunk_topk_triton = lambda *a: calls.append(1) or real(*a)
        s = torch.randn(3 * 64)
        assert torch.equal(K.chunk_topk(s, 64, 6, 1, 5), K.chunk_topk_ref(s, 64, 6, 1, 5))
        print("kernel calls:", len(calls))
        """,
        {"TRITON_INTERPRET": "1", "LIGHTNING_SCAPE_FORCE_TRITON": "1"},
    )
    assert "kernel calls: 1" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_kernels_match_refs_on_cuda(dtype: str) -> None:
    # This module interprets the kernels; the compiled ones are checked in a process without the interpreter.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "LIGHTNING_SCAPE_"))}
    script = str(_REPO / "benchmarks" / "bench_kernels.py")
    proc = subprocess.run(
        [sys.executable, script, "--check-only", "--dtype", dtype], env=env, cwd=_REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ---------------------------------------------------------------- the engine on the kernels


def _train(cfg: ScapeConfig, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, param_order=list(model.parameters()))
    gen = torch.Generator().manual_seed(1)
    masks = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        model(x).square().mean().backward()
        engine.step()
        engine.zero_grad()
        if not engine.in_warmup:
            masks.append(engine.last_built_masks()[0].clone())
    engine.close()
    return [p.detach().clone() for p in model.parameters()], masks


@pytest.mark.parametrize(
    "overrides",
    # Replicated masks score |m| with select_mask's "gradient" statistic (the |second argument|).
    [{}, {"sharded": False, "catch_up_cap": 4.0}, {"wire_format": "int8"}],
    ids=["sharded", "replicated", "int8-wire"],
)
def test_engine_on_triton_kernels_matches_engine_on_refs(
    overrides: dict[str, Any], spies: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 warm-up steps then 3 sparse steps; 16*24+24+24*4+4 = 508 parameters -> 8 chunks of 64, k = 6.
    cfg = ScapeConfig(density=0.1, chunk_size=64, dense_warmup_steps=2, density_ramp_steps=0, **overrides)
    monkeypatch.setenv("LIGHTNING_SCAPE_FORCE_REF", "1")
    params_ref, masks_ref = _train(cfg, 5)
    assert spies == {}
    monkeypatch.delenv("LIGHTNING_SCAPE_FORCE_REF")
    monkeypatch.setenv("LIGHTNING_SCAPE_FORCE_TRITON", "1")
    params, masks = _train(cfg, 5)
    used = {
        "dense_adams_triton",
        "ef_compact_triton",
        "sparse_adams_triton",
        "select_mask_triton",  # the engine builds its masks with the fused op
        "scatter_decay_triton",
    }
    assert used <= set(spies), spies
    assert len(masks) == 4  # built at the end of warm-up and after each sparse step
    for a, b in zip(masks, masks_ref, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(params, params_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
