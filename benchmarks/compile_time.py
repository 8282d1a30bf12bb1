"""How long the Triton kernels take to compile over SCAPE's schedule, how many variants they compile, and the
sparse step they then run.

    python -m benchmarks.compile_time         # CUDA: the compile passes from an empty Triton cache, then the step
    python -m benchmarks.compile_time --tiny  # no GPU: the code path on the CPU, kernels in Triton's interpreter

Triton compiles a kernel anew for every distinct *specialization key* of its launches: the values of its
``tl.constexpr`` arguments and launch options (``num_warps``), and, for every other argument not named in
``@triton.jit(do_not_specialize=...)``, a class of its value: an int equal to 1 (then a constant), divisible by
16, or neither; a tensor whose address is or is not a multiple of 16 bytes (``triton/runtime/jit.py``,
``create_function_from_signature`` and ``specialize_impl``). During SCAPE's density ramp the slots per chunk k
fall step by step (4096 to 41 at C = 4096 and d = 0.01), and every launch argument derived from k can open a new
key. docs/kernels.md ("Compile time") says which arguments are specialized and why.

**What it measures**, on CUDA: with ``TRITON_CACHE_DIR`` set to an empty temporary folder (nothing compiled
before), the seconds of :func:`benchmarks.scale.warm_kernels`: an engine of SCAPE's defaults (``--methods``: the
scale run's other SCAPE methods too, each after the ones before it, as the scale run compiles them) stepped through
its dense warm-up and density ramp on the 110M-parameter model's buckets, two simulated ranks, without forward or
backward, which is what ``python -m benchmarks.scale`` spends before it trains. Per kernel it prints the launches,
their distinct keys by Triton's rules (:func:`recording`, the count ``tests/test_compile_time.py`` bounds without a
GPU), the keys no earlier pass launched, and the variants Triton compiled in the pass (its in-memory cache of each
``JITFunction``): the last two should agree. Then it times the sparse step against fused AdamW at N = 1e8
(``benchmarks/bench_kernels.py``'s :func:`~benchmarks.bench_kernels.step_rows`), and the sparse step at N = 1e8
rounded up to 16 chunk rows both with the kernels as they are and as they were specialized before
(:func:`as_before`): at that size every argument no longer specialized would have been divisible by 16, so a
kernel slowed by less specialization would show there. Under two minutes on an H100.

``--tiny`` steps the scale run's tiny model through its warm-up step and 5-step ramp on the kernels in Triton's CPU
interpreter (no compiled variants to count) and times the steps at 2**16 on the references: a test of this script
(``tests/test_compile_time.py``), not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from benchmarks.cpu_fallback import cpu_fallback

# A launch's key: per kernel argument (type, specialization), then the launch options, sorted.
Key = tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]
METHODS = ("scape_fp32_d0.01", "scape_int8_d0.025", "scape_auto_100mbit")  # the SCAPE methods of benchmarks.scale
DEFAULT_METHODS = "scape_fp32_d0.01"  # the former fixed default form; both within the 2 minutes are not sure to fit
STEP_NUMEL = 100_000_000  # the sparse step's N on CUDA
TINY_STEP_NUMEL = 1 << 16


# ------------------------------------------------------------------------------------------- Triton's rules


def _divisibility(n: int, specialize: bool, align: bool) -> str | None:
    """The value class Triton keys an int or an address on: ``"D"`` divisible by 16, ``""`` not, None unkeyed."""
    if not specialize:
        return None
    return "D" if align and n % 16 == 0 else ""


def arg_key(value: Any, specialize: bool = True, align: bool = True) -> tuple[str, Any]:
    """Triton's specialization of one non-constexpr launch argument (``specialize_impl`` in triton/runtime/jit.py).

    Args:
        value: The argument.
        specialize: False for an argument in the kernel's ``do_not_specialize``.
        align: False for an argument in its ``do_not_specialize_on_alignment`` (the ==1 constant stays).

    Returns:
        ``(type, specialization)``: an int equal to 1 is the constant ``("constexpr", 1)``; other ints are typed by
        range and keyed by divisibility by 16; floats are fp32 and bools u1, neither keyed; a tensor is keyed by
        whether its address is a multiple of 16 bytes.
    """
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if specialize and value == 1:
            return ("constexpr", 1)
        ty = "i32" if -(2**31) <= value < 2**31 else "u64" if 2**63 <= value < 2**64 else "i64"
        return (ty, _divisibility(value, specialize, align))
    if isinstance(value, float):
        return ("fp32", None)
    if isinstance(value, Tensor):
        return ("*" + str(value.dtype).removeprefix("torch."), _divisibility(value.data_ptr(), specialize, align))
    raise TypeError(f"no specialization rule for a {type(value).__name__} argument")


def kernel_params(kernel: Any) -> list[tuple[str, bool, bool, bool]]:
    """``(name, constexpr, specialize, align)`` of each parameter of a ``@triton.jit`` kernel, compiled or interpreted.

    A parameter is a constexpr when its annotation names ``constexpr`` (Triton's test); ``specialize`` and ``align``
    are False for the parameters named (or numbered) in the decorator's ``do_not_specialize`` and
    ``do_not_specialize_on_alignment``.
    """
    options = getattr(kernel, "kwargs", None) or {}  # InterpretedFunction keeps the decorator's arguments here
    dns = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ()
    dnsa = getattr(kernel, "do_not_specialize_on_alignment", None) or options.get("do_not_specialize_on_alignment")
    dnsa = dnsa or ()
    out = []
    for i, p in enumerate(inspect.signature(kernel.fn).parameters.values()):
        constexpr = "constexpr" in str(p.annotation)
        out.append((p.name, constexpr, not (i in dns or p.name in dns), not (i in dnsa or p.name in dnsa)))
    return out


def launch_key(params: list[tuple[str, bool, bool, bool]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """The specialization key of ``kernel[grid](*args, **kwargs)``, ``params`` its :func:`kernel_params`: one compiled
    variant per distinct key."""
    names = [p[0] for p in params]
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    sig = tuple(
        ("constexpr", values[name]) if constexpr else arg_key(values[name], spec, align)
        for name, constexpr, spec, align in params
    )
    return sig, tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))


# ------------------------------------------------------------------------------------------- recording launches


@dataclasses.dataclass
class Launches:
    """The launches seen per kernel: how many, and their distinct keys."""

    keys: dict[str, set[Key]] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, name: str, key: Key) -> None:
        self.keys.setdefault(name, set()).add(key)
        self.calls[name] = self.calls.get(name, 0) + 1

    def variants(self) -> dict[str, int]:
        """Distinct keys per kernel: the variants Triton compiles for these launches."""
        return {name: len(keys) for name, keys in sorted(self.keys.items())}


class _Recorder:
    """Stands in for a kernel: ``recorder[grid](...)`` records the launch's key, then launches the kernel (``run``).

    Triton's CPU interpreter is not thread-safe, so interpreted launches of the simulated ranks take turns.
    """

    _interpreter_lock = threading.Lock()

    def __init__(self, name: str, kernel: Any, log: Launches, run: bool) -> None:
        self.name, self.kernel, self.log, self.run = name, kernel, log, run
        self.params = kernel_params(kernel)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.log.add(self.name, launch_key(self.params, args, kwargs))
            if not self.run:
                return None
            if not hasattr(self.kernel, "device_caches") and not hasattr(self.kernel, "cache"):  # interpreted
                with self._interpreter_lock:
                    return self.kernel[grid](*args, **kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def _launchers() -> list[tuple[Any, str, Callable[..., Any]]]:
    """``(module, name, launcher)`` of every op's Triton launcher (``kernels.__all__``'s ``*_triton``)."""
    import lightning_scape.kernels as K

    out = []
    for name in K.__all__:
        if name.endswith("_triton") and name != "use_triton":
            fn = getattr(K, name)
            out.append((sys.modules[fn.__module__], name, fn))
    return out


def kernels() -> dict[str, Any]:
    """Every ``@triton.jit`` kernel an op launches, by name (the ``_*_kernel`` objects of the op modules)."""
    from triton.runtime.jit import KernelInterface

    return {
        name: obj
        for module, _, _ in _launchers()
        for name, obj in vars(module).items()
        if name.endswith("_kernel") and isinstance(obj, KernelInterface)
    }


def _on_cuda_rules(*tensors: Tensor) -> bool:
    """``use_triton`` as it answers for CUDA tensors: one device, all contiguous."""
    return all(t.device == tensors[0].device and t.is_contiguous() for t in tensors)


@contextlib.contextmanager
def recording(run_kernels: bool, compute: bool = True) -> Iterator[Launches]:
    """Record the key of every kernel launch the ops make while the context is open (every thread).

    Args:
        run_kernels: True: the kernels run as they would (on CUDA, or interpreted). False: nothing is launched and
            every op takes the path it would take on CUDA (``use_triton`` answers as for CUDA tensors, whatever
            the device): its launcher checks the shapes and records the launch it would make, then the op's
            reference computes the result. So CPU tensors give the launches of a GPU run, without a GPU.
        compute: With ``run_kernels`` False: False skips the references too, and a selection returns the first
            k indices of every chunk. The launches do not depend on the values (the schedule sets k, the
            exploration window and every shape), so they are the same, at a fraction of the time; the
            values computed are not meant to be read.

    Yields:
        The :class:`Launches`, filled as the ops run.
    """
    log = Launches()
    saved: list[tuple[Any, str, Any]] = []

    def patch(module: Any, name: str, value: Any) -> None:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    try:
        for name, kernel in kernels().items():
            module = next(m for m, _, _ in _launchers() if getattr(m, name, None) is kernel)
            patch(module, name, _Recorder(name, kernel, log, run_kernels))
        if not run_kernels:
            for module, name, launcher in _launchers():
                ref = getattr(module, name.removesuffix("_triton") + "_ref")

                def record_then_ref(*args: Any, _launcher: Any = launcher, _ref: Any = ref) -> Any:
                    out = _launcher(*args)  # checks the shapes and records; its kernel runs nothing
                    if compute:
                        return _ref(*args)
                    if isinstance(out, Tensor):  # a selection's [rows, k] indices: valid ones, 0..k-1
                        out.copy_(torch.arange(out.shape[1], dtype=out.dtype, device=out.device))
                    return out

                patch(module, name, record_then_ref)
                if getattr(module, "use_triton", None) is not _on_cuda_rules:
                    patch(module, "use_triton", _on_cuda_rules)
        yield log
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def compiled_variants() -> dict[str, int | None]:
    """Per kernel, the variants compiled in this process (Triton's in-memory cache); None when interpreted.

    Triton 3.3 and later keep ``JITFunction.device_caches[device]``, a tuple whose first entry maps each key to its
    compiled kernel; earlier 3.x keep ``JITFunction.cache[device]``, that mapping itself.
    """
    out: dict[str, int | None] = {}
    for name, kernel in sorted(kernels().items()):
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            out[name] = sum(len(entry[0]) for entry in caches.values())
        elif isinstance(getattr(kernel, "cache", None), dict):
            out[name] = sum(len(c) for c in kernel.cache.values())
        else:
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------- the schedule


def schedule_shared(tiny: bool, device: torch.device, model: torch.nn.Module | None = None) -> Any:
    """A ``benchmarks.scale.Shared`` for :func:`benchmarks.scale.warm_kernels`: the scale run's model (``--tiny``:
    its tiny one) or ``model``, without text (the warm-up runs no forward pass)."""
    from benchmarks import scale

    size = scale.TINY if tiny else scale.FULL
    base = model if model is not None else scale.base_model(size)
    return scale.Shared(size, device, base, torch.empty(0, dtype=torch.long), [])


def schedule_launches(
    method: str, shared: Any, steps: int, run_kernels: bool, compute: bool = True
) -> tuple[float, Launches]:
    """Step ``method``'s engines through the dense warm-up and density ramp of a run of ``steps``
    (:func:`benchmarks.scale.warm_kernels`), recording every launch (:func:`recording`'s arguments); returns its
    seconds and the launches."""
    from benchmarks import scale

    with recording(run_kernels, compute) as log:
        seconds = scale.warm_kernels(method, steps, shared)
    return seconds, log


def fresh_triton_cache() -> str:
    """Point Triton's on-disk cache at a new empty folder (read at each compile), so every variant compiles."""
    path = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = path
    with contextlib.suppress(Exception):  # the environment is enough where this fails (no knobs before 3.4)
        import triton

        triton.knobs.cache.dir = path  # in case the environment was read already
    return path


# ------------------------------------------------------------------------------------------- as specialized before


def _slot_block_before(k: int) -> int:
    """The slot block before ``kernels._triton.slot_block``: k rounded up to a power of two, at most 1024."""
    return min(1024, 1 << (max(k, 1) - 1).bit_length())


@contextlib.contextmanager
def as_before() -> Iterator[None]:
    """The kernels specialized as before docs/kernels.md's "Compile time": every argument specialized (each kernel
    decorated again without its ``do_not_specialize``) and the slot blocks of ``_slot_block_before``; for timing
    the step both ways on the GPU (the variants these launches need compile at their first launch)."""
    import triton

    saved: list[tuple[Any, str, Any]] = []
    try:
        for name, kernel in kernels().items():
            module = sys.modules[kernel.fn.__module__]
            saved.append((module, name, kernel))
            setattr(module, name, triton.jit(kernel.fn))
        for module, _, _ in _launchers():
            if getattr(module, "slot_block", None) is not None:
                saved.append((module, "slot_block", module.slot_block))
                module.slot_block = _slot_block_before
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def step_ms_both_ways(numel: int, device: str, iters: int, rounds: int = 2) -> tuple[float, float]:
    """Milliseconds of the sparse step (``bench_kernels.Problem.sparse_step``, d = 0.01, C = 4096, fp32) on ``numel``
    parameters with the kernels as they are and :func:`as_before`: timed in alternation, ``rounds`` medians of
    ``iters`` launches each way (each after a warm-up, so no compilation is timed), the smallest of each."""
    from benchmarks import bench_kernels

    prob = bench_kernels.Problem(numel, 4096, 0.01, 0.1, torch.float32, device)
    timer = bench_kernels.time_cuda if device == "cuda" else bench_kernels.time_cpu
    now, before = [], []
    for _ in range(rounds):
        now.append(timer(prob.sparse_step, iters, 3))
        with as_before():
            before.append(timer(prob.sparse_step, iters, 3))
    return min(now), min(before)


# ------------------------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="no GPU: a small model, a short schedule, interpreted kernels")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from {list(METHODS)} (default: "
                    f"{DEFAULT_METHODS}; a later one compiles only what the earlier ones did not)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=20, help="timed launches of each step (median)")
    ap.add_argument("--no-step", action="store_true", help="only the compile passes")
    return ap


def compile_passes(methods: list[str], shared: Any, steps: int) -> dict[str, Any]:
    """:func:`schedule_launches` of each method in turn, on the kernels (compiled ones compile as they go).

    Prints and returns, per method, its seconds and per kernel its launches, their distinct keys, the keys no
    earlier pass launched (what this pass should compile, by the rule) and the variants compiled during it
    (Triton's own count; None when interpreted).
    """
    from benchmarks import scale

    out: dict[str, Any] = {}
    seen: dict[str, set[Key]] = {}
    for method in methods:
        before = compiled_variants()
        seconds, log = schedule_launches(method, shared, steps, run_kernels=True)
        after = compiled_variants()
        cfg = scale.method_config(method, steps)
        print(f"\n{method}: {cfg.dense_warmup_steps} dense warm-up + {cfg.density_ramp_steps} ramp steps on "
              f"{shared.size.world_size} simulated ranks: {seconds:.1f} s")  # fmt: skip
        print(f"  {'kernel':<24} {'launches':>9} {'keys':>5} {'new keys':>9} {'compiled':>9}")
        rows = {}
        for kernel, keys in sorted(log.keys.items()):
            new_keys = len(keys - seen.setdefault(kernel, set()))
            seen[kernel] |= keys
            now = after.get(kernel)
            compiled = None if now is None else now - (before.get(kernel) or 0)
            calls = log.calls[kernel]
            rows[kernel] = {"launches": calls, "keys": len(keys), "new_keys": new_keys, "compiled": compiled}
            shown = "n/a" if compiled is None else compiled
            print(f"  {kernel:<24} {calls:>9} {len(keys):>5} {new_keys:>9} {shown:>9}")
        out[method] = {"seconds": seconds, "kernels": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_status = cpu_fallback(args.tiny, interpret_kernels=True)
    if exit_status is not None:
        return exit_status
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["LIGHTNING_SCAPE_FORCE_TRITON"] = "1"  # the interpreted kernels, not the CPU's references
    methods = [m for m in args.methods.split(",") if m]
    if not methods or any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods must be taken from {list(METHODS)}; got {methods}")
    t0 = time.perf_counter()
    cache = fresh_triton_cache()
    try:
        import triton
    except ImportError:
        print("triton is not installed: the ops run their references, and nothing compiles.")
        return 2

    from benchmarks import bench_kernels, scale

    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "CPU, Triton's interpreter (--tiny): NOT a measurement"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}; Triton cache: {cache} (empty)")
    shared = schedule_shared(args.tiny, device)
    steps = scale.TINY.steps if args.tiny else scale.REFERENCE_STEPS
    passes = compile_passes(methods, shared, steps)
    del shared
    total = sum(p["seconds"] for p in passes.values())
    compiled = compiled_variants()
    counts = ", ".join(f"{k} {'n/a' if v is None else v}" for k, v in compiled.items())
    print(f"\ncompile passes: {total:.1f} s in all; variants compiled in this process: {counts}")
    if args.no_step:
        return 0

    # The sparse step against fused AdamW at N = 1e8, and both ways at a size where every argument the kernels no
    # longer specialize would have been divisible by 16 (chunk rows a multiple of 16): a kernel slowed by less
    # specialization would show in either.
    os.environ.pop("LIGHTNING_SCAPE_FORCE_TRITON", None)  # on the CPU the steps are timed on the references
    n = STEP_NUMEL if cuda else TINY_STEP_NUMEL
    bench = bench_kernels.build_parser().parse_args(["--iters", str(args.iters)])
    rows = bench_kernels.step_rows(n, bench, device.type)
    title = f"optimizer step at d={bench.density}, C={bench.chunk_size}"
    bench_kernels.print_rows(title if cuda else "CPU (tiny size, references): NOT a measurement; " + title, rows,
                             None, bandwidth=cuda)  # fmt: skip
    if rows:
        ratio = rows[0].median_ms / rows[-1].median_ms
        print(f"N={rows[0].numel:,}: SCAPE sparse step / fused AdamW step = {ratio:.3f}")
    aligned = -(-n // (16 * 4096)) * 16 * 4096
    now_ms, before_ms = step_ms_both_ways(aligned, device.type, args.iters)
    print(f"N={aligned:,} ({aligned // 4096} chunk rows): sparse step {now_ms:.3f} ms, {before_ms:.3f} ms with the "
          f"kernels specialized as before (ratio {now_ms / before_ms:.3f})")  # fmt: skip
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
