"""Where swarmlm keeps files between runs."""

from __future__ import annotations

from pathlib import Path


def default_cache_dir() -> Path:
    """~/.cache/swarmlm (the CLI lets SWARMLM_CACHE_DIR or --cache-dir override it)."""
    return Path.home() / ".cache" / "swarmlm"
