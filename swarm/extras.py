"""Optional extras (`pip install 'swarmlm[EXTRA]'`): which of their modules are missing, checked before slow work.

A command that needs an extra calls `require_extra` first, so that a missing package is said at once with the
install command, not as an ImportError after minutes of work; `missing_modules` lets a command go on without
an extra and say what it skips (`swarmlm bench` without matplotlib writes its tables and JSON, no plots).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# the modules each extra of pyproject.toml provides, by import name
EXTRAS: dict[str, tuple[str, ...]] = {
    "bench": ("matplotlib",),
    "api": ("fastapi", "uvicorn", "prometheus_client"),
}


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The modules among `modules` that cannot be imported here (found without importing them)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module without a spec
            found = False
        if not found:
            missing.append(name)
    return missing


def install_hint(extra: str) -> str:
    return f"pip install 'swarmlm[{extra}]'"


def require_extra(extra: str, command: str, modules: Iterable[str] | None = None) -> None:
    """Raise SystemExit naming the missing modules and the install command if `extra` is not installed.

    Args:
        extra: the extra's name in pyproject.toml (a key of EXTRAS unless `modules` is given).
        command: what needs it, for the message ("swarmlm api").
        modules: the import names to check (default: EXTRAS[extra]).
    """
    missing = missing_modules(EXTRAS[extra] if modules is None else modules)
    if missing:
        raise SystemExit(
            f"error: {command} needs {', '.join(missing)} (the '{extra}' extra); install it with: {install_hint(extra)}"
        )
