"""A run never deletes or replaces what it did not create: an export folder or a merge temp folder that is not the
pipeline's is refused or left alone, not removed."""

from __future__ import annotations

import pytest
import torch

from eagle3.errors import ConfigError
from tests.merge_helpers import random_datasets
from tests.support.configs import phase


def test_an_export_folder_the_pipeline_did_not_write_is_refused_not_replaced(tmp_path, smollm2_path):
    from eagle3.models import model_info
    from eagle3.train.export import export_drafter
    from eagle3.train.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.vocab import build_draft_vocab

    info = model_info(smollm2_path)
    counts = torch.zeros(info.vocab_size, dtype=torch.int64)
    counts[:300] = 1
    vocab = build_draft_vocab(counts, 100)
    drafter = Eagle3Drafter(DrafterConfig.from_target(info, vocab.size))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=rf"export folder {theirs} exists and holds what no drafter export .*"
                                          r"\(\['notes.txt'\]\): refusing to replace it"):
        export_drafter(drafter, vocab, info, [2, 15, 27], theirs)
    assert (theirs / "notes.txt").read_text() == "mine" and sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]
    ours = export_drafter(drafter, vocab, info, [2, 15, 27], tmp_path / "ours")
    assert export_drafter(drafter, vocab, info, [2, 15, 27], ours) == ours  # a previous export is replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_merge_removes_only_the_temp_folders_a_merge_made(tmp_path):
    from eagle3.merge import MergeConfig, run_merge
    from eagle3.merge.run import TMP_MARKER

    random_datasets(tmp_path / "in", n=10)
    scratch = tmp_path / "scratch"
    mine = scratch / ".merge-tmp-my-own-notes"  # a user's folder that happens to share the prefix
    mine.mkdir(parents=True)
    (mine / "keep.txt").write_text("keep")
    stale = scratch / ".merge-tmp-123-deadbeef"  # what a killed merge leaves: marked
    stale.mkdir()
    (stale / TMP_MARKER).touch()
    out = run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(tmp_path / "out"),
                          vocab_size=49152, tmp_dir=str(scratch)))
    assert out["rows"] == 30
    assert (mine / "keep.txt").read_text() == "keep" and not stale.exists()
    assert sorted(p.name for p in scratch.iterdir()) == [mine.name]
