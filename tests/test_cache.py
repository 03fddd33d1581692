"""Cache folders are built atomically and only once."""

import pytest

from xpuspec.cache import atomic_folder, cached_folder


def test_failed_build_leaves_nothing(tmp_path):
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with atomic_folder(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_cached_folder_builds_once(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "a").write_text("1")

    first = cached_folder(tmp_path / "e", build)
    second = cached_folder(tmp_path / "e", build)
    assert first == second and len(calls) == 1 and (first / "a").read_text() == "1"
