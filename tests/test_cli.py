"""Every command-line entry fails with one line naming what is wrong and where, a non-zero exit and no
traceback unless --debug."""

from __future__ import annotations

import errno
import json
import os
import types

import pytest

from eagle3.cli import main


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def mtbench_source(tmp_path):
    src = tmp_path / "question.jsonl"
    src.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]}) + "\n")
    return src


def test_prompts_command_on_a_full_disk_and_over_a_fifo(tmp_path, monkeypatch, capsys):
    import eagle3.io as io

    src, out = mtbench_source(tmp_path), tmp_path / "out.jsonl"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io, "os", types.SimpleNamespace(**{**vars(os), "fsync": full}))
    assert main(["prompts", "mtbench", str(out), "--source", str(src)]) == 1
    assert one_line(capsys).startswith(f"eagle3 prompts: disk full writing {out}: No space left")
    monkeypatch.undo()
    os.mkfifo(tmp_path / "fifo")
    assert main(["prompts", "mtbench", str(tmp_path / "fifo"), "--source", str(src)]) == 1
    assert f"output {tmp_path / 'fifo'} is a FIFO, not a regular file" in one_line(capsys)
    assert main(["prompts", "mtbench", str(out), "--source", str(src)]) == 0 and out.is_file()


def test_datagen_command_config_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    from eagle3.datagen.__main__ import main as datagen_main
    from eagle3.errors import ConfigError

    args = ["--spec", '{"name": "A", "prompt_file": "p.jsonl", "max_tokens": -3}', "--out", str(tmp_path),
            "--tokenizer", str(tmp_path), "--base-url", "http://127.0.0.1:9/v1"]
    assert datagen_main(args) == 1
    line = one_line(capsys)
    assert line.startswith("python -m eagle3.datagen: ") and "max_tokens" in line
    assert datagen_main(["--spec", '{"name": ', *args[2:]]) == 1
    assert one_line(capsys).startswith("python -m eagle3.datagen: --spec: invalid JSON")
    with pytest.raises(ConfigError, match="max_tokens"):
        datagen_main([*args, "--debug"])
