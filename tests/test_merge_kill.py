"""A merge SIGKILLed at any point leaves no half file under a final name, and a re-run gives exactly the
output of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3.errors import PipelineError
from eagle3.merge import MergeConfig, read_merged, run_merge
from tests.merge_helpers import part_bytes, random_datasets, read_all

ROOT = Path(__file__).resolve().parents[1]
KW = dict(tokens_per_file=1200, row_group_tokens=300, read_block_bytes=1024, bucket_tokens=200)

# The child runs the real merge and SIGKILLs itself at a chosen moment (the code under test is not changed).
CHILD = """
import os, signal, sys
from eagle3.merge import MergeConfig, run_merge, shuffle, writer
inp, out, point, kw = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
def kill_after(obj, name, n):
    orig, calls = getattr(obj, name), [0]
    def wrapped(*a, **k):
        r = orig(*a, **k)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return r
    setattr(obj, name, wrapped)
if point == "pass1":     # after a few blocks have been spilled to buckets
    kill_after(shuffle.BucketSpill, "add", 5)
elif point == "pass2":   # after the first parquet part is written (in the temp folder)
    kill_after(writer.PartWriter, "_close_file", 1)
elif point == "commit":  # after the first part is renamed into place, before the manifest
    kill_after(os, "replace", 1)
run_merge(MergeConfig(inputs=[inp], output_dir=out, seed=1, **kw))
"""


@pytest.mark.parametrize("point", ["pass1", "pass2", "commit"])
def test_sigkill_then_rerun_equals_uninterrupted_run(tmp_path, point):
    random_datasets(tmp_path / "in", names=("A", "B", "C"), n=80)
    ref = tmp_path / "ref"
    run_merge(MergeConfig(inputs=[str(tmp_path / "in")], output_dir=str(ref), seed=1, **KW))
    out = tmp_path / "out"
    old = run_merge(MergeConfig(inputs=[str(tmp_path / "in")], output_dir=str(out), seed=0, **KW))  # older output
    old_rows = read_all(out)

    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "in"), str(out), point, repr(KW)],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr

    # No half file under a final name: every part there is a whole parquet file.
    for part in out.glob("part-*.parquet"):
        pq.read_metadata(part)
    if point == "commit":
        # the old manifest was withdrawn before any part was replaced: nobody can read a mix
        with pytest.raises(PipelineError, match="merge manifest is missing"):
            read_merged(out)
    else:
        assert read_merged(out).rows == old["rows"] and read_all(out) == old_rows  # old output intact

    again = run_merge(MergeConfig(inputs=[str(tmp_path / "in")], output_dir=str(out), seed=1, **KW))
    assert again["skipped"] is False
    assert part_bytes(out) == part_bytes(ref)
    m, mref = (json.loads((d / "manifest.json").read_text()) for d in (out, ref))
    assert m["files"] == mref["files"] and m["fingerprint"] == mref["fingerprint"]
    assert not [x for x in out.iterdir() if x.name.startswith(".")]  # the killed run's temp folder is gone
