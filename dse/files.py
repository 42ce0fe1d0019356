"""Reading and writing the files a user hands us or we keep: one careful way for all of them.

* :func:`read_text` reads a regular file of bounded size as UTF-8 (a device such as /dev/zero,
  a FIFO or a directory is refused at once, not read until memory runs out);
* :func:`write_atomic` writes through a temporary file in the destination's directory and
  renames it into place: a reader never sees half a file, an interrupted write (Ctrl-C
  included) leaves no temporary file behind, and the file gets the mode a plain ``open`` would
  give it (the umask's, or the mode of the file it replaces) rather than ``mkstemp``'s 0600.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .errors import NeuScaleError

MiB = 1 << 20


def read_text(path: str | Path, what: str, max_bytes: int = 64 * MiB) -> str:
    """The text of ``path``: a regular file of at most ``max_bytes``, UTF-8."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise NeuScaleError(f"no {what} at {str(p)!r}") from None
    except OSError as e:
        raise NeuScaleError(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise NeuScaleError(f"{what} {str(p)!r} is {kind}")
    if st.st_size > max_bytes:
        raise NeuScaleError(f"{what} {str(p)!r} is {st.st_size / MiB:,.1f} MiB, larger than "
                            f"any real one (limit {max_bytes / MiB:,.0f} MiB)")
    try:
        with open(p, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as e:
        raise NeuScaleError(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise NeuScaleError(f"{what} {str(p)!r} is larger than any real one "
                            f"(limit {max_bytes / MiB:,.0f} MiB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NeuScaleError(f"{what} {str(p)!r} is not UTF-8 text (byte {e.start})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes, prefix: str = ".tmp-") -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); parent directories
    are created. OSError propagates (the caller words it)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=prefix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return p
