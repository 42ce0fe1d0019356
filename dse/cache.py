"""Where NeuScale keeps its on-disk caches (one place for the layout).

The root is ``$NEUSCALE_CACHE_DIR`` if set (and non-empty), else ``$XDG_CACHE_HOME/neuscale``,
else ``~/.cache/neuscale``; it is read from the environment on every call, so a test session
that sets ``NEUSCALE_CACHE_DIR`` (``tests/conftest.py``) redirects every cache. Under it, one
directory per kind:

* ``xla-costs/``: fitted XLA cost polynomials, one JSON per model (:class:`dse.xla_cost.FitCache`);
* ``stepcost/``: tabulated chip-model step costs, one ``.npz`` per allocation
  (:class:`sim.stepcost.StepCostTable`);
* ``db/``: best-fit databases built and verified for the cluster simulator.

A cache is only ever a shortcut: a damaged entry is rebuilt (:func:`say_once` tells the user
once), and a cache that cannot be written (read-only, or ``NEUSCALE_CACHE_DIR`` naming a file) is
run without, after one warning. Writers that merge into a shared entry hold :func:`locked` around
their read-merge-write, so two overlapping runs never drop each other's results.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking (single-writer use only)
    fcntl = None

CACHE_KINDS = ("xla-costs", "stepcost", "db", "embeddings")


def cache_root() -> Path:
    """The directory holding every NeuScale cache (not created here)."""
    env = os.environ.get("NEUSCALE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuscale"


def cache_path(kind: str) -> Path:
    """The directory of one cache kind (one of :data:`CACHE_KINDS`; not created here)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r} (expected one of {', '.join(CACHE_KINDS)})")
    return cache_root() / kind


_said: set[str] = set()


def say_once(message: str, key: str | None = None) -> None:
    """Print ``message`` on stderr, once per process for each ``key`` (default: the message)."""
    k = message if key is None else key
    if k not in _said:
        _said.add(k)
        print(message, file=sys.stderr)


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (its ``.lock`` file, created with it) for the
    ``with`` body. OSError propagates: the caller treats the cache as unwritable."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)            # closing releases the lock


__all__ = ["CACHE_KINDS", "cache_root", "cache_path", "say_once", "locked"]
