"""Training config and training on a tiny local target (no model download): bounds, unknown keys, the length
cap, a head_dim that is not hidden / heads, checkpoints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from eagle3.errors import ConfigError, PipelineError
from eagle3.knobs import build, form_params
from eagle3.evaluate.config import EvalConfig
from eagle3.train.config import TrainConfig

# GLM-4.5-like: hidden / heads (40 / 3) is not the head width, and 13 is odd, which RoPE cannot rotate
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 40, 3, 1, 16, 96, 4
CAPTURE = [1, 2, 3]
SAMPLE_LENGTHS = [20, 9, 14, 6, 11, 17]


def required(tmp_path: Path) -> dict:
    return {"shard_dirs": [str(tmp_path / "shard")], "target": {"model_path": str(tmp_path / "target")},
            "output_dir": str(tmp_path / "train")}


def test_ttt_steps_has_one_bound_for_the_form_and_the_trainer(tmp_path):
    form_max = form_params(TrainConfig)["ttt_steps"]["schema"]["maximum"]
    assert build(TrainConfig, {**required(tmp_path), "ttt_steps": form_max}, "train").ttt_steps == form_max
    with pytest.raises(ConfigError, match="ttt_steps"):
        build(TrainConfig, {**required(tmp_path), "ttt_steps": form_max + 1}, "train")


def test_bad_train_and_eval_params_are_config_errors_naming_them(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown param\(s\) \['ttt_step'\]"):  # a typo in train_overrides
        build(TrainConfig, {**required(tmp_path), "ttt_step": 3}, "train")
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        build(TrainConfig, {**required(tmp_path), "draft_vocab_size": 0}, "train")
    with pytest.raises(ConfigError, match=r"data param max_seq_len 5 must be >= train param ttt_steps \+ 2 = 9"):
        build(TrainConfig, {**required(tmp_path), "data": {"max_seq_len": 5}, "ttt_steps": 7}, "train")
    with pytest.raises(ConfigError, match=r"train.data: unknown param\(s\) \['max_seq_length'\]"):
        build(TrainConfig, {**required(tmp_path), "data": {"max_seq_length": 5}}, "train")
    eval_required = {"export_dir": "x", "target": {"model_path": "y"}, "output_dir": "z", "prompts": ["hi"]}
    with pytest.raises(ConfigError, match=r"eval param ks \(trigger-form param eval_ks\) must be >= 1"):
        build(EvalConfig, {**eval_required, "ks": [5, 0]}, "eval")
    with pytest.raises(ConfigError, match=r"eval param ks .* lists a k twice: \[5, 5\]"):
        build(EvalConfig, {**eval_required, "ks": [5, 5]}, "eval")
    with pytest.raises(ConfigError, match=r"unknown param\(s\) \['k'\]"):  # the single k became ks
        build(EvalConfig, {**eval_required, "k": 5}, "eval")
    names = set(form_params(EvalConfig))
    assert names == {"eval_prompts", "eval_ks", "eval_max_new_tokens", "eval_max_prompts", "eval_batch_tokens"}
    assert form_params(EvalConfig)["eval_ks"]["default"] == [5, 7]
    assert "max_seq_len" not in form_params(TrainConfig)  # the run's data section holds it


# ------------------------------------------------------------------ a tiny target and its states


def write_tiny_target(d: Path) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
               "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g)}, str(d / "model.safetensors"))
    return d


def write_tiny_shard(d: Path, lengths: list[int]) -> Path:
    from eagle3.extract.format import ShardManifest, write_chunk

    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    T = sum(lengths)
    man = ShardManifest(shard=0, model_path="tiny", capture_layers=CAPTURE, hidden_size=HIDDEN, dtype="float32")
    mask = torch.cat([(torch.arange(n) >= 2).to(torch.uint8) for n in lengths])
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    man.chunks.append(write_chunk(d, 0, {
        "input_ids": torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int32), "loss_mask": mask,
        "aux_hidden": torch.randn(T, len(CAPTURE) * HIDDEN, generator=g), "final_hidden": torch.randn(T, HIDDEN,
                                                                                                   generator=g),
        "sample_offsets": offsets, "sample_rows": torch.arange(len(lengths))}, fsync=False))
    man.complete = True
    man.save(d)
    return d


@pytest.fixture
def tiny(tmp_path):
    write_tiny_target(tmp_path / "target")
    write_tiny_shard(tmp_path / "shard", SAMPLE_LENGTHS)
    return tmp_path


def tiny_config(tmp_path: Path, **kw) -> TrainConfig:
    return build(TrainConfig, {**required(tmp_path), "max_steps": 3, "batch_size": 2, "ttt_steps": 2,
                               "checkpoint_every": 1, "device": "cpu", **kw}, "train")


def test_drafter_takes_the_targets_head_dim_and_exports_it(tiny):
    from eagle3.train.export import load_exported
    from eagle3.train.run import train_phase

    report = train_phase(tiny_config(tiny))
    assert report["steps"] == 3
    export = Path(report["export_dir"])
    cfg = json.loads((export / "config.json").read_text())
    assert (cfg["head_dim"], cfg["num_attention_heads"], cfg["hidden_size"]) == (HEAD_DIM, HEADS, HIDDEN)
    drafter, _, _ = load_exported(export)
    attn = drafter.midlayer.self_attn
    assert attn.q_proj.weight.shape == (HEADS * HEAD_DIM, 2 * HIDDEN)
    assert attn.k_proj.weight.shape == (KV_HEADS * HEAD_DIM, 2 * HIDDEN)
    assert attn.o_proj.weight.shape == (HIDDEN, HEADS * HEAD_DIM)
    # the round trip rebuilds the trained drafter: the exported (bf16) weights come back
    ckpt = torch.load(sorted((tiny / "train" / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)["model"]
    torch.testing.assert_close(attn.q_proj.weight, ckpt["midlayer.self_attn.q_proj.weight"].to(torch.bfloat16).float())


def test_samples_past_max_seq_len_are_counted_warned_once_and_reported(tiny, caplog):
    from eagle3.train.run import train_phase

    cap = 12
    caplog.set_level(logging.WARNING)
    report = train_phase(tiny_config(tiny, data={"max_seq_len": cap}))
    cut = [n for n in SAMPLE_LENGTHS if n > cap]
    assert report["truncation"] == {"max_seq_len": cap, "truncated_samples": len(cut),
                                    "truncated_tokens": sum(n - cap for n in cut), "longest_sample": max(SAMPLE_LENGTHS)}
    warned = [r for r in caplog.records if "max_seq_len" in r.getMessage()]
    assert len(warned) == 1 and f"cuts {len(cut)} of {len(SAMPLE_LENGTHS)} samples" in warned[0].getMessage()
    on_disk = json.loads((tiny / "train" / "report.json").read_text())
    assert on_disk["truncation"] == report["truncation"] and on_disk["complete"] is True


def test_no_truncation_by_default_and_a_finished_run_is_skipped(tiny, caplog):
    from eagle3.train.run import train_phase

    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tiny)
    first = train_phase(cfg)
    assert first["truncation"]["truncated_samples"] == 0 and not caplog.records
    (tiny / "train" / "metrics.jsonl").unlink()  # a skipped run would not need it; a re-run would rewrite it
    assert train_phase(cfg) == first
    assert not (tiny / "train" / "metrics.jsonl").exists()


def test_a_finished_run_says_why_it_skips_and_trains_again_on_other_chunks(tiny, caplog):
    """Clearing a finished shard re-extracts it: chunks that hash the same need no training (the log says so);
    chunks with other contents train again, from scratch."""
    import shutil

    from eagle3.train.run import train_phase

    caplog.set_level(logging.INFO, logger="eagle3.train.run")
    cfg = tiny_config(tiny)
    first = train_phase(cfg)
    assert first["chunks"] == 1
    caplog.clear()
    assert train_phase(cfg) == first
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and "the 1 chunks of the 1 shards hash the same as those it trained on" in skipped[0]
    # the shard extracted again with other contents (another seed's states): training runs again
    shutil.rmtree(tiny / "shard")
    write_tiny_shard(tiny / "shard", SAMPLE_LENGTHS[::-1])
    caplog.clear()
    second = train_phase(cfg)
    assert second["data_fingerprint"] != first["data_fingerprint"] and second["steps"] == 3
    assert any("differ from those the drafter" in r.getMessage() for r in caplog.records)
    assert not any("skipping" in r.getMessage() for r in caplog.records)


def test_checkpoints_resume_position_and_refuse_other_params(tiny):
    from eagle3.train.checkpoint import Checkpoints, Position
    from eagle3.train.trainer import read_metrics, train

    train(tiny_config(tiny, max_steps=2, keep_checkpoints=5))
    out = tiny / "train"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    # other params in the same folder (max_steps is in the fingerprint): refused, nothing lost
    with pytest.raises(PipelineError, match="other training params"):
        train(tiny_config(tiny, max_steps=4, keep_checkpoints=5))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    # metrics logged after the last checkpoint (a killed run) are dropped on restore
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3}) + "\n")
    ck = Checkpoints(out / "checkpoints", tiny_config(tiny, max_steps=2, keep_checkpoints=5).fingerprint(), keep=5)
    from eagle3.train.model import DrafterConfig, Eagle3Drafter  # same shapes as the trained one
    saved = torch.load(ck.latest(), weights_only=False)
    drafter = Eagle3Drafter(DrafterConfig(HIDDEN, 64, HEADS, KV_HEADS, HEAD_DIM,
                                          saved["model"]["lm_head.weight"].shape[0], VOCAB))
    opt = torch.optim.AdamW(drafter.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert ck.restore(drafter, opt, sched, [out / "metrics.jsonl"]) == (
        Position(step=2, epoch=saved["epoch"], batch_pos=saved["batch_pos"]), None)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
