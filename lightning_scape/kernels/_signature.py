"""One signature per op: its reference's, which mypy holds the op's launcher and entry point to.

Every op has three functions with the same arguments: the pure-PyTorch reference ``<op>_ref``, the Triton
launcher ``<op>_triton`` and the dispatching entry point ``<op>`` the engine calls. The reference is the
definition of the op (its docstring documents the arguments); the other two are declared with
``@signature_of(<op>_ref)``. A parameter added, removed, renamed, reordered or narrowed on either side, or a
return type changed, is then a mypy error rather than a silent drift between the paths, and every caller
of the three is checked against the reference's signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def signature_of(ref: Callable[P, R]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare that the decorated function takes exactly the arguments of ``ref`` and returns its type.

    mypy binds ``P`` and ``R`` to ``ref``'s parameters (names, kinds, types, defaults) and return type,
    then requires the decorated function to accept every call ``ref`` accepts and to return ``R``; callers
    of the result see ``ref``'s signature. At run time the function is returned unchanged: no wrapper, so
    no cost per launch, and the docstring, name and ``inspect.signature`` are the function's own.

    Args:
        ref: The op's reference, the one definition of its signature.

    Returns:
        A decorator that returns its function unchanged.
    """

    def check(fn: Callable[P, R]) -> Callable[P, R]:
        """Return ``fn`` as it is: the check is mypy's, on this parameter's type."""
        return fn

    return check
