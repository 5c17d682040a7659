"""A jit that imports triton at the first launch, not when `kernels` is imported.

Triton reads TRITON_INTERPRET once, when it is first imported, so importing it late lets the kernel
tests switch the interpreter on after the engine (and with it `kernels`) was imported. It also keeps
`import kernels` working, and cheap, where triton is missing: there only the references run.
Kernel files name `tl` only inside kernels; the first launch binds it in their module.
"""

from __future__ import annotations

import functools
import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None


class lazy_jit:
    def __init__(self, fn):
        self.fn = fn

    @functools.cached_property
    def _jitted(self):
        if not HAS_TRITON:
            raise RuntimeError("triton is not installed; use the *_reference functions")
        import triton
        import triton.language

        self.fn.__globals__["tl"] = triton.language
        return triton.jit(self.fn)

    def __getitem__(self, grid):
        return self._jitted[grid]


def next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()
