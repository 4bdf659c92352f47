"""The speculative evaluation with the target in 3 tensor-parallel gloo ranks (SmolLM2: 9 heads, 3 kv heads):
lossless as at tp_size 1, and the same decoding."""

from __future__ import annotations

import pytest
import torch
from tests.support.configs import phase


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, smollm2_path):
    """A random drafter export over a 2,000-token draft vocabulary: losslessness needs no trained drafter."""
    from eagle3.models import model_info
    from eagle3.train.export import export_drafter
    from eagle3.train.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.vocab import DraftVocab

    info = model_info(smollm2_path)
    vocab = DraftVocab(torch.arange(0, 4000, 2), info.vocab_size)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(info, vocab.size))
    return export_drafter(drafter, vocab, info, [2, 15, 27], tmp_path_factory.mktemp("tp-eval") / "export")


def test_tp3_evaluation_is_lossless_and_decodes_as_tp1(export_dir, smollm2_path, tmp_path):
    from eagle3.evaluate.config import EvalConfig
    from eagle3.evaluate.run import evaluate_phase

    def run(tp: int) -> dict:
        cfg = phase(EvalConfig, export_dir=str(export_dir), model_path=str(smollm2_path), output_dir=str(tmp_path / f"tp{tp}"),
                         prompts=["What is the capital of France?"], ks=[3], max_new_tokens=8, random_floor=False,
                         device="cpu", tp_size=tp, rank_timeout_s=300)
        return evaluate_phase(cfg)

    tp3, tp1 = run(3), run(1)
    assert tp3["tp_size"] == 3 and tp3["identical_to_greedy"] is True and tp3["results"]["trained"]["mismatches"] == []
    one, three = (r["results"]["trained"]["by_k"]["3"]["per_answer"][0] for r in (tp1, tp3))
    assert three["new_tokens"] == one["new_tokens"] == 8
    assert three["accepted_per_round"] == one["accepted_per_round"]


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(export_dir, smollm2_path, tmp_path):
    from eagle3.errors import ConfigError
    from eagle3.evaluate.config import EvalConfig
    from eagle3.evaluate.run import evaluate_phase

    cfg = phase(EvalConfig, export_dir=str(export_dir), model_path=str(smollm2_path), output_dir=str(tmp_path),
                     prompts=["Hi"], device="cpu", tp_size=2)
    with pytest.raises(ConfigError, match=r"extract_tp_size=2 does not divide the target's 9"):
        evaluate_phase(cfg)
