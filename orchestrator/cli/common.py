"""What every command group shares: the parser that answers bad arguments in one line, numeric
argument types, the chip catalog, JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from dse.errors import NeuScaleError


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line ``error: ...`` (exit status 2), as every
    other error a user can cause; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def number(name: str, cast=float, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False):
    """argparse type: ``cast`` of the text within [lo, hi] (``lo_open``: lo excluded)."""
    what = "an integer" if cast is int else "a number"

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what} (got {text!r})") from None
        if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) \
                or (hi is not None and v > hi):
            rng = (f"between {lo:g} and {hi:g}" if hi is not None
                   else f"{'>' if lo_open else '>='} {lo:g}")
            raise argparse.ArgumentTypeError(f"{name} must be {rng} (got {text})")
        return v
    return parse


def positive_int(name: str):
    return number(name, int, lo=1)


def positive_float(name: str):
    return number(name, float, lo=0, lo_open=True)


def fraction(name: str):
    return number(name, float, lo=0, hi=1)


def add_common(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
    sp.add_argument("--chip-file", action="append", metavar="FILE",
                    help="add chips from a JSON/YAML file (ChipSpec fields); repeatable")
    if json_flag:
        sp.add_argument("--json", action="store_true", help="machine-readable output")


def add_stack(sp: argparse.ArgumentParser, default: str | None = "vllm-tpu",
              what: str = "the serving stack whose software costs the vPods pay") -> None:
    """``--stack NAME``: a serving-stack profile (:mod:`dse.stacks`)."""
    from dse.stacks import DEFAULT_STACK, stack_names
    sp.add_argument("--stack", choices=stack_names(), default=default,
                    metavar="|".join(stack_names()),
                    help=f"{what}: per-step and per-sequence host time, per-request time, "
                         f"attention-kernel efficiency (default {default or DEFAULT_STACK})")


def catalog(args: argparse.Namespace):
    from dse.catalog import default_catalog
    return default_catalog(args.chip_file or [])


def print_json(obj: Any) -> None:
    print(json.dumps(clean_json(obj), indent=2, default=json_default))


def clean_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (and numpy scalar) made strict JSON: NaN and
    infinities become null, which strict parsers (JavaScript's) accept."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if hasattr(obj, "item") and not hasattr(obj, "__len__"):
        return clean_json(obj.item())
    return obj


def json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def progress_bar(enabled: bool, total: float, desc: str, unit: str):
    """A tqdm bar on stderr when it is a terminal and ``enabled`` (else None)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def chip_list(cat, text: str | None, flag: str) -> tuple[str, ...] | None:
    """``v5p,V6E,npu-d`` -> canonical chip versions through the catalog (aliases and any case
    resolve; unknown names and repeats are errors). None when ``text`` is empty."""
    if text is None:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise NeuScaleError(f"{flag} {text!r} names no chip; known: {', '.join(cat.names())}")
    out: list[str] = []
    for n in names:
        c = cat.get(n).name
        if c in out:
            raise NeuScaleError(f"{flag} {text!r} names {c} twice")
        out.append(c)
    return tuple(out)


def workers(n: int) -> int:
    """Worker processes, at most one per CPU (more only add memory and contention)."""
    cpus = os.cpu_count() or 1
    if n > cpus:
        print(f"note: --workers {n} exceeds the {cpus} CPUs of this machine; using {cpus}",
              file=sys.stderr)
        return cpus
    return n


def check_out_file(path: str | Path, flag: str = "--out") -> Path:
    """Fail now, not after the work, when ``path`` cannot be written as a file."""
    p = Path(path)
    if p.is_dir():
        raise NeuScaleError(f"{flag} {str(p)!r} is a directory; give a file path")
    _check_writable_dir(p.parent, flag, str(p))
    return p


def check_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """Fail now when ``path`` cannot be (made) a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise NeuScaleError(f"{flag} {str(p)!r} exists and is not a directory")
    _check_writable_dir(p, flag, str(p))
    return p


def _check_writable_dir(d: Path, flag: str, shown: str) -> None:
    for parent in [d, *d.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise NeuScaleError(f"{flag} {shown!r}: {str(parent)!r} is a file, not a "
                                    "directory")
            try:      # a real probe: permissions, read-only mounts, root squash alike
                tempfile.TemporaryFile(dir=parent).close()
            except OSError as e:
                raise NeuScaleError(f"{flag} {shown!r}: cannot write in {str(parent)!r} "
                                    f"({e.strerror or e})") from None
            return
