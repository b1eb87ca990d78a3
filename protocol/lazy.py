"""Package exports loaded on first use, so that parsing a command's arguments stays light (no torch, hivemind)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, tuple[str, str | None]]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: name -> (module, attribute); attribute None: the module itself."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = exports[name]
        loaded = importlib.import_module(module)
        return loaded if attribute is None else getattr(loaded, attribute)

    return __getattr__
