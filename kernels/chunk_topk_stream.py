"""A candidate selection kernel for ``chunk_topk`` and ``select_mask``: one warp per chunk, streamed in tiles.

The same op as ``chunk_topk.py`` (its references ``chunk_topk_ref`` and ``select_mask_ref`` are the
semantics, and its indices must equal theirs bit for bit), selected with ``LIGHTNING_SCAPE_SELECT_KERNEL=stream``;
the default stays the kernel of ``chunk_topk.py`` until a GPU timing says otherwise (``docs/kernels.md``,
"A candidate selection kernel"). What it changes, and why:

* **Every reduction inside one warp.** On an H100 the current kernel spends most of its time selecting, not
  reading (``chunk_topk`` took as long as ``select_mask``, which reads twice the bytes), and at C = 4096 it
  runs 4 warps per chunk, so each of its 20-50 counting reductions crosses warps through shared memory and
  barriers; with one warp per chunk (C <= 2048) it reached 78-80% of the bandwidth. Here a chunk of up to
  4096 fp32 values is one warp's: every count is a shuffle tree.
* **The chunk is streamed, not held.** One warp cannot hold 4096 values and their keys in registers (the
  current kernel compiled with one warp at C = 4096 spills 392 bytes per thread). The chunk is read in tiles;
  each tile leaves only its group maxima, written to a per-program scratch and read back whole. The rare
  paths (ties that defeat the prefilter) read the chunk again, tile by tile, instead of keeping it live.
* **Persistent programs.** A grid of a few programs per SM takes the rows one by one from an atomic counter,
  so the scratch is one slice per program, about 9 MB on an H100, which its 50 MB L2 holds (the current
  kernel's is one slice per row: 16 MB for 2**28 values).
* **A fixed search among the candidates.** The threshold ``lo`` from the group maxima is a multiple of
  ``2**16``; when fewer than k candidates lie at or above ``lo + 2**16`` the k-th largest key is found by a
  16-pass bisection of its low bits, instead of stepping through the distinct keys above ``lo`` (up to 9
  steps of two reductions) or the full 32-pass bisection.

Small chunks (C < 1024) and large k (no prefilter) launch the current kernel's whole-chunk search (nothing
to stream there), and so do chunks above 8192 values (their candidates would not fit one warp).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._signature import signature_of
from ._triton import HAS_TRITON, tl, triton
from .chunk_topk import (
    _STAT_MOMENTUM,
    _STAT_SCORES,
    _STATISTICS,
    _kth_key,
    _launch_select,
    _load_scores,
    _score_keys,
    _store_top,
    check_select,
    chunk_topk_ref,
    select_mask_ref,
)

__all__ = ["chunk_topk_ref", "chunk_topk_stream_triton", "select_mask_ref", "select_mask_stream_triton"]

# Values per thread of one tile (per input). Compiled for sm_90 offline (docs/kernels.md), select_mask at C = 4096
# takes 159 registers with 8 and 154 with 16, without spills: 13 warps resident per SM, each with 4 kB in flight
# at 16. benchmarks/bench_kernels.py times 8 too: a GPU decides.
VALUES_PER_THREAD = 16
# At most this many candidate values per thread (the fast path's registers); more candidates take more warps.
CANDIDATES_PER_THREAD = 32
# At most this many group maxima per chunk: 32 per thread of one warp. Larger chunks use larger groups.
MAX_GROUPS = 1024
# Larger chunks launch the current kernel: their candidates (up to 16384 values at C = 32768, d = 0.01) would
# not fit one warp's registers, and the default chunk size is 4096.
MAX_STREAM_CHUNK = 8192
# Warps per SM of the persistent grid, a little more than 155 registers a thread leave resident (65536 / (155 x
# 32) = 13). Programs take rows from an atomic counter, so a program that starts late (not resident at first)
# finds the rows that are left, or none: no tail of rows bound to a late program.
WARPS_PER_SM = 16
# Programs of the grid when the kernel runs in Triton's CPU interpreter, which runs them one after the other: the
# first takes every row from the counter (so the tests reuse its scratch row after row, as the GPU does).
INTERPRETED_PROGRAMS = 2
# The group-maximum threshold keeps the top 16 bits of the key (as the current kernel's does).
LOW_BIT = 16


class _StreamConfig(NamedTuple):
    """Launch parameters of :func:`_stream_kernel` for one chunk size, k and input width."""

    group: int  # adjacent values per group maximum (one 16-byte load, or more for large chunks)
    tile: int  # values per tile
    cap_groups: int  # the most candidate groups the fast path takes
    num_warps: int


def _stream_config(chunk_size: int, k: int, elem_bytes: int) -> _StreamConfig | None:
    """The candidate's launch parameters, or None where it launches the current kernel (C < 1024, C > 8192, k
    too large for the prefilter).

    Args:
        chunk_size: C, a power of two.
        k: Slots per chunk.
        elem_bytes: Bytes per input value.
    """
    vec = max(1, 16 // elem_bytes)  # values per 16-byte load
    group = max(vec, chunk_size // MAX_GROUPS)
    # As the current kernel: room for 1.5 k candidate groups (a power of two), at most half the groups.
    cap_groups = min(max(32, 1 << (k + k // 2 - 1).bit_length()), chunk_size // (2 * group))
    if chunk_size < 1024 or chunk_size > MAX_STREAM_CHUNK or k > cap_groups:
        return None
    # One warp, unless the candidates (cap_groups x group values) would need more than 32 values per thread.
    warps = max(1, min(8, cap_groups * group // (32 * CANDIDATES_PER_THREAD)))
    tile = min(chunk_size, 32 * warps * VALUES_PER_THREAD)
    return _StreamConfig(group, tile, cap_groups, warps)


def _programs(device: torch.device, rows: int, num_warps: int) -> int:
    """The persistent grid: :data:`WARPS_PER_SM` warps per SM (at most one program per row); in the interpreter,
    :data:`INTERPRETED_PROGRAMS`."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * max(1, WARPS_PER_SM // num_warps)))
    return max(1, min(rows, INTERPRETED_PROGRAMS))


if HAS_TRITON:

    @triton.jit
    def _tile_keys(
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        t: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        TILE: tl.constexpr,
    ) -> tuple[tl.tensor, tl.tensor]:
        """The keys of tile ``t`` of the chunk at ``base`` and their chunk-local indices."""
        idx = t * TILE + tl.arange(0, TILE)
        s = _load_scores(a_ptr, b_ptr, base + idx, None, None, beta1, one_minus_b1, STAT)
        return _score_keys(s, idx, k_explore, offset, C, STAT == 0), idx

    @triton.jit
    def _count_at_least(
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        thr: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        TILE: tl.constexpr,
    ) -> tl.tensor:
        """``#{key >= thr}`` over the chunk, read again tile by tile (the rare paths: it is in L1/L2)."""
        n = tl.full((), 0, tl.int32)
        for t in range(C // TILE):
            key, _ = _tile_keys(a_ptr, b_ptr, base, t, k_explore, offset, beta1, one_minus_b1, C, STAT, TILE)
            n += tl.sum((key >= thr).to(tl.int32), axis=0)
        return n

    @triton.jit
    def _raise_streamed(
        t: tl.tensor,
        k: tl.tensor,
        top: tl.tensor,
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        TILE: tl.constexpr,
    ) -> tl.tensor:
        """Bisection of bits ``top``..0 above ``t`` (``#{key >= t} >= k``), one streamed count per bit."""
        for b in range(top, -1, -1):
            cand = t | (1 << b)
            n = _count_at_least(a_ptr, b_ptr, base, cand, k_explore, offset, beta1, one_minus_b1, C, STAT, TILE)
            t = tl.where(n >= k, cand, t)
        return t

    @triton.jit
    def _kth_key_streamed(
        lo: tl.tensor,
        k: tl.tensor,
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        TILE: tl.constexpr,
        LOW: tl.constexpr,
    ) -> tl.tensor:
        """The k-th largest key of the chunk, given ``lo`` <= it (a multiple of ``2**LOW``): too many candidates."""
        above = _count_at_least(a_ptr, b_ptr, base, lo + 1, k_explore, offset, beta1, one_minus_b1, C, STAT, TILE)
        t = lo  # fewer than k keys above lo: a chunk of ties at lo (all zeros, mostly)
        if above >= k:
            hi = _count_at_least(a_ptr, b_ptr, base, lo + (1 << LOW), k_explore, offset, beta1, one_minus_b1, C,
                                 STAT, TILE)  # fmt: skip
            if hi < k:  # the k-th largest shares lo's high bits: bisect the low ones
                t = _raise_streamed(lo, k, LOW - 1, a_ptr, b_ptr, base, k_explore, offset, beta1, one_minus_b1, C,
                                    STAT, TILE)  # fmt: skip
            else:
                # Clustered at the top: k keys at or above lo + 2**LOW, in fewer groups. Every bit, the sign first.
                nonneg = _count_at_least(a_ptr, b_ptr, base, 0, k_explore, offset, beta1, one_minus_b1, C, STAT,
                                         TILE)  # fmt: skip
                t0 = tl.where(nonneg >= k, 0, -2147483648).to(tl.int32)
                t = _raise_streamed(t0, k, 30, a_ptr, b_ptr, base, k_explore, offset, beta1, one_minus_b1, C, STAT,
                                    TILE)  # fmt: skip
        return t

    @triton.jit
    def _store_top_streamed(
        t: tl.tensor,
        k: tl.tensor,
        out_row: tl.tensor,
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        TILE: tl.constexpr,
    ) -> None:
        """``_store_top`` over the chunk read tile by tile: the counts of taken keys and ties carry across tiles."""
        need = k - _count_at_least(a_ptr, b_ptr, base, t + 1, k_explore, offset, beta1, one_minus_b1, C, STAT, TILE)
        taken = tl.full((), 0, tl.int32)
        ties = tl.full((), 0, tl.int32)
        for i in range(C // TILE):
            key, idx = _tile_keys(a_ptr, b_ptr, base, i, k_explore, offset, beta1, one_minus_b1, C, STAT, TILE)
            at = key == t
            rank = ties + tl.cumsum(at.to(tl.int32), axis=0)
            take = (key > t) | (at & (rank <= need))
            slot = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(out_row + slot, idx.to(tl.int16), mask=take)
            taken += tl.sum(take.to(tl.int32), axis=0)
            ties += tl.sum(at.to(tl.int32), axis=0)

    @triton.jit
    def _kth_key_in_bin(ckey: tl.tensor, k: tl.tensor, lo: tl.tensor, LOW: tl.constexpr) -> tl.tensor:
        """The k-th largest of the candidate keys ``ckey``, given ``lo`` <= it (a multiple of ``2**LOW``).

        When fewer than k keys reach ``lo + 2**LOW`` the answer shares ``lo``'s high bits: bisect the low ones.
        """
        if tl.sum((ckey >= lo + (1 << LOW)).to(tl.int32), axis=0) >= k:
            t = _kth_key(ckey, k, 0)
        else:
            t = lo
            for b in tl.static_range(LOW - 1, -1, -1):
                cand = t | (1 << b)
                t = tl.where(tl.sum((ckey >= cand).to(tl.int32), axis=0) >= k, cand, t)
        return t

    @triton.jit
    def _select_candidates(
        cand: tl.tensor,
        n_groups: tl.tensor,
        lo: tl.tensor,
        group_row: tl.tensor,
        out_row: tl.tensor,
        k: tl.tensor,
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        base: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        GROUP: tl.constexpr,
        CAP: tl.constexpr,
        LOW: tl.constexpr,
    ) -> None:
        """Select among the ``n_groups`` candidate groups (``cand``): their numbers compacted in index order
        through the scratch, their scores read again (just read: cached), the k-th largest found among them."""
        pos = tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(group_row + pos, tl.arange(0, C // GROUP), mask=cand)
        tl.debug_barrier()  # the stores above, by any thread, before the loads below
        cpos = tl.arange(0, CAP)
        valid = cpos < n_groups * GROUP
        cidx = tl.load(group_row + cpos // GROUP, mask=valid, other=0) * GROUP + cpos % GROUP
        cs = _load_scores(a_ptr, b_ptr, base + cidx, valid, 0.0, beta1, one_minus_b1, STAT)
        ckey = tl.where(valid, _score_keys(cs, cidx, k_explore, offset, C, STAT == 0), -2147483648)
        _store_top(ckey, cidx, _kth_key_in_bin(ckey, k, lo, LOW), k, out_row)

    @triton.jit
    def _stream_kernel(
        a_ptr: tl.tensor,
        b_ptr: tl.tensor,
        out_ptr: tl.tensor,
        scratch_ptr: tl.tensor,
        next_row_ptr: tl.tensor,
        rows: tl.tensor,
        k: tl.tensor,
        k_explore: tl.tensor,
        offset: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        C: tl.constexpr,
        STAT: tl.constexpr,
        GROUP: tl.constexpr,
        TILE: tl.constexpr,
        CAP_GROUPS: tl.constexpr,
        LOW: tl.constexpr,
    ) -> None:
        # A persistent program: it takes rows from the counter until none is left; its scratch holds one row's
        # group maxima, then the candidate groups' numbers.
        pid = tl.program_id(0)
        gmax_row = scratch_ptr + pid.to(tl.int64) * (C // GROUP + CAP_GROUPS)
        group_row = gmax_row + C // GROUP
        row = tl.atomic_add(next_row_ptr, 1)
        while row < rows:
            base = row.to(tl.int64) * C
            out_row = out_ptr + row.to(tl.int64) * k
            tl.debug_barrier()  # the previous row's loads from the scratch, by any thread, before these stores
            # The group maxima, tile by tile (each thread reduces its own 16-byte loads; larger groups shuffle).
            for t in range(C // TILE):
                key, _ = _tile_keys(a_ptr, b_ptr, base, t, k_explore, offset, beta1, one_minus_b1, C, STAT, TILE)
                gm = tl.max(tl.reshape(key, (TILE // GROUP, GROUP)), axis=1)
                tl.store(gmax_row + t * (TILE // GROUP) + tl.arange(0, TILE // GROUP), gm)
            tl.debug_barrier()
            # At least k groups have a maximum >= lo, so at least k keys are >= lo: lo <= the k-th largest key,
            # and every key the selection takes lies in a group whose maximum is >= lo.
            gmax = tl.load(gmax_row + tl.arange(0, C // GROUP))
            lo = _kth_key(gmax, k, LOW)
            cand = gmax >= lo
            n_groups = tl.sum(cand.to(tl.int32), axis=0)
            if n_groups <= CAP_GROUPS:
                _select_candidates(cand, n_groups, lo, group_row, out_row, k, a_ptr, b_ptr, base, k_explore,
                                   offset, beta1, one_minus_b1, C, STAT, GROUP, CAP_GROUPS * GROUP, LOW)  # fmt: skip
            else:
                t_k = _kth_key_streamed(lo, k, a_ptr, b_ptr, base, k_explore, offset, beta1, one_minus_b1, C, STAT,
                                        TILE, LOW)  # fmt: skip
                _store_top_streamed(t_k, k, out_row, a_ptr, b_ptr, base, k_explore, offset, beta1, one_minus_b1, C,
                                    STAT, TILE)  # fmt: skip
            row = tl.atomic_add(next_row_ptr, 1)


def _launch_stream(
    a: Tensor,
    b: Tensor,
    stat: int,
    beta1: float,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """Validate and launch :func:`_stream_kernel` (arguments as ``chunk_topk._launch_select``'s).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    C = chunk_size
    rows = check_select(a, b, C, k, k_explore)
    cfg = _stream_config(C, k, a.element_size())
    if cfg is None:
        return _launch_select(a, b, stat, beta1, C, k, k_explore, explore_offset)
    out = torch.empty(rows, k, dtype=torch.int16, device=a.device)
    if rows == 0:
        return out
    programs = _programs(a.device, rows, cfg.num_warps)
    scratch = torch.empty(programs * (C // cfg.group + cfg.cap_groups), dtype=torch.int32, device=a.device)
    next_row = torch.zeros(1, dtype=torch.int32, device=a.device)
    _stream_kernel[(programs,)](
        a,
        b,
        out,
        scratch,
        next_row,
        rows,
        k,
        k_explore,
        explore_offset % C,
        float(beta1),
        1.0 - beta1,
        C=C,
        STAT=stat,
        GROUP=cfg.group,
        TILE=cfg.tile,
        CAP_GROUPS=cfg.cap_groups,
        LOW=LOW_BIT,
        num_warps=cfg.num_warps,
        # No fp contraction: the score rounds as the ref's (its fma is an explicit tl.fma).
        enable_fp_fusion=False,
    )
    return out


@signature_of(chunk_topk_ref)
def chunk_topk_stream_triton(scores: Tensor, chunk_size: int, k: int, k_explore: int, explore_offset: int) -> Tensor:
    """The candidate kernel of :func:`chunk_topk_ref`: the same indices, exactly (arguments as there).

    Args:
        scores: ``[rows * chunk_size]`` contiguous float scores (any float dtype; compared in fp32).
        chunk_size: C, a power of two <= 32768.
        k: Slots per chunk (1 <= k <= C).
        k_explore: Exploration slots per chunk (0 <= k_explore <= k).
        explore_offset: Start of this refresh's exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    return _launch_stream(scores, scores, _STAT_SCORES, 0.0, chunk_size, k, k_explore, explore_offset)


@signature_of(select_mask_ref)
def select_mask_stream_triton(
    momentum: Tensor,
    residual: Tensor,
    beta1: float,
    statistic: str,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """The candidate kernel of :func:`select_mask_ref`, the statistic computed inside (arguments as there).

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
    return _launch_stream(a, residual, stat, beta1, chunk_size, k, k_explore, explore_offset)
