"""Drafter training phase on real SmolLM2 states: vocab, TTT, resume after SIGKILL, export, speculation."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.errors import ConfigError, PipelineError
from eagle3.train.model import DrafterConfig, Eagle3Drafter
from eagle3.train.vocab import DraftVocab, build_draft_vocab, load_or_build_vocab
from tests.train_helpers import CAPTURE, small_config

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ no model needed


def test_vocab_d2t_t2d_round_trip(tmp_path):
    counts = torch.zeros(100, dtype=torch.int64)
    counts[[5, 17, 42, 43, 99, 3]] = torch.tensor([10, 50, 7, 7, 1, 30])
    v = build_draft_vocab(counts, size=4)
    assert v.draft_ids.tolist() == [3, 5, 17, 42]  # top 4 by count, tie 42/43 -> lower id; ascending slots
    assert v.d2t.dtype == torch.int64 and v.t2d.dtype == torch.bool
    draft = torch.arange(v.size)
    assert (draft + v.d2t[draft]).tolist() == v.draft_ids.tolist()  # SGLang: target = draft + d2t[draft]
    assert v.t2d.nonzero().flatten().tolist() == v.draft_ids.tolist()
    assert torch.equal(v.to_target(torch.tensor([0, 3])), torch.tensor([3, 42]))
    # never larger than the distinct tokens seen (6 here)
    assert build_draft_vocab(counts, size=32000).size == 6
    # saved once, reused on warm start even if the data (counts) changed
    path = tmp_path / "draft_vocab.safetensors"
    first = load_or_build_vocab(path, lambda: counts, 4, 100)
    other = torch.zeros(100, dtype=torch.int64)
    other[[60, 61, 62, 63, 64]] = 1000
    again = load_or_build_vocab(path, lambda: other, 4, 100)
    assert torch.equal(first.draft_ids, again.draft_ids)
    assert torch.equal(DraftVocab.load(path).d2t, first.d2t)
    with pytest.raises(PipelineError, match="no tokens"):
        build_draft_vocab(torch.zeros(10, dtype=torch.int64), 4)


def test_ttt_unroll_equals_cached_chain_drafting():
    """Training-time test must see exactly what inference sees: step k at slot t == the k-th chain draft
    after extending the cache with slots 0..t (same logits), incl. positions t+k and GQA."""
    torch.manual_seed(0)
    cfg = DrafterConfig(64, 128, 4, 2, 16, draft_vocab_size=50, target_vocab_size=100)
    d = Eagle3Drafter(cfg).eval()
    T, K = 10, 4
    aux, emb = torch.randn(1, T, 3 * 64), torch.randn(1, T + K + 1, 64)
    with torch.no_grad():
        ttt = d.ttt_forward(aux, [emb[:, 1 + k:1 + k + T] for k in range(K)], torch.arange(T)[None])
    for t in (0, 4, T - 1):
        cache = {}
        logits, state = d.forward_cached(emb[:, 1:t + 2], aux[:, :t + 1], torch.arange(t + 1)[None], cache, True)
        torch.testing.assert_close(logits[0, -1], ttt[0][0, t], atol=1e-5, rtol=1e-5)
        state = state[:, -1:]
        for k in range(1, K):
            logits, state = d.forward_cached(emb[:, t + 1 + k:t + 2 + k], state, torch.tensor([[t + k]]), cache, False)
            torch.testing.assert_close(logits[0, -1], ttt[k][0, t], atol=1e-5, rtol=1e-5)


def test_loss_mask_is_shifted_with_the_targets():
    """Slot t at step k predicts token t+2+k from the teacher final_hidden[t+1+k]; the mask used must be
    that token's loss_mask[t+2+k] (an unshifted mask would train on prompt tokens)."""
    from eagle3.train.trainer import ttt_loss

    torch.manual_seed(0)
    cfg = DrafterConfig(32, 64, 2, 1, 16, draft_vocab_size=20, target_vocab_size=40)
    d = Eagle3Drafter(cfg)
    T, j, K = 12, 8, 3
    embed, head = torch.randn(40, 32), torch.randn(20, 32)
    batch = {"input_ids": torch.randint(0, 40, (1, T)), "loss_mask": torch.zeros(1, T, dtype=torch.bool),
             "aux": torch.randn(1, T, 96), "final": torch.randn(1, T, 32)}
    batch["loss_mask"][0, j] = True  # only token j is an answer token
    loss, stats = ttt_loss(d, batch, embed, head, K, 0.8)
    assert stats[:, 2].tolist() == [1.0] * K  # every step has exactly one slot to learn: t = j-2-k
    for pos in range(T):  # only the teacher of token j (final_hidden[j-1]) can move the loss
        moved = {k: v.clone() for k, v in batch.items()}
        moved["final"][0, pos] += 1.0
        changed = not torch.allclose(ttt_loss(d, moved, embed, head, K, 0.8)[0], loss)
        assert changed == (pos == j - 1), pos


def test_padded_batches_on_gpu_buckets_do_not_change_the_loss():
    """The GPU path pads every micro-batch to batch_size rows and a power-of-two length bucket (few compiled
    shapes); pad rows and columns carry loss_mask 0, so loss and per-step stats equal the unpadded batch's."""
    from eagle3.train.batches import bucket_length, collate
    from eagle3.train.trainer import ttt_loss

    assert [bucket_length(n, 2048, 256) for n in (1, 256, 257, 700, 1500, 5000)] == [256, 256, 512, 1024, 2048, 2048]
    assert bucket_length(700, 600, 256) == 600 and bucket_length(37, 2048, 1) == 37
    torch.manual_seed(0)
    cfg = DrafterConfig(32, 64, 2, 1, 16, draft_vocab_size=20, target_vocab_size=40)
    d = Eagle3Drafter(cfg)
    embed, head = torch.randn(40, 32), torch.randn(20, 32)

    def sample(n):
        return {"input_ids": torch.randint(0, 40, (n,)), "loss_mask": (torch.arange(n) >= n // 3).to(torch.uint8),
                "aux_hidden": torch.randn(n, 96), "final_hidden": torch.randn(n, 32)}

    samples = [sample(11), sample(7)]
    plain = collate(samples, 64, 1, 0)
    padded = collate(samples, 64, 8, rows=4)
    assert plain["input_ids"].shape == (2, 11) and padded["input_ids"].shape == (4, 16)
    assert int(padded["loss_mask"].sum()) == int(plain["loss_mask"].sum())
    loss_a, stats_a = ttt_loss(d, plain, embed, head, 3, 0.8)
    loss_b, stats_b = ttt_loss(d, padded, embed, head, 3, 0.8)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats_b, stats_a, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------ real extracted states (tests/conftest.py)


@pytest.mark.slow
def test_training_lowers_loss_and_accuracy_beats_random_floor(trained):
    from eagle3.train.trainer import read_metrics

    cfg, report = trained
    m = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(1, 25))
    assert all(len(r["loss_k"]) == len(r["acc_k"]) == 3 for r in m)
    # step 1's metrics come from the randomly initialised drafter (measured before the first update)
    floor_loss, floor_acc = m[0]["loss"], m[0]["acc_k"][0]
    late = m[-4:]
    assert sum(r["loss"] for r in late) / 4 < 0.7 * floor_loss
    assert min(r["acc_k"][0] for r in late) > floor_acc + 0.1
    assert report["draft_vocab_size"] <= report["train_tokens"]
    out = Path(cfg.output_dir)
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "report.json").read_text())["steps"] == 24
    # the same loss curve as TensorBoard event files (read back from disk), one point a step
    from eagle3.train.tracking import read_scalars

    tb = read_scalars(out / "tensorboard")
    assert [p[0] for p in tb["train/loss"]] == list(range(1, 25))
    assert [p[1] for p in tb["train/loss"]] == pytest.approx([r["loss"] for r in m], rel=1e-6)  # float32 there
    assert [p[1] for p in tb["ttt_acc/step2"]] == pytest.approx([r["acc_k"][2] for r in m], rel=1e-6)


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_uninterrupted_run(shards, smollm2_path, tmp_path):
    from eagle3.train.trainer import read_metrics, train

    steps = 12
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    train(small_config(shards, ref_dir, model_path=smollm2_path, max_steps=steps, checkpoint_every=3))
    cfg = small_config(shards, kill_dir, model_path=smollm2_path, max_steps=steps, checkpoint_every=3)
    kill_dir.mkdir()
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(dataclasses.asdict(cfg)))  # the sections as objects, built back by main
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "eagle3.train.trainer", str(cfg_file)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = kill_dir / "checkpoints" / "step-00000006.pt"
    deadline = time.time() + 120
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert target.exists(), "training subprocess never wrote its step-6 checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(read_metrics(kill_dir / "metrics.jsonl"))
    assert killed_at < steps, "the subprocess finished before it could be killed"
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    ref, got = read_metrics(ref_dir / "metrics.jsonl"), read_metrics(kill_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # lines after the checkpoint were dropped
    for a, b in zip(ref, got):
        assert a["lr"] == b["lr"]
        torch.testing.assert_close(torch.tensor([a["loss"], *a["loss_k"], *a["acc_k"]]),
                                   torch.tensor([b["loss"], *b["loss_k"], *b["acc_k"]]), rtol=1e-5, atol=1e-6)
    # TensorBoard: two event files (killed attempt, resumed one); the resume's purge marker drops the steps the
    # killed attempt logged after its checkpoint, so each step is read once, with the resumed run's value
    from eagle3.train.tracking import read_scalars

    assert len(list((kill_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    tb = read_scalars(kill_dir / "tensorboard")["train/loss"]
    assert [p[0] for p in tb] == list(range(1, steps + 1))
    assert [p[1] for p in tb] == pytest.approx([r["loss"] for r in got], rel=1e-6)


def test_metrics_go_to_mlflow_when_a_tracking_uri_is_set(shards, smollm2_path, tmp_path):
    """A local MLflow store (sqlite: MLflow 3 refuses a plain folder): the run holds the loss curve, the
    params, and ends FINISHED; the run id is kept beside the checkpoints for a resume."""
    from mlflow import MlflowClient

    from eagle3.train.trainer import read_metrics, train

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = small_config(shards, tmp_path / "run" / "train", model_path=smollm2_path, max_steps=3, mlflow_tracking_uri=uri,
                       mlflow_experiment="drafters")
    train(cfg)
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((tmp_path / "run" / "train" / "mlflow_run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # the run folder's name
    assert client.get_experiment(run.info.experiment_id).name == "drafters"
    assert run.data.params["lr"] == str(cfg.lr) and "shard_dirs" not in run.data.params
    m = read_metrics(tmp_path / "run" / "train" / "metrics.jsonl")
    history = sorted((p.step, p.value) for p in client.get_metric_history(run_id, "train/loss"))
    assert history == [(r["step"], pytest.approx(r["loss"])) for r in m] and len(history) == 3


# SGLang's loader (sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3):
# parameters of the module it builds, and how load_weights maps checkpoint names onto them.
def sglang_params(H, I, heads, kv, hd, Vd):
    return {
        "model.fc.weight": [H, 3 * H],  # nn.Linear(hidden_size_in * 3, hidden_size)
        "model.midlayer.input_layernorm.weight": [H],
        "model.midlayer.hidden_norm.weight": [H],
        "model.midlayer.self_attn.qkv_proj.weight": [(heads + 2 * kv) * hd, 2 * H],  # QKVParallelLinear(2 * hidden)
        "model.midlayer.self_attn.o_proj.weight": [H, heads * hd],
        "model.midlayer.post_attention_layernorm.weight": [H],
        "model.midlayer.mlp.gate_up_proj.weight": [2 * I, H],
        "model.midlayer.mlp.down_proj.weight": [H, I],
        "model.norm.weight": [H],
        "lm_head.weight": [Vd, H],  # ParallelLMHead(draft_vocab_size, hidden_size) when tie_word_embeddings false
    }


STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def sglang_resolve(name: str, params: dict) -> str | None:
    """The name SGLang's load_weights would write `name` into, or None (silently ignored)."""
    for fused, part in STACKED:
        if part in name:
            name = name.replace(part, fused)
            return name if name in params else (f"model.{name}" if f"model.{name}" in params else None)
    return name if name in params else (f"model.{name}" if f"model.{name}" in params else None)


def test_export_names_and_shapes_match_sglang_loader(tmp_path, smollm2_path):
    from safetensors import safe_open

    from eagle3.models import model_info
    from eagle3.train.export import export_drafter, load_exported

    info = model_info(smollm2_path)
    counts = torch.zeros(info.vocab_size, dtype=torch.int64)
    counts[torch.arange(0, 3000, 3)] = 1
    vocab = build_draft_vocab(counts, 1000)
    drafter = Eagle3Drafter(DrafterConfig.from_target(info, vocab.size))
    out = export_drafter(drafter, vocab, info, CAPTURE, tmp_path / "export")
    H, I, hd = 576, 1536, 64
    expected = {
        "fc.weight": [H, 3 * H], "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [9 * hd, 2 * H], "midlayer.self_attn.k_proj.weight": [3 * hd, 2 * H],
        "midlayer.self_attn.v_proj.weight": [3 * hd, 2 * H], "midlayer.self_attn.o_proj.weight": [H, 9 * hd],
        "midlayer.post_attention_layernorm.weight": [H], "midlayer.mlp.gate_proj.weight": [I, H],
        "midlayer.mlp.up_proj.weight": [I, H], "midlayer.mlp.down_proj.weight": [H, I], "norm.weight": [H],
        "lm_head.weight": [1000, H], "d2t": [1000], "t2d": [49152],
    }
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert got == expected
    params = sglang_params(H, I, 9, 3, hd, 1000)
    landed = {sglang_resolve(n, params) for n in got if n not in ("d2t", "t2d")}
    assert None not in landed and landed == set(params)  # every tensor lands, every parameter is filled
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False  # True would make SGLang use embed_tokens as lm_head
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"]) == (49152, 1000, 576)
    assert (cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (1536, 9, 3)
    assert cfg["rope_theta"] == 1e5 and cfg["max_position_embeddings"] == 8192
    # SGLang captures at the input of layer id+1 = HF hidden_states[id+1]: ids are capture layers - 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    back, vocab2, _ = load_exported(out)
    assert torch.equal(vocab2.d2t, vocab.d2t)
    torch.testing.assert_close(back.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())


@pytest.mark.slow
def test_train_operator_skips_a_finished_run(trained):
    from eagle3_airflow.operators.train import TrainDrafterOperator

    cfg, report = trained
    # the composed run config's train part, as preflight's XCom holds it: the target and data sections as objects
    config = {"target": {"model_path": cfg.target.model_path}, "data": {"max_seq_len": cfg.max_seq_len},
              "output_dir": cfg.output_dir, **{k: getattr(cfg, k) for k in (
                  "batch_size", "max_steps", "lr", "warmup_ratio", "checkpoint_every", "ttt_steps", "seed")}}
    t = time.time()
    res = TrainDrafterOperator(task_id="train", shard_dirs=[{"shard_dir": d} for d in cfg.shard_dirs],
                               config=config).execute({})
    assert time.time() - t < 5 and res["steps"] == 24 and res["export_dir"] == report["export_dir"]
    json.dumps(res)


# ------------------------------------------------------------------ bad inputs


def write_fake_shard(d: Path, hidden: int, tokens: int) -> Path:
    from eagle3.extract.format import ShardManifest, write_chunk

    d.mkdir(parents=True)
    man = ShardManifest(shard=0, model_path="other", capture_layers=CAPTURE, hidden_size=hidden, dtype="bfloat16")
    if tokens:
        man.chunks.append(write_chunk(d, 0, {
            "input_ids": torch.ones(tokens, dtype=torch.int32), "loss_mask": torch.ones(tokens, dtype=torch.uint8),
            "aux_hidden": torch.zeros(tokens, 3 * hidden), "final_hidden": torch.zeros(tokens, hidden),
            "sample_offsets": torch.tensor([0, tokens]), "sample_rows": torch.tensor([0])}, fsync=False))
    man.complete = True
    man.save(d)
    return d


def test_bad_inputs_fail_clearly(tmp_path, smollm2_path):
    from eagle3.train.trainer import train

    other = write_fake_shard(tmp_path / "other-model", hidden=64, tokens=8)
    with pytest.raises(PipelineError, match=r"hidden_size 64 .* has hidden_size 576"):
        train(small_config([other], tmp_path / "o1", model_path=smollm2_path))
    empty = write_fake_shard(tmp_path / "empty", hidden=576, tokens=0)
    with pytest.raises(PipelineError, match="hold no tokens"):
        train(small_config([empty], tmp_path / "o2", model_path=smollm2_path))
    for bad_k in (0, 33, "7", True):
        with pytest.raises(ConfigError, match="ttt_steps"):
            small_config([empty], tmp_path / "o3", model_path=smollm2_path, ttt_steps=bad_k)
    with pytest.raises(ConfigError, match="shard_dirs is empty"):  # the run sets them once extraction ran
        train(small_config([], tmp_path / "o4", model_path=smollm2_path))
    with pytest.raises(PipelineError, match="manifest is missing"):
        train(small_config([tmp_path / "nowhere"], tmp_path / "o5", model_path=smollm2_path))
def test_tau_over_first_tokens_and_by_answer_end():
    from eagle3.evaluate.speculative import tau_breakdown, tau_of

    # prompt A: rounds accepting 2, 0, 4 drafts -> 3 + 1 + 5 = 9 tokens in 3 rounds; B: 1, 1 -> 4 in 2
    assert tau_of([[2, 0, 4], [1, 1]]) == {"prompts": 2, "rounds": 5, "tau": 13 / 5}
    # new token 0 comes from the prefill, so A's rounds start at tokens 1, 4, 5 and B's at 1, 3:
    # the first 5 tokens hold A's first two rounds (4 tokens) and both of B's (4 tokens)
    assert tau_of([[2, 0, 4], [1, 1]], first_tokens=5) == {"prompts": 2, "rounds": 4, "tau": 8 / 4}
    assert tau_of([]) == {"prompts": 0, "rounds": 0, "tau": None}
    per_prompt = [{"accepted_per_round": [2, 0, 4], "ended_with_eos": True},
                  {"accepted_per_round": [1, 1], "ended_with_eos": False}]
    split = tau_breakdown(per_prompt, max_new_tokens=200)
    assert split["ended_with_eos"]["tau"] == 3 and split["hit_cap"]["tau"] == 2
    assert split["first_64_tokens"]["tau"] == 13 / 5 and "first_128_tokens" in split
    assert "first_64_tokens" not in tau_breakdown(per_prompt, max_new_tokens=64)
