"""Failures a user can act on: a bad prompt file before any server starts, a prompt longer than the server's
context as a bad line reported once, a full disk naming the file and the phase (against the real llama.cpp server)."""

from __future__ import annotations

import errno
import json
import os
import types
from collections import Counter

import pytest

from dg_helpers import write_jsonl
from eagle3.datagen import ClientConfig, DatasetSpec, Endpoint, run_dataset
from eagle3.datagen.prompts import read_prompts
from eagle3.io import DiskFullError
from fault_proxy import FaultProxy


def _client(**kw) -> ClientConfig:
    return ClientConfig(**{"model": "smollm2", "concurrency": 1, "request_timeout_s": 60, "backoff_base_s": 0.05,
                           "backoff_max_s": 0.5, "log_every_s": 1.0, **kw})


def test_bad_prompt_file_fails_before_the_local_server_starts(smollm2_path, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    from eagle3_airflow.operators.datagen import DatagenOperator

    marker = tmp_path / "server-started"
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, '{"prompt": "cut'])
    op = DatagenOperator(task_id="datagen", dataset={"name": "BAD", "prompt_file": str(f)},
                         config={"output_dir": str(tmp_path / "out"), "target": {"model_path": str(smollm2_path)},
                                 "mode": "local", "server_command": f"touch {marker}", "server_ready_timeout_s": 5})
    with pytest.raises(AirflowFailException, match=rf"bad prompt line {f}:2: invalid JSON"):
        op.execute({})
    assert not marker.exists()  # the server command never ran


def test_prompt_longer_than_the_context_is_a_bad_line_reported_once(llama_server, smollm2_path, smollm2_tokenizer,
                                                                    tmp_path):
    """llama.cpp's context is 2048 tokens: one 3000-token prompt among short ones. Before: a failure counted against
    the budget (1% of 4 prompts = 0 allowed), so the run failed, and again on every re-run."""
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, {"prompt": "Say yes."},
                                           {"prompt": "Repeat: " + "word " * 3000}, {"prompt": "Say no."}])
    spec = DatasetSpec(name="T", prompt_file=str(f), max_tokens=4, drop_truncated=False)
    folder = tmp_path / "T"
    with FaultProxy(llama_server["port"], lambda i, body: "ok") as px:
        rep = run_dataset(spec, _client(), Endpoint(px.base_url), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
        assert len(px.actions) == 4  # each prompt sent once: the long one is not retried
        assert rep["too_long"] == 1 and rep["this_run"]["failed"] == 0 and rep["missing"] == 0
        assert rep["too_long_lines"][0].startswith(f"{f}:3: ") and "context" in rep["too_long_lines"][0]
        assert rep["generated"] == 3 and rep["status"] == "complete"
        assert not (folder / "errors.jsonl").read_text()
        recorded = [json.loads(x) for x in (folder / "too_long.jsonl").read_text().splitlines()]
        assert [(r["line"], r["reason"]) for r in recorded] == [(3, "too_long")]
        man = json.loads((folder / "manifest.json").read_text())
        assert man["complete"] and man["too_long"] == 1 and man["missing"] == 0
        # a re-run that does not skip (the manifest is gone) still does not send it again
        (folder / "manifest.json").unlink()
        again = run_dataset(spec, _client(), Endpoint(px.base_url), smollm2_path, tmp_path,
                            tokenizer=smollm2_tokenizer)
        assert len(px.actions) == 4 and again["this_run"]["attempted"] == 0
    assert again["too_long"] == 1 and again["too_long_lines"] == rep["too_long_lines"]


def _os_with(**overrides) -> types.SimpleNamespace:
    """The os module with some functions replaced (patching os itself would hit pytest too)."""
    return types.SimpleNamespace(**{**vars(os), **overrides})


def test_disk_full_names_the_file_and_phase_and_a_rerun_resumes(llama_server, smollm2_path, smollm2_tokenizer,
                                                                tmp_path, monkeypatch):
    import eagle3.datagen.store as store
    import eagle3.io as io

    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Say the number {i}."} for i in range(4)])
    spec = DatasetSpec(name="D", prompt_file=str(f), max_tokens=4, drop_truncated=False)  # rows from 4-token answers
    folder = tmp_path / "D"
    gen = folder / "generations.jsonl"
    real_write, lines = os.write, []

    def write_until_full(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(gen):
            lines.append(data)
            if len(lines) == 3:
                return real_write(fd, data[:len(data) // 2])  # half a line fits, then the disk is full
            if len(lines) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(store, "os", _os_with(write=write_until_full))
    with pytest.raises(DiskFullError, match=rf"^datagen, dataset D: disk full writing {gen}: No space left"):
        run_dataset(spec, _client(), Endpoint(llama_server["url"]), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
    monkeypatch.undo()
    assert gen.read_bytes().count(b"\n") == 2 and not (folder / "manifest.json").exists()

    # full again, while tokenized.jsonl is written: generations are complete and kept
    tok = folder / "tokenized.jsonl"
    real_fsync = os.fsync

    def fsync_full_for_tokenized(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder / ".tokenized.jsonl.tmp-")):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(io, "os", _os_with(fsync=fsync_full_for_tokenized))
    with pytest.raises(DiskFullError, match=rf"^datagen, dataset D: disk full writing {tok}: No space left"):
        run_dataset(spec, _client(), Endpoint(llama_server["url"]), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
    monkeypatch.undo()
    assert gen.read_bytes().count(b"\n") == 4 and not tok.exists()

    rep = run_dataset(spec, _client(), Endpoint(llama_server["url"]), smollm2_path, tmp_path,
                      tokenizer=smollm2_tokenizer)
    assert rep["resumed_done"] == 4 and rep["this_run"]["attempted"] == 0 and rep["missing"] == 0
    ids = Counter(json.loads(x)["sample_id"] for x in gen.read_text().splitlines())
    assert set(ids) == {p.sample_id for p in read_prompts(f, "D").prompts} and set(ids.values()) == {1}
    assert json.loads((folder / "manifest.json").read_text())["complete"]


def test_a_dataset_left_with_no_rows_fails_with_the_counts_and_what_to_change(llama_server, smollm2_path,
                                                                             smollm2_tokenizer, tmp_path):
    """max_tokens=1 cuts every answer (finish_reason=length), so every one is dropped as truncated. Before: the
    manifest said complete with 0 rows and the merge failed later. The answers are kept: a re-run with
    drop_truncated=false does not ask again and completes."""
    from eagle3.datagen.run import EmptyDatasetError

    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Tell me a long story."}, {"prompt": "Describe Paris."}])
    spec = DatasetSpec(name="Z", prompt_file=str(f), max_tokens=1)
    with FaultProxy(llama_server["port"], lambda i, body: "ok") as px:
        with pytest.raises(EmptyDatasetError, match=r"dataset Z: no usable sample: of 2 prompts .* truncated 2\. "
                                                    r"What to change: truncated: raise the dataset's max_tokens .*"
                                                    r"drop_truncated=false") as e:
            run_dataset(spec, _client(), Endpoint(px.base_url), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
        assert not e.value.retried
        folder = tmp_path / "Z"
        assert not (folder / "manifest.json").exists()
        assert json.loads((folder / "report.json").read_text())["status"] == "failed"
        spec = DatasetSpec(name="Z", prompt_file=str(f), max_tokens=1, drop_truncated=False)
        rep = run_dataset(spec, _client(), Endpoint(px.base_url), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
        assert rep["rows"] == 2 and len(px.actions) == 2
