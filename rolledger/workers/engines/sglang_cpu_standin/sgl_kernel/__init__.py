"""A STAND-IN for SGLang's `sgl_kernel` package, for running a real SGLang server on a CPU-only host.

`sglang-kernel` is published only as CUDA builds (no CPU wheel, no sdist), and SGLang's CPU path imports a few of
its CPU kernels by name at start-up, which fails on `libcuda.so.1`. This module is put first on the SGLang
server's PYTHONPATH by workers.engines.sglang_server when the server runs on CPU and the real package cannot load:
every name it is asked for is a function that raises NotImplementedError naming itself, so an SGLang code path
that really needs a kernel fails loudly instead of computing something else. None is called on the paths rolledger
uses (torch_native attention, no CUDA graphs; checked by the SGLang tier, tests/sglang_tier). Drop it once a CPU
build of sglang-kernel is installable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

STANDIN = True  # what workers.engines.sglang_server checks to say the server runs with this stand-in


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name}: rolledger's CPU stand-in has no kernel (CUDA-only package)")

    kernel.__name__ = name
    return kernel
