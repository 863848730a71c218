"""Functions that torch.compile must run eagerly (a graph break), without importing dynamo.

Gathers, releases and storage resizes cannot be traced, so the forward hooks and the
attribute-access gather are excluded from compiled graphs. Decorating them with
``torch._dynamo.disable`` at import or wrap time imports dynamo, about 2.4 s of CPU per process
on a 2-core machine, paid by every worker of every job even when nothing is compiled. Nothing
can be compiling before ``torch._dynamo`` is imported, so until then the function runs as it
is; from then on, while dynamo traces, through dynamo's own ``disable`` (made once per
function, on first need).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def _compiling() -> bool:
    """True while dynamo traces the caller (it answers True for this call when tracing): out
    of tracing the function runs as it is, without the cost of dynamo's disabled wrapper on
    every call (a stage-3 forward runs two hooks per unit). Dynamo still intercepts this
    wrapper's frame wherever it would trace it, and there it takes the disabled path."""
    return torch.compiler.is_compiling()


def eager(fn: F) -> F:
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules or not _compiling():
            return fn(*args, **kwargs)
        if not disabled:
            import torch._dynamo

            disabled.append(torch._dynamo.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
