"""Lazy re-exports for packages whose submodules are heavy (torch, diffusers).

`from omni_core.models import FlowPolicy` works, but `import omni_core.models.loader` alone does not pay for
the rest: a package's `__init__` names what it re-exports, and each name's module is imported on first
access (PEP 562 module `__getattr__`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `exports[name]` (a module path) on first use."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
