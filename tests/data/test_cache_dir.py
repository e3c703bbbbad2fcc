"""The cache directory (`data.assets.default_cache_dir`): $MESHLM_CACHE when set, else ~/.cache/meshlm, also when
the variable is set but empty (an empty path is the working directory: a GGUF import once wrote its 540 MB
there, into the repository)."""

from __future__ import annotations

from pathlib import Path

from meshlm.data.assets import default_cache_dir


def test_cache_dir_from_the_variable_or_the_home_default(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    home = Path.home() / ".cache" / "meshlm"
    monkeypatch.setenv("MESHLM_CACHE", "")
    assert default_cache_dir() == home
    monkeypatch.delenv("MESHLM_CACHE")
    assert default_cache_dir() == home
