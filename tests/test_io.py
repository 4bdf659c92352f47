import pytest

from eagle3.io import atomic_path, atomic_write_bytes, atomic_write_json, fingerprint, read_json, remove_stale_temps


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


def test_an_output_that_is_not_a_regular_file_is_refused_and_a_symlink_written_through(tmp_path):
    import os
    import stat

    import pytest

    from eagle3.errors import ConfigError

    fifo, folder = tmp_path / "fifo", tmp_path / "dir"
    os.mkfifo(fifo)
    folder.mkdir()
    for path, kind in ((fifo, "FIFO"), (folder, "directory")):
        with pytest.raises(ConfigError, match=rf"output {path} is a {kind}, not a regular file: refusing"):
            atomic_write_bytes(path, b"x")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and folder.is_dir() and not list(folder.iterdir())
    # a link to a device is refused too (the check follows the link)
    (tmp_path / "to-fifo").symlink_to(fifo)
    with pytest.raises(ConfigError, match="is a FIFO"):
        atomic_write_bytes(tmp_path / "to-fifo", b"x")
    # a symlink: its target gets the new bytes, the link stays a link
    target = tmp_path / "real" / "data.json"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_bytes(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new" and link.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["data.json"]


def test_prefetched_hands_on_items_and_errors_and_stops_its_thread_when_closed():
    """eagle3.prefetch runs the producer ahead on a thread (the merge's pass 2, training's batches): items arrive in
    order, a producer's exception reaches the consumer, and leaving the loop early stops the producer."""
    import threading

    import pytest

    from eagle3.prefetch import prefetched

    assert list(prefetched(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("chunk 7 unreadable")

    got = prefetched(failing(), name="t-fail")
    assert next(got) == 1
    with pytest.raises(ValueError, match="chunk 7"):
        next(got)

    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    stream = prefetched(endless(), depth=2, name="t-endless")
    assert [next(stream) for _ in range(5)] == [0, 1, 2, 3, 4]
    stream.close()
    assert not any(t.name == "t-endless" for t in threading.enumerate())
    assert len(produced) <= 5 + 2 + 2  # the queue's depth and the item in hand, no more
