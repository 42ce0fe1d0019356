import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Every test session lowers into its own XLA-fit cache: no state leaks in from ~/.cache."""
    d = tmp_path_factory.mktemp("neuscale-cache")
    old = os.environ.get("NEUSCALE_CACHE_DIR")
    os.environ["NEUSCALE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("NEUSCALE_CACHE_DIR", None)
    else:
        os.environ["NEUSCALE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def llama8b_db(tmp_path_factory, _private_cache):
    """A real best-fit database for llama3-8b (all four chips, energy metric), built once."""
    from dse import BuildOptions, build
    db = build("llama3-8b", BuildOptions(workers=2, progress=False))
    path = tmp_path_factory.mktemp("db") / "bestfit-llama3-8b-energy.json"
    db.save(path)
    return db, path
