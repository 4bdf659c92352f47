import pytest

from eagle3.io import atomic_path, atomic_write_json, fingerprint, read_json, remove_stale_temps


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a" / "x.json"
    atomic_write_json(p, {"v": 1})
    atomic_write_json(p, {"v": 2})
    assert read_json(p) == {"v": 2}
    assert [f.name for f in p.parent.iterdir()] == ["x.json"]


def test_failed_write_keeps_old_file(tmp_path):
    p = tmp_path / "x.json"
    atomic_write_json(p, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert read_json(p) == {"v": 1}
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]


def test_invalid_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{\n"a": 1,\n}')
    with pytest.raises(ValueError, match=r"bad.json:3"):
        read_json(p)


def test_stale_temps_removed_and_fingerprint_stable(tmp_path):
    (tmp_path / ".x.json.tmp-1-abc").write_text("junk")
    (tmp_path / "keep.json").write_text("{}")
    assert remove_stale_temps(tmp_path) == 1
    assert [f.name for f in tmp_path.iterdir()] == ["keep.json"]
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
