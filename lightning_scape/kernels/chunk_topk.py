"""Per-chunk top-k mask selection with round-robin exploration slots, written as int16 indices.

In every chunk, the k_e exploration slots are the window ``(offset + j) mod C`` for ``j < k_e``; the
other ``k - k_e`` slots are the largest scores outside that window. Ties break towards the lower index.
Each row of the result lists its k indices in ascending order.

``select_mask`` fuses the mask statistic into the selection: the Triton kernel reads the momentum and
residual of a chunk once and writes its k indices, without materialising the fp32 scores.

Both Triton launchers find the prefilter's threshold by the search of ``_kth_key_walk`` (down from the
largest key's binade). ``LIGHTNING_SCAPE_SELECT_KERNEL=prefilter`` bisects all 16 bits instead (the former
default); ``=split`` also moves the chunks the prefilter cannot narrow into a second launch
(``_select_rare_kernel``), so that the first holds fewer registers. The same threshold and the same indices
every way; docs/kernels.md says how they differ and how ``benchmarks/bench_kernels.py`` times them.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from ._positions import MAX_CHUNK_SIZE
from ._signature import signature_of
from ._triton import HAS_TRITON, chunk_ok, require_triton, tl, triton, use_triton

# Codes of the score a selection kernel computes from its inputs.
_STAT_SCORES = 0  # the input is already the score
_STAT_MOMENTUM = 1  # |b1 * m + (1 - b1) * e|
_STAT_GRADIENT = 2  # |e|
_STATISTICS = {"momentum": _STAT_MOMENTUM, "gradient": _STAT_GRADIENT}

# Which selection kernel runs, read at every launch: unset or "walk", the default (the threshold searched down
# from the largest key, faster on an H100 in every case timed: docs/kernels.md); "prefilter", the former default's
# 16-bit bisection; "split", the walk with the rare paths moved into a second launch. The alternatives stay so
# that another GPU can time them against the default (benchmarks/bench_kernels.py --select all).
SELECT_KERNEL_ENV = "LIGHTNING_SCAPE_SELECT_KERNEL"
SELECT_KERNELS = ("walk", "prefilter", "split")


def selected_kernel() -> str:
    """The selection kernel ``LIGHTNING_SCAPE_SELECT_KERNEL`` names: ``"walk"`` (unset), ``"prefilter"``, ``"split"``.

    Raises:
        ValueError: The variable holds another value (a typo must not silently time the default).
    """
    name = os.environ.get(SELECT_KERNEL_ENV) or "walk"
    if name not in SELECT_KERNELS:
        raise ValueError(f"{SELECT_KERNEL_ENV}={name!r}: choose one of {', '.join(SELECT_KERNELS)} (or unset it).")
    return name


def mask_scores_ref(momentum: Tensor, residual: Tensor, beta1: float, statistic: str) -> Tensor:
    """The mask statistic of a shard.

    Args:
        momentum: First moment m of the shard (ignored for ``"gradient"``).
        residual: This rank's error-feedback residual e on the same coordinates.
        beta1: b1.
        statistic: ``"momentum"``: ``|b1*m + (1-b1)*e|``; ``"gradient"``: ``|e|``.

    Returns:
        fp32 scores, same length.
    """
    if statistic == "momentum":
        return momentum.mul(beta1).add_(residual, alpha=1.0 - beta1).abs_().float()
    if statistic == "gradient":
        return residual.abs().float()
    raise ValueError(f"mask statistic {statistic!r} has no score function; use 'momentum' or 'gradient'.")


def chunk_topk_ref(scores: Tensor, chunk_size: int, k: int, k_explore: int, explore_offset: int) -> Tensor:
    """Pure-PyTorch reference (and CPU path).

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        scores: ``[rows * chunk_size]`` float scores (NaN counts as the lowest score).
        chunk_size: C.
        k: Slots per chunk (1 <= k <= C).
        k_explore: Exploration slots per chunk (0 <= k_explore <= k).
        explore_offset: Start of this refresh's exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    s = scores.reshape(-1, chunk_size).float()
    s = s.clone() if s.data_ptr() == scores.data_ptr() else s  # never write the caller's scores
    s.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    if k_explore > 0:
        window = (torch.arange(k_explore, device=s.device) + explore_offset) % chunk_size
        s[:, window] = float("inf")
    # The k-th largest value of each chunk is its threshold; everything at or above it is taken.
    thr = torch.topk(s, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    take = s >= thr
    hits = take.nonzero()
    if hits.shape[0] == s.shape[0] * k:  # no chunk has ties at its threshold: the common case
        return hits[:, 1].reshape(-1, k).to(torch.int16)
    # Ties at the threshold (zeros, mostly): fill them in index order, on the tied rows only.
    rows = (torch.bincount(hits[:, 0], minlength=s.shape[0]) > k).nonzero().squeeze(1)
    sub, sub_thr = s[rows], thr[rows]
    above = sub > sub_thr
    need = k - above.sum(dim=1, keepdim=True)
    at = sub == sub_thr
    take[rows] = above | (at & (at.cumsum(dim=1) <= need))
    return take.nonzero()[:, 1].reshape(-1, k).to(torch.int16)


@signature_of(chunk_topk_ref)
def chunk_topk(scores: Tensor, chunk_size: int, k: int, k_explore: int, explore_offset: int) -> Tensor:
    """Per-chunk top-k with exploration: the entry point (see :func:`chunk_topk_ref` for the arguments).

    Runs :func:`chunk_topk_triton` where :func:`~._triton.use_triton` allows it and the kernel takes the
    chunk size and dtype, :func:`chunk_topk_ref` otherwise; both return the same indices.
    """
    if use_triton(scores) and chunk_ok(chunk_size) and scores.is_floating_point():
        return chunk_topk_triton(scores, chunk_size, k, k_explore, explore_offset)
    return chunk_topk_ref(scores, chunk_size, k, k_explore, explore_offset)


def select_mask_ref(
    momentum: Tensor,
    residual: Tensor,
    beta1: float,
    statistic: str,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """Pure-PyTorch reference (and CPU path) of the fused op: score the shard, then pick its mask.

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        momentum: ``[rows * chunk_size]`` first moment m of the shard (ignored for ``"gradient"``).
        residual: Same length, this rank's error-feedback residual e.
        beta1: b1.
        statistic: ``"momentum"``: ``|b1*m + (1-b1)*e|``; ``"gradient"``: ``|e|``.
        chunk_size: C.
        k: Slots per chunk (1 <= k <= C).
        k_explore: Exploration slots per chunk (0 <= k_explore <= k).
        explore_offset: Start of this refresh's exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices:
        ``chunk_topk_ref(mask_scores_ref(momentum, residual, beta1, statistic), ...)``.
    """
    scores = mask_scores_ref(momentum, residual, beta1, statistic)
    return chunk_topk_ref(scores, chunk_size, k, k_explore, explore_offset)


@signature_of(select_mask_ref)
def select_mask(
    momentum: Tensor,
    residual: Tensor,
    beta1: float,
    statistic: str,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """Score and select in one op: the entry point (see :func:`select_mask_ref` for the arguments).

    Runs the fused :func:`select_mask_triton` where :func:`~._triton.use_triton` allows it, the kernel
    takes the chunk size and the state is fp32, :func:`select_mask_ref` otherwise: fp64 state runs the
    ref (the score's ``b1`` would be rounded to fp32 in the kernel).
    """
    # "gradient" never reads the momentum, so only the tensors the statistic reads need to fit the kernel.
    inputs = (momentum, residual) if statistic == "momentum" else (residual,)
    if (
        use_triton(*inputs)
        and chunk_ok(chunk_size)
        and all(t.dtype == torch.float32 for t in inputs)
        and statistic in ("momentum", "gradient")
    ):
        return select_mask_triton(momentum, residual, beta1, statistic, chunk_size, k, k_explore, explore_offset)
    return select_mask_ref(momentum, residual, beta1, statistic, chunk_size, k, k_explore, explore_offset)


if HAS_TRITON:
    # Binades the threshold search walks down from the largest key before it bisects instead: the k-th
    # largest of a chunk whose largest value is over 16x its k-th largest (heavy tails) is bisected.
    WALK_BINADES = tl.constexpr(4)

    @triton.jit
    def _load_scores(
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        offs: tl.tensor,
        mask: tl.tensor,
        other: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        STAT: tl.constexpr,
    ) -> tl.tensor:
        """fp32 scores at ``offs`` (``mask``/``other`` as in ``tl.load``; None for a whole chunk)."""
        if STAT == 0:
            s = tl.load(a_ptr + offs, mask=mask, other=other).to(tl.float32)
        elif STAT == 1:
            m = tl.load(a_ptr + offs, mask=mask, other=other)
            e = tl.load(b_ptr + offs, mask=mask, other=other)
            # mask_scores_ref: momentum.mul(b1).add_(residual, alpha=1-b1), one fma in PyTorch.
            s = tl.abs(tl.fma(e, one_minus_b1, m * beta1)).to(tl.float32)
        else:
            s = tl.abs(tl.load(b_ptr + offs, mask=mask, other=other)).to(tl.float32)
        return s

    @triton.jit
    def _score_keys(
        s: tl.tensor,
        idx: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        C: tl.constexpr,
        SIGNED: tl.constexpr,
        WALK: tl.constexpr,
    ) -> tl.tensor:
        """Order-preserving int32 keys of scores ``s`` at chunk-local indices ``idx``, ranked as the ref ranks.

        ``SIGNED`` False promises absolute values: no -inf, no -0.0, no sign bit but a NaN's. ``WALK``
        (the default kernel) computes the same keys in fewer operations where ``SIGNED`` is False.
        """
        if WALK and not SIGNED:
            return _abs_score_keys(s, idx, k_explore, offset, C)
        # chunk_topk_ref's nan_to_num(nan=-inf, posinf=FLT_MAX) also maps -inf to -FLT_MAX (the
        # default of neginf), so NaN ranks below every number.
        s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
        if SIGNED:
            s = tl.where(s == -float("inf"), -3.4028234663852886e38, s)
        s = tl.where(s != s, -float("inf"), s)
        # Exploration window (offset + j) mod C, j < k_explore: forced in with +inf (C is a power of 2).
        s = tl.where(((idx - offset) & (C - 1)) < k_explore, float("inf"), s)
        if SIGNED:
            # -0.0 == 0.0 for the ref's comparisons; give both one bit pattern.
            s = tl.where(s == 0.0, 0.0, s)
        # Flip the magnitude bits of negative numbers: int32 order is then float order. No key is
        # INT32_MIN (that would be a NaN pattern), so INT32_MIN pads below every score.
        bits = s.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _abs_score_keys(
        s: tl.tensor, idx: tl.tensor, k_explore: tl.tensor, offset: tl.tensor, C: tl.constexpr
    ) -> tl.tensor:
        """:func:`_score_keys` of absolute values: their bits are their keys, once +inf and NaN are placed."""
        # +inf ranks as FLT_MAX (0x7F7FFFFF), NaN as -inf (key 0x807FFFFF), the window as +inf (0x7F800000):
        # the keys _score_keys computes, in integer min/select instead of float compares and a sign flip.
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(s != s, -2139095041, tl.minimum(bits, 2139095039))
        return tl.where(((idx - offset) & (C - 1)) < k_explore, 2139095040, key)

    @triton.jit
    def _kth_key(key: tl.tensor, k: tl.tensor, LOW_BIT: tl.constexpr) -> tl.tensor:
        """The largest t, a multiple of ``2**LOW_BIT``, with ``#{key >= t} >= k`` (the k-th largest key for 0).

        Bisection on the key's bits: the sign bit first, then bits 30..LOW_BIT (setting a lower bit
        raises a two's-complement value whatever its sign). One count per bit, no sort.
        """
        n_nonneg = tl.sum((key >= 0).to(tl.int32), axis=0)
        t = tl.where(n_nonneg >= k, 0, -2147483648).to(tl.int32)
        for b in tl.static_range(30, LOW_BIT - 1, -1):
            cand = t | (1 << b)
            cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
            t = tl.where(cnt >= k, cand, t)
        return t

    @triton.jit
    def _kth_key_walk(
        key: tl.tensor, k: tl.tensor, n_window: tl.tensor, LOW_BIT: tl.constexpr, MAX_STEPS: tl.constexpr
    ) -> tuple[tl.tensor, tl.tensor]:
        """:func:`_kth_key`'s result, searched from the binade of the largest key down (the default kernel).

        The k-th largest of a chunk's group maxima lies within a few binades of the largest (window groups,
        keyed +inf, left out): count down one binade (2**23 keys) per pass from there, then bisect its 7
        mantissa bits above ``LOW_BIT``; 1 + (binades walked) + 7 counts where the bisection takes 16. It
        starts only where fewer than k keys can lie above that binade (``n_window``, an upper bound of the
        window groups, < k) and the answer is not negative, and walks at most ``MAX_STEPS`` binades;
        otherwise it bisects as :func:`_kth_key` does.

        Returns:
            The threshold, and whether the walk found it (False: the bisection did).
        """
        # Every key but the window's (+inf, 0x7F800000) is at most FLT_MAX's.
        top = tl.max(tl.where(key < 2139095040, key, -1), axis=0)
        t = top & -8388608  # the binade's first key: its 23 mantissa bits cleared
        n = tl.sum((key >= t).to(tl.int32), axis=0)
        # Invariant: fewer than k keys >= t + 2**23 (above top: the window groups only).
        ok = (top >= 0) & (n_window < k)
        steps = 0
        while ok & (n < k) & (t > 0) & (steps < MAX_STEPS):
            t -= 8388608
            n = tl.sum((key >= t).to(tl.int32), axis=0)
            steps += 1
        walked = ok & (n >= k)
        if walked:
            for b in tl.static_range(22, LOW_BIT - 1, -1):
                cand = t | (1 << b)
                cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
                t = tl.where(cnt >= k, cand, t)
        else:
            t = _kth_key(key, k, LOW_BIT)
        return t, walked

    @triton.jit
    def _min_and_count(
        a: tl.tensor, count_a: tl.tensor, b: tl.tensor, count_b: tl.tensor
    ) -> tuple[tl.tensor, tl.tensor]:
        """Combine of a reduction to the smallest key and how many keys equal it."""
        low = tl.minimum(a, b)
        return low, tl.where(a == low, count_a, 0) + tl.where(b == low, count_b, 0)

    @triton.jit
    def _store_top(key: tl.tensor, idx: tl.tensor, t: tl.tensor, k: tl.tensor, out_row: tl.tensor) -> None:
        """Store the k indices ranked first (``t`` the k-th largest key) ascending; ``idx`` is ascending."""
        # Everything above t is taken; ties at t fill the remaining slots in index order.
        above = key > t
        need = k - tl.sum(above.to(tl.int32), axis=0)
        at = key == t
        take = above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= need))
        # Ascending output: a taken index goes to the slot given by the taken ones before it.
        slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, idx.to(tl.int16), mask=take)

    @triton.jit
    def _kth_key_above(key: tl.tensor, k: tl.tensor, lo: tl.tensor, WALK: tl.constexpr) -> tl.tensor:
        """The k-th largest key, given ``lo`` <= it: steps up through the distinct keys above ``lo``.

        Each step costs two reductions (``WALK``: one, the smallest key above and its count together);
        when many keys lie between ``lo`` and the answer, bisect instead.
        """
        t = lo
        n_above = tl.sum((key > t).to(tl.int32), axis=0)
        if n_above - k > 8:
            t = _kth_key(key, k, 0)
        else:
            # Invariant: #{key >= t} >= k. Done when fewer than k keys lie above t.
            while n_above >= k:
                if WALK:
                    above = key > t
                    t, n_at = tl.reduce((tl.where(above, key, 2147483647), above.to(tl.int32)), 0, _min_and_count)
                    n_above -= n_at
                else:
                    t = tl.min(tl.where(key > t, key, 2147483647), axis=0)
                    n_above = tl.sum((key > t).to(tl.int32), axis=0)
        return t

    @triton.jit
    def _select_groups(
        cand: tl.tensor,
        n_groups: tl.tensor,
        lo: tl.tensor,
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        out_row: tl.tensor,
        scratch_row: tl.tensor,
        k: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        VEC: tl.constexpr,
        CAP: tl.constexpr,
        WALK: tl.constexpr,
    ) -> None:
        """Select among the keys of the ``n_groups`` candidate groups (``cand``), gathered again by index."""
        # Ordered compaction of the candidate groups' numbers through this row's scratch: Triton cannot
        # compact registers, and a scatter of the whole chunk would force a one-value-per-thread layout
        # (scalar loads and a layout conversion); a scatter of the group numbers is C / VEC values.
        pos = tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(scratch_row + pos, tl.arange(0, C // VEC), mask=cand)
        tl.debug_barrier()  # the stores above, by any thread, before the loads below
        # Their elements, ascending by index; the scores are re-read (cached: just loaded).
        cpos = tl.arange(0, CAP)
        valid = cpos < n_groups * VEC
        cidx = tl.load(scratch_row + cpos // VEC, mask=valid, other=0) * VEC + cpos % VEC
        cs = _load_scores(a_ptr, b_ptr, base + cidx, valid, 0.0, beta1, one_minus_b1, STAT)
        ckey = tl.where(valid, _score_keys(cs, cidx, k_explore, offset, C, STAT == 0, WALK), -2147483648)
        _store_top(ckey, cidx, _kth_key_above(ckey, k, lo, WALK), k, out_row)

    # k, k_explore and the window's offset are not specialized (docs/kernels.md, "Compile time"): they only enter
    # comparisons and the row's output address, whose stores are scattered; specialized, the density ramp would
    # compile this kernel (the largest, about 2 s) for every combination of their classes.
    @triton.jit(do_not_specialize=["k", "k_explore", "offset"])
    def _select_kernel(
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        out_ptr: tl.tensor,
        scratch_ptr: tl.tensor,
        k: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        PREFILTER: tl.constexpr,
        VEC: tl.constexpr,
        CAP_GROUPS: tl.constexpr,
        LOW_BIT: tl.constexpr,
        WALK: tl.constexpr,
        SPLIT: tl.constexpr,
    ) -> None:
        # One program per chunk; the whole chunk (C <= 32768) lives in registers.
        row = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, C)
        s = _load_scores(a_ptr, b_ptr, row * C + idx, None, None, beta1, one_minus_b1, STAT)
        key = _score_keys(s, idx, k_explore, offset, C, STAT == 0, WALK)
        out_row = out_ptr + row * k
        if PREFILTER:
            # Groups of VEC adjacent keys (one vector load each, so their maxima need no shuffle). At
            # least k groups have a maximum >= lo, so at least k keys are >= lo: lo <= the k-th
            # largest key, and every key the selection takes lies in a group whose maximum is >= lo.
            gmax = tl.max(tl.reshape(key, (C // VEC, VEC)), axis=1)
            if WALK:
                # The window (k_explore adjacent indices, mod C) lies in at most this many groups.
                n_window = tl.minimum(k_explore, (k_explore + VEC - 1) // VEC + 1)
                lo, _ = _kth_key_walk(gmax, k, n_window, LOW_BIT, WALK_BINADES)
            else:
                lo = _kth_key(gmax, k, LOW_BIT)
            cand = gmax >= lo
            n_groups = tl.sum(cand.to(tl.int32), axis=0)
            if n_groups <= CAP_GROUPS:
                _select_groups(
                    cand,
                    n_groups,
                    lo,
                    a_ptr,
                    b_ptr,
                    row * C,
                    out_row,
                    scratch_ptr + row * CAP_GROUPS,
                    k,
                    k_explore,
                    offset,
                    beta1,
                    one_minus_b1,
                    C,
                    STAT,
                    VEC,
                    CAP_GROUPS * VEC,
                    WALK,
                )
            elif SPLIT:
                # Left to _select_rare_kernel: this chunk's row and lo, at the end of the list behind the
                # scratch (its length in the word after the list).
                rows = tl.num_programs(0)
                rare_ptr = scratch_ptr + rows * CAP_GROUPS
                at = tl.atomic_add(rare_ptr + 2 * rows, 1)
                tl.store(rare_ptr + 2 * at, row.to(tl.int32))
                tl.store(rare_ptr + 2 * at + 1, lo)
            else:
                _select_whole_chunk(key, idx, lo, k, out_row)
        else:
            _store_top(key, idx, _kth_key(key, k, 0), k, out_row)

    @triton.jit
    def _select_whole_chunk(key: tl.tensor, idx: tl.tensor, lo: tl.tensor, k: tl.tensor, out_row: tl.tensor) -> None:
        """Select over the whole chunk, given ``lo`` <= the k-th largest key (too many candidate groups)."""
        # Many keys at lo (ties, mostly): when fewer than k are above it, lo is the k-th largest.
        n_above = tl.sum((key > lo).to(tl.int32), axis=0)
        if n_above < k:
            t = lo
        else:
            t = _kth_key(key, k, 0)
        _store_top(key, idx, t, k, out_row)

    # rows, like k, only addresses: specialized, every bucket size would compile a variant.
    @triton.jit(do_not_specialize=["k", "k_explore", "offset", "rows"])
    def _select_rare_kernel(
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        out_ptr: tl.tensor,
        rare_ptr: tl.tensor,
        k: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        rows: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        WALK: tl.constexpr,
    ) -> None:
        # The chunks _select_kernel (SPLIT) listed, shared out among this launch's programs.
        for i in range(tl.program_id(0), tl.load(rare_ptr + 2 * rows), tl.num_programs(0)):
            row = tl.load(rare_ptr + 2 * i).to(tl.int64)
            idx = tl.arange(0, C)
            s = _load_scores(a_ptr, b_ptr, row * C + idx, None, None, beta1, one_minus_b1, STAT)
            key = _score_keys(s, idx, k_explore, offset, C, STAT == 0, WALK)
            _select_whole_chunk(key, idx, tl.load(rare_ptr + 2 * i + 1), k, out_ptr + row * k)


class _SelectConfig(NamedTuple):
    """Launch parameters of :func:`_select_kernel` for one chunk size, k and input width."""

    num_warps: int
    prefilter: bool
    vec: int
    cap_groups: int
    low_bit: int
    walk: bool = False
    split: bool = False


def _select_config(chunk_size: int, k: int, elem_bytes: int) -> _SelectConfig:
    """Pick the launch parameters of :func:`_select_kernel` (docs/kernels.md has the measurements).

    Args:
        chunk_size: C, a power of two.
        k: Slots per chunk.
        elem_bytes: Bytes per input value (the momentum's for the momentum statistic).

    Returns:
        The prefilter (groups of one 16-byte load each, at most ``cap_groups`` candidate groups,
        group-maximum threshold to 16 bits) for C >= 1024 when the candidate groups fit in half the
        chunk; otherwise the plain selection over the whole chunk, at 16 values per thread.
    """
    vec = max(1, 16 // elem_bytes)  # values per 16-byte load
    cap_groups = min(max(32, 1 << (k + k // 2 - 1).bit_length()), chunk_size // (2 * vec))
    if chunk_size < 1024 or k > cap_groups:
        return _SelectConfig(max(1, min(32, chunk_size // 512)), False, vec, 1, 16)
    # Warps per chunk as measured fastest on an H100 (docs/kernels.md): 64 values per thread (fewer
    # warps spill registers), except 32 for 4-byte values at C = 4096.
    warps = 4 if chunk_size == 4096 and elem_bytes >= 4 else max(1, chunk_size // 2048)
    return _SelectConfig(min(32, warps), True, vec, cap_groups, 16)


def _launch_select(
    a: Tensor,
    b: Tensor,
    stat: int,
    beta1: float,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """Validate the shapes and launch :func:`_select_kernel`: the one launch of both selection launchers.

    Args:
        a: ``[rows * chunk_size]`` first input: the scores, or the momentum for the momentum statistic.
        b: Same length, second input: the residual (the scores again when ``stat`` is ``_STAT_SCORES``).
        stat: ``_STAT_*`` code of the score the kernel computes from ``a`` and ``b``.
        beta1: b1 of the momentum statistic (unused otherwise).
        chunk_size: C, a power of two <= 32768.
        k: Slots per chunk.
        k_explore: Exploration slots per chunk.
        explore_offset: Start of the exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    require_triton()
    C = chunk_size
    if not chunk_ok(C):
        raise ValueError(f"chunk_size must be a power of two <= {MAX_CHUNK_SIZE}, got {C}")
    if a.numel() % C != 0 or b.numel() != a.numel():
        raise ValueError(f"inputs of {a.numel()} and {b.numel()} values are not whole chunks of {C}")
    if not (1 <= k <= C and 0 <= k_explore <= k):
        raise ValueError(f"need 1 <= k <= chunk_size and 0 <= k_explore <= k, got k={k}, k_explore={k_explore}")
    rows = a.numel() // C
    out = torch.empty(rows, k, dtype=torch.int16, device=a.device)
    if rows == 0:
        return out
    cfg = _select_config(C, k, a.element_size())
    # The kernels differ only in the prefilter's path (the plain selection has no threshold search).
    search = selected_kernel() if cfg.prefilter else "prefilter"
    cfg = cfg._replace(walk=search in ("walk", "split"), split=search == "split")
    # Per-row scratch for the candidate groups' numbers (unused without the prefilter); with the split, then
    # the rare chunks' list (row, lo) and its length, which starts at 0.
    size = rows * cfg.cap_groups + (2 * rows + 1 if cfg.split else 0) if cfg.prefilter else 1
    scratch = torch.empty(size, dtype=torch.int32, device=a.device)
    if cfg.split:
        scratch[-1:].zero_()
    args = (k, k_explore, explore_offset % C, float(beta1), 1.0 - beta1)
    # No fp contraction: every op rounds on its own as in the ref (its fmas are explicit tl.fma).
    _select_kernel[(rows,)](
        a,
        b,
        out,
        scratch,
        *args,
        C=C,
        STAT=stat,
        PREFILTER=cfg.prefilter,
        VEC=cfg.vec,
        CAP_GROUPS=cfg.cap_groups,
        LOW_BIT=cfg.low_bit,
        WALK=cfg.walk,
        SPLIT=cfg.split,
        num_warps=cfg.num_warps,
        enable_fp_fusion=False,
    )
    if cfg.split:
        rare = scratch[rows * cfg.cap_groups :]
        _select_rare_kernel[(min(rows, _rare_programs(a.device)),)](
            a, b, out, rare, *args, rows, C=C, STAT=stat, WALK=cfg.walk, num_warps=cfg.num_warps, enable_fp_fusion=False
        )
    return out


def _rare_programs(device: torch.device) -> int:
    """Programs of ``_select_rare_kernel``: a few per SM on a GPU (most launches find no chunk to take)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@signature_of(chunk_topk_ref)
def chunk_topk_triton(scores: Tensor, chunk_size: int, k: int, k_explore: int, explore_offset: int) -> Tensor:
    """Triton kernel of :func:`chunk_topk_ref`: the same indices, exactly.

    One program per chunk holds the chunk's keys (order-preserving int32 images of the scores) in
    registers. From C = 1024 on it prefilters: the maxima of groups of adjacent keys (one 16-byte load
    each) give a lower bound of the k-th largest key to 16 bits (searched down from the largest
    maximum's binade, then bisected); the few
    groups at or above it are compacted in index order through a per-row scratch, and the exact
    k-th largest is found among their keys alone. Otherwise (small chunks, large k, or too many
    candidate groups, as when a chunk is all ties) it bisects over the whole chunk (32 counting
    passes). Either way it takes every key above the k-th largest and fills the ties in index order
    with a prefix sum.

    Args:
        scores: ``[rows * chunk_size]`` contiguous float scores (any float dtype; compared in fp32).
        chunk_size: C, a power of two <= 32768.
        k: Slots per chunk (1 <= k <= C).
        k_explore: Exploration slots per chunk (0 <= k_explore <= k).
        explore_offset: Start of this refresh's exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    return _launch_select(scores, scores, _STAT_SCORES, 0.0, chunk_size, k, k_explore, explore_offset)


@signature_of(select_mask_ref)
def select_mask_triton(
    momentum: Tensor,
    residual: Tensor,
    beta1: float,
    statistic: str,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """Triton kernel of :func:`select_mask_ref`: the statistic is computed inside the selection.

    Reads m and e once (``8`` bytes per coordinate for fp32 state), writes ``2 k`` bytes per chunk.
    The indices equal the ref's whenever the score arithmetic rounds alike (it is the same fma).

    Args:
        momentum: ``[rows * chunk_size]`` contiguous fp32 first moment (ignored for ``"gradient"``).
        residual: Same length, contiguous fp32 residual.
        beta1: b1.
        statistic: ``"momentum"`` or ``"gradient"``.
        chunk_size: C, a power of two <= 32768.
        k: Slots per chunk.
        k_explore: Exploration slots per chunk.
        explore_offset: Start of the exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    if statistic not in _STATISTICS:
        raise ValueError(f"mask statistic {statistic!r} has no score function; use 'momentum' or 'gradient'.")
    stat = _STATISTICS[statistic]
    # "gradient" never reads the momentum: pass the residual twice so its size need not match.
    a = momentum if stat == _STAT_MOMENTUM else residual
    return _launch_select(a, residual, stat, beta1, chunk_size, k, k_explore, explore_offset)
