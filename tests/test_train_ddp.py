"""Training on 2 gloo ranks (DistributedDataParallel or FSDP2, via eagle3.launch) against one process with the same
global batch; a rank SIGKILLed mid-run fails the run, and the run resumes exactly, at 2 ranks or at 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.tiny_targets import CAPTURE, build_tiny_target
from tests.support.configs import phase

STEPS = 20
SAMPLES = 15  # chunks of 5 with batch_size 4: micro-batches of 4 and 1 (rank 1 then has nothing to train on)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    from eagle3.models import load_model
    from tests.support import selfdistill as sd

    root = tmp_path_factory.mktemp("ddp")
    target = build_tiny_target("llama", root / "target", smollm2_path)
    model = load_model(target)
    samples = sd.generate_answers(model, smollm2_tokenizer, sd.make_prompts(SAMPLES), max_new_tokens=12)
    dirs = sd.write_shards(model, samples, root / "shards", CAPTURE, num_shards=1, chunk_samples=5,
                           dtype=torch.float32, model_path=str(target))
    return target, dirs


def config(shards, out: Path, **kw):
    from eagle3.train.config import TrainConfig

    target, dirs = shards
    base = dict(shard_dirs=[str(d) for d in dirs], model_path=str(target), output_dir=str(out), batch_size=4,
                max_steps=STEPS, lr=3e-3, warmup_ratio=0.1, ttt_steps=3, checkpoint_every=3, seed=3,
                dist_timeout_s=60.0)
    base.update(kw)
    return phase(TrainConfig, **base)


@pytest.fixture(scope="module")
def one_process(shards, tmp_path_factory):
    from eagle3.train.trainer import read_metrics, train

    out = tmp_path_factory.mktemp("n1")
    res = train(config(shards, out))
    return read_metrics(out / "metrics.jsonl"), res["drafter"]


def assert_same_run(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(got, ref):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        torch.testing.assert_close(torch.tensor([a["loss"], a["grad_norm"], *a["loss_k"], *a["acc_k"]]),
                                   torch.tensor([b["loss"], b["grad_norm"], *b["loss_k"], *b["acc_k"]]),
                                   rtol=1e-4, atol=1e-5)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_follow_the_one_process_loss_curve(shards, one_process, tmp_path, parallel):
    from eagle3.train.trainer import read_metrics, train

    ref, ref_drafter = one_process
    assert ref[-1]["loss"] < ref[0]["loss"]  # it learns: the comparison is over a moving curve
    res = train(config(shards, tmp_path, num_gpus=2, parallel=parallel))
    assert res["steps"] == STEPS
    assert_same_run(read_metrics(tmp_path / "metrics.jsonl"), ref)
    assert_same_weights(res["drafter"], ref_drafter)


def test_a_killed_rank_fails_the_run_and_it_resumes_at_two_ranks_then_one(shards, one_process, tmp_path,
                                                                         monkeypatch, capfd):
    """Rank 1 dies after step 7 of a DDP run (checkpoint at 6); the run resumed with FSDP2 loses rank 0 after step
    14 (checkpoint at 12); one process finishes. The whole curve and the weights are the uninterrupted run's: the
    checkpoints mean the same at any N, DDP or FSDP2."""
    from eagle3.faults import KILL_RANK_VAR
    from eagle3.launch import RankFailed
    from eagle3.train.trainer import read_metrics, train

    ref, ref_drafter = one_process
    out = tmp_path / "run"
    for victim, step, checkpoint, parallel in ((1, 7, 6, "ddp"), (0, 14, 12, "fsdp")):
        monkeypatch.setenv(KILL_RANK_VAR, f"rank={victim},after_steps={step},once_file={tmp_path / str(step)}")
        with pytest.raises(RankFailed) as e:
            train(config(shards, out, num_gpus=2, parallel=parallel))
        assert e.value.rank == victim and "SIGKILL" in str(e.value)
        assert sorted(p.name for p in (out / "checkpoints").glob("step-*.pt"))[-1] == f"step-{checkpoint:08d}.pt"
    # the ranks' INFO lines reach the task's stdout (the task log), each naming its rank
    ranks_out = capfd.readouterr().out
    assert "[eagle3-train rank 0] INFO eagle3.train.checkpoint: resumed from" in ranks_out
    assert "[eagle3-train rank 1] INFO eagle3.train.checkpoint: resumed from" in ranks_out
    monkeypatch.delenv(KILL_RANK_VAR)
    res = train(config(shards, out, num_gpus=1))
    assert_same_run(read_metrics(out / "metrics.jsonl"), ref)
    assert_same_weights(res["drafter"], ref_drafter)


def test_a_global_batch_that_cannot_be_spread_is_refused(shards, tmp_path):
    from eagle3.errors import ConfigError

    with pytest.raises(ConfigError, match=r"batch_size 2 cannot be spread over train_num_gpus 4"):
        config(shards, tmp_path, batch_size=2, num_gpus=4)


@pytest.mark.slow
def test_fsdp2_checkpoint_gather_in_a_loop_of_saves():
    """60 FSDP2 steps (grad_accum 2, 2 gloo ranks), each followed by the checkpoint gather: every gather equals
    torch's get_state_dict and owns its memory (asserted in the ranks); no rank dies."""
    from eagle3.launch import run_distributed

    out = run_distributed("tests.launch_ranks:fsdp_save_loop", (60,), nprocs=2, backend="gloo", timeout_s=120)
    assert out[0]["checksum"] == out[1]["checksum"] != 0


def test_a_run_folder_copied_elsewhere_resumes(shards, tmp_path):
    """The fingerprint holds what defines the result (params, the target's and the shards' content), not where it
    lives: a run folder copied to other storage (and the shards with it) resumes; before, its checkpoints were
    "written with other training params" because output_dir and the paths were in the fingerprint."""
    import shutil

    from eagle3.train.trainer import train

    target, dirs = shards
    first = train(config(shards, tmp_path / "a", max_steps=6))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = [tmp_path / "shards" / d.name for d in dirs]
    for d, m in zip(dirs, moved):
        shutil.copytree(d, m)
    cfg = config(shards, tmp_path / "b", max_steps=6)
    cfg = type(cfg)(**{**cfg.__dict__, "shard_dirs": [str(m) for m in moved]})
    assert cfg.fingerprint() == config(shards, tmp_path / "a", max_steps=6).fingerprint()
    again = train(cfg)
    assert again["steps"] == first["steps"] == 6


@pytest.fixture(scope="module")
def even_shards(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    """16 samples in chunks of 4: batch_size 4 and 2 micro-batches of 2 take the same samples a step."""
    from eagle3.models import load_model
    from tests.support import selfdistill as sd

    root = tmp_path_factory.mktemp("accum")
    target = build_tiny_target("llama", root / "target", smollm2_path)
    model = load_model(target)
    samples = sd.generate_answers(model, smollm2_tokenizer, sd.make_prompts(16), max_new_tokens=12)
    for i, s in enumerate(samples):  # answers of unequal length: micro-batches with unequal masked slots
        s["loss_mask"] = list(s["loss_mask"])
        cut = len(s["loss_mask"]) - (i % 4) * 3
        s["loss_mask"][cut:] = [0] * (len(s["loss_mask"]) - cut)
    dirs = sd.write_shards(model, samples, root / "shards", CAPTURE, num_shards=1, chunk_samples=4,
                           dtype=torch.float32, model_path=str(target))
    return target, dirs


def test_grad_accum_trains_what_one_batch_of_its_micro_batches_trains(even_shards, tmp_path):
    """The step's loss is a mean over every masked slot of its micro-batches: batch 2 x grad_accum 2 follows
    batch 4's loss curve and ends at its weights (a mean of the micro-batches' own means would not: their answers
    differ in length)."""
    from eagle3.train.trainer import read_metrics, train

    one = train(config(even_shards, tmp_path / "b4"))
    two = train(config(even_shards, tmp_path / "b2x2", batch_size=2, grad_accum=2))
    assert_same_run(read_metrics(tmp_path / "b2x2" / "metrics.jsonl"), read_metrics(tmp_path / "b4" / "metrics.jsonl"))
    assert_same_weights(two["drafter"], one["drafter"])


def test_long_samples_run_in_parts_that_train_what_the_whole_micro_batch_trains(shards, one_process, tmp_path):
    """micro_batch_tokens 1: every sample its own forward and backward (the rows a part takes are bounded by its
    padded tokens); the step's loss is still the mean over all its slots, so the run is one_process's (batch 4 in
    one forward). Two ranks under FSDP2, where every forward gathers the parameters from both: rank 1's share of a
    chunk's last micro-batch (one sample) is empty, yet it runs as many parts as rank 0 (a masked sample)."""
    from eagle3.train.batches import part_rows
    from eagle3.train.distributed import Ranks
    from eagle3.train.trainer import read_metrics, train

    samples = [{"input_ids": [0] * n, "loss_mask": torch.ones(n)} for n in (30, 90, 50, 70, 10)]
    assert part_rows(samples, 256, 3, 512, 64) == 2 and part_rows(samples, 256, 3, 512, 1) == 2  # 128 / 90 long
    assert part_rows(samples, 1, 3, 512, 1) == 1 and part_rows(samples, 0, 3, 512, 1) == 3  # at least 1; no limit
    parts = [Ranks(r, 2).share_in_parts(samples, 2) for r in (0, 1)]
    assert [[len(s["input_ids"]) for s in p] for p in parts[0]] == [[30, 50], [10]]
    assert [[len(s["input_ids"]) for s in p] for p in parts[1]] == [[90, 70], [30]]
    assert not parts[1][1][0]["loss_mask"].any()  # rank 1's last part: a masked sample, no loss

    ref, ref_drafter = one_process
    res = train(config(shards, tmp_path / "n1", micro_batch_tokens=1))
    assert_same_run(read_metrics(tmp_path / "n1" / "metrics.jsonl"), ref)
    assert_same_weights(res["drafter"], ref_drafter)
    res = train(config(shards, tmp_path / "fsdp", micro_batch_tokens=1, num_gpus=2, parallel="fsdp"))
    assert_same_run(read_metrics(tmp_path / "fsdp" / "metrics.jsonl"), ref)
    assert_same_weights(res["drafter"], ref_drafter)


def test_a_micro_batch_the_gpu_cannot_hold_names_the_knobs_that_fit_it(shards, tmp_path):
    from eagle3.errors import DeviceOOMError, failure_kind
    from eagle3.train.batches import out_of_memory

    cfg = config(shards, tmp_path, batch_size=32, max_seq_len=2048)
    batch = {"input_ids": torch.zeros(32, 2048, dtype=torch.long)}
    with pytest.raises(DeviceOOMError) as got:
        with out_of_memory(cfg, batch, 28487):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.95 GiB.")
    msg = str(got.value)
    assert "32 samples x 2048 tokens" in msg and "7.5 GB" in msg and "micro_batch_tokens (32768 now" in msg
    assert "max_seq_len (2048)" in msg and failure_kind(got.value) == "out of memory" and "one sample" not in msg
