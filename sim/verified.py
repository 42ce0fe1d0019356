"""The default best-fit database of the simulated world: built by the DSE, checked on the chip
model (``dse verify``: the simulated engines run on it) and cached after the first call.

The cache key holds everything the content depends on: the model's fingerprint, the specs of
the chips (so a ``--chip-file`` that changes a chip gets its own entry), metric, SLO scale,
chip selection, the serving-stack profile, the cost model's version, the JAX version (XLA's counts) and the source of the
chip model and of the verification. A cached file that no longer loads is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from dse.catalog import Catalog, default_catalog
from dse.db import BestFitDB
from dse.errors import NeuScaleError
from dse.models import ModelArch

_SOURCES = ("chip.py", "hardware.py", "validate.py")     # what verification runs


def cache_key(arch: ModelArch, metric: str, slo_scale: float, chips: tuple[str, ...] | None,
              catalog: Catalog, stack: str | None = None) -> str:
    from dse.costmodel import MODEL_VERSION
    from dse.stacks import get_stack
    from dse.xla_cost import jax_version
    used = catalog.resolve(chips)
    h = hashlib.sha256(json.dumps(
        [arch.fingerprint(), [c.to_json() for c in used], metric, repr(float(slo_scale)),
         MODEL_VERSION, jax_version(), get_stack(stack).key()], sort_keys=True,
        default=str).encode())
    here = Path(__file__).resolve().parent
    for f in _SOURCES:
        h.update((here / f).read_bytes())
    return h.hexdigest()[:20]


def verified_db(arch: ModelArch, metric: str = "energy", slo_scale: float = 5.0,
                chips: tuple[str, ...] | None = None, catalog: Catalog | None = None,
                progress=None, stack: str | None = None) -> BestFitDB:
    """``stack``: the serving-stack profile (:mod:`dse.stacks`, default ``vllm-tpu``)."""
    from dse.builder import BuildOptions, build
    from dse.cache import cache_path

    from .validate import verify_db
    catalog = catalog or default_catalog()
    from dse.stacks import get_stack
    stack = get_stack(stack).name
    key = cache_key(arch, metric, slo_scale, chips, catalog, stack)
    path = cache_path("db") / f"{arch.name}-{metric}-{slo_scale:g}-{stack}-{key}-verified.json"
    if path.exists():
        try:
            return BestFitDB.load(path)
        except NeuScaleError as e:
            print(f"note: rebuilding the damaged cached database ({e})", file=sys.stderr)
    print(f"building and verifying the best-fit database for {arch.name} (cached at {path})",
          file=sys.stderr)
    db = build(arch, BuildOptions(metric=metric, slo_scale=slo_scale, chips=chips,
                                  progress=progress, stack=stack), catalog=catalog)
    db = verify_db(db, arch, catalog)
    try:
        db.save(path)
    except OSError as e:
        print(f"warning: cannot cache the database at {path} ({e.strerror or e}); it will be "
              "rebuilt next time", file=sys.stderr)
    return db
