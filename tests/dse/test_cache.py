"""The on-disk cache layout (dse.cache): one root, one directory per kind."""
from pathlib import Path

import pytest

from dse.cache import CACHE_KINDS, cache_path, cache_root
from dse.xla_cost import cache_dir


def test_neuscale_cache_dir_is_the_root(monkeypatch, tmp_path):
    monkeypatch.setenv("NEUSCALE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert [cache_path(k) for k in CACHE_KINDS] == [tmp_path / "xla-costs",
                                                    tmp_path / "stepcost", tmp_path / "db",
                                                    tmp_path / "embeddings"]
    assert cache_dir() == tmp_path / "xla-costs"


def test_default_root_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("NEUSCALE_CACHE_DIR", "")          # empty counts as unset
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path("db") == tmp_path / "xdg" / "neuscale" / "db"
    monkeypatch.delenv("NEUSCALE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == Path(tmp_path / "home" / ".cache" / "neuscale" / "xla-costs")


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="xla-costs"):
        cache_path("xla")
