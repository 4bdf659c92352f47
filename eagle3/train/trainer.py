"""Train the EAGLE-3 drafter on extracted hidden states with training-time test (TTT).

For sequence slot t and TTT step k (k = 0..K-1) the drafter reads the embedding of token t+1+k and
(step 0) the fused target features of token t, or (k >= 1) its own step k-1 output state at slot t;
it runs at position t+k and must predict token t+2+k. Its teacher is the target's distribution for
that token: softmax(final_hidden[t+1+k] @ lm_head^T) restricted to the draft vocabulary. The loss
mask is the mask of the predicted token, loss_mask[t+2+k]: shifted exactly like the targets
(leaving it unshifted trains on prompt tokens and skips the first answer token).

loss = sum_k decay^k * soft_cross_entropy_k, each step averaged over its masked slots.

Resumable: every `checkpoint_every` optimizer steps the model, optimizer, scheduler, RNG states and
data position are written atomically; a restarted run loads the last one, drops metrics lines
written after it, and continues on the same batch sequence (the data order is a pure function of
seed and epoch), so its loss curve is the uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3.errors import ConfigError, PipelineError
from eagle3.extract.format import load_chunk
from eagle3.extract.reader import HiddenStateReader
from eagle3.io import atomic_path, atomic_write_json, fingerprint, read_json
from eagle3.models import model_info
from eagle3.train.model import DrafterConfig, Eagle3Drafter
from eagle3.train.vocab import DEFAULT_DRAFT_VOCAB, VOCAB_FILE, count_tokens, load_or_build_vocab

log = logging.getLogger(__name__)

MAX_TTT_STEPS = 32


@dataclass
class TrainConfig:
    shard_dirs: list[str]
    model_path: str
    output_dir: str
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB
    ttt_steps: int = 7
    step_decay: float = 0.8
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_size: int = 4  # samples per micro-batch
    grad_accum: int = 1
    max_seq_len: int = 2048
    epochs: int = 1
    max_steps: int = 0  # optimizer steps; 0 = run `epochs` over the data
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    device: str = "auto"  # auto = cuda if available
    init_lm_head_from_target: bool = True
    log_every: int = 1  # metrics.jsonl line every N optimizer steps
    log_every_s: float = 10.0  # progress line in the task log at most this often
    compile: bool = True  # torch.compile the TTT loss on GPU (2x faster at 8B shape, see docs/benchmarks.md)
    pad_multiple: int = 256  # compiled: pad batch lengths to pad_multiple * 2^j (see bucket_length): few graphs
    stop_after_steps: int = 0  # testing hook: exit cleanly after this many steps (no export)

    def validate(self) -> "TrainConfig":
        def positive_int(name, minimum=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(f"train param {name} must be an int >= {minimum}, got {v!r}")

        k = self.ttt_steps
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TTT_STEPS:
            raise ConfigError(f"train param ttt_steps (K) must be an int in 1..{MAX_TTT_STEPS}, got {k!r}")
        for name in ("draft_vocab_size", "batch_size", "grad_accum", "epochs", "checkpoint_every", "keep_checkpoints"):
            positive_int(name)
        positive_int("max_seq_len", minimum=k + 2)
        positive_int("max_steps", minimum=0)
        if not 0 < self.step_decay <= 1:
            raise ConfigError(f"train param step_decay must be in (0, 1], got {self.step_decay!r}")
        if not (self.lr > 0 and 0 <= self.warmup_ratio < 1 and self.grad_clip > 0):
            raise ConfigError(f"train params lr > 0, warmup_ratio in [0,1), grad_clip > 0 needed; got "
                              f"{self.lr}, {self.warmup_ratio}, {self.grad_clip}")
        if not self.shard_dirs:
            raise ConfigError("train param shard_dirs is empty: no extracted hidden states to train on")
        return self

    def fingerprint(self) -> str:
        d = asdict(self)
        for k in ("stop_after_steps", "device", "log_every", "log_every_s", "checkpoint_every", "keep_checkpoints", "compile"):
            d.pop(k)  # these do not change the result
        return fingerprint(d)


# ----------------------------------------------------------------------------------------------
# target pieces the drafter borrows (frozen): token embedding and lm_head


def load_target_head(model_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) read straight from the safetensors, without the whole model."""
    from safetensors import safe_open

    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(read_json(index)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    found = {}
    for f in files:
        with safe_open(str(path / f), "pt") as st:
            for name in st.keys():
                if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                    found[name.split(".")[-2]] = st.get_tensor(name)
    if "embed_tokens" not in found:
        raise PipelineError(f"{path}: no embed_tokens.weight in the safetensors files {files}")
    return found["embed_tokens"], found.get("lm_head", found["embed_tokens"])  # tied when no lm_head


# ----------------------------------------------------------------------------------------------
# data: chunks in a seeded order per epoch, micro-batches never span chunks, so the position of
# a batch is computable from the manifests alone (resume skips without reading skipped chunks)


class BatchOrder:
    def __init__(self, reader: HiddenStateReader, batch_size: int, seed: int):
        self.reader, self.batch_size, self.seed = reader, batch_size, seed
        self.chunks = [(d, rec) for d, m in zip(reader.shard_dirs, reader.manifests) for rec in m.chunks if rec.samples]
        self.batches_per_epoch = sum(math.ceil(rec.samples / batch_size) for _, rec in self.chunks)

    def epoch(self, epoch: int, skip: int = 0):
        """Yield (batch_index, [samples as dicts]) for one epoch, starting after `skip` batches."""
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        order = torch.randperm(len(self.chunks), generator=g).tolist()
        index = 0
        for ci in order:
            d, rec = self.chunks[ci]
            n = math.ceil(rec.samples / self.batch_size)
            perm = torch.randperm(rec.samples, generator=g).tolist()  # drawn even when skipped: same stream
            if index + n <= skip:
                index += n
                continue
            t = load_chunk(d, rec)
            off = t["sample_offsets"].tolist()
            for b in range(n):
                if index >= skip:
                    rows = perm[b * self.batch_size:(b + 1) * self.batch_size]
                    yield index, [{k: t[k][off[i]:off[i + 1]] for k in ("input_ids", "loss_mask", "aux_hidden",
                                                                        "final_hidden")} for i in rows]
                index += 1


def bucket_length(n: int, max_len: int, pad_multiple: int) -> int:
    """Padded batch length for a longest sample of n tokens. With pad_multiple > 1 (GPU, compiled): the
    smallest pad_multiple * 2^j >= n, so a run meets at most log2(max_len / pad_multiple) + 2 lengths,
    and a compiled loss is built once per length rather than once per distinct padded size."""
    n = min(n, max_len)
    if pad_multiple <= 1:
        return n
    T = pad_multiple
    while T < n:
        T *= 2
    return min(T, max_len)


def collate(samples: list[dict], max_len: int, pad_multiple: int = 1, rows: int = 0) -> dict:
    """Right-pad samples (truncated to max_len) into a batch of `rows` rows (0 = as many as samples) and
    bucket_length(...) columns. Padding has loss_mask 0 and sits after every real token (or fills whole
    rows), so causal attention never lets a real token read it and the loss never counts it."""
    T = bucket_length(max(len(s["input_ids"]) for s in samples), max_len, pad_multiple)
    B = max(rows, len(samples))
    H3, H = samples[0]["aux_hidden"].shape[-1], samples[0]["final_hidden"].shape[-1]
    # states keep their stored dtype (bf16 from GPU extraction): half the host copy; the caller upcasts on device
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "aux": torch.zeros(B, T, H3, dtype=samples[0]["aux_hidden"].dtype),
        "final": torch.zeros(B, T, H, dtype=samples[0]["final_hidden"].dtype),
    }
    for i, s in enumerate(samples):
        n = min(T, len(s["input_ids"]))
        out["input_ids"][i, :n] = s["input_ids"][:n]
        out["loss_mask"][i, :n] = s["loss_mask"][:n].bool()
        out["aux"][i, :n] = s["aux_hidden"][:n]
        out["final"][i, :n] = s["final_hidden"][:n]
    return out


def to_device(batch: dict, device: torch.device) -> dict:
    """Move a collated batch to the device; hidden states become fp32 there (autocast picks the matmul dtype)."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    out["aux"], out["final"] = out["aux"].float(), out["final"].float()
    return out


# ----------------------------------------------------------------------------------------------
# the TTT loss


def shift_left(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """x[:, n:n+length] along dim 1, zero-padded at the end."""
    piece = x[:, n:n + length]
    if piece.shape[1] < length:
        pad = torch.zeros((x.shape[0], length - piece.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
        piece = torch.cat([piece, pad], 1)
    return piece


def ttt_loss(drafter: Eagle3Drafter, batch: dict, embed: torch.Tensor, target_head: torch.Tensor,
             ttt_steps: int, step_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted TTT loss and per-step stats [K, 3] = (masked loss sum, correct top-1, masked count).

    embed: the target's embedding [V, H]; target_head: the target's lm_head rows of the draft vocab [Vd, H].
    """
    ids, mask, aux, final = batch["input_ids"], batch["loss_mask"], batch["aux"], batch["final"]
    B, T = ids.shape
    S = T - 1  # slots t = 0..T-2 (slot t needs token t+1)
    positions = torch.arange(S, device=ids.device).expand(B, S)
    with torch.no_grad():
        # teacher for slot t at step k lives in final[t+1+k]; compute once for all positions
        teacher = torch.softmax((final[:, 1:] @ target_head.T.to(final.dtype)).float(), dim=-1)  # [B, T-1, Vd]
    embeds = [F.embedding(shift_left(ids, 1 + k, S), embed) for k in range(ttt_steps)]
    all_logits = drafter.ttt_forward(aux[:, :S], embeds, positions)
    total = torch.zeros((), device=ids.device)
    stats = []  # per step: (masked loss sum, correct, count); tensors, so the GPU is synced once per step
    for k, logits in enumerate(all_logits):
        p = shift_left(teacher, k, S)
        m = shift_left(mask, 2 + k, S).float()  # mask of the PREDICTED token t+2+k
        ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        count = m.sum()
        loss_k = (ce * m).sum() / count.clamp(min=1)
        total = total + (step_decay ** k) * loss_k
        correct = ((logits.argmax(-1) == p.argmax(-1)).float() * m).sum()
        stats.append(torch.stack([(ce * m).sum().detach(), correct, count]))
    return total, torch.stack(stats)


# ----------------------------------------------------------------------------------------------
# checkpoints


def lr_lambda_factory(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(ckpt_dir: Path, step: int, payload: dict, keep: int) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:08d}.pt"
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt")) if ckpt_dir.is_dir() else []
    return found[-1] if found else None


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines after `step` (written by a killed run after its last checkpoint)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------------------------
# the run


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def open_data(cfg: TrainConfig, info) -> HiddenStateReader:
    reader = HiddenStateReader(cfg.shard_dirs)
    if reader.hidden_size != info.hidden_size:
        raise PipelineError(
            f"shards {cfg.shard_dirs[0]}...: hidden_size {reader.hidden_size} but the target model {cfg.model_path} "
            f"has hidden_size {info.hidden_size}: these states were extracted from another model"
        )
    if reader.num_tokens == 0:
        raise PipelineError(f"shards {[str(d) for d in reader.shard_dirs]} hold no tokens: nothing to train on")
    for d, m in zip(reader.shard_dirs, reader.manifests):
        if m.tokens == 0:
            log.warning("shard %s is empty (0 tokens); training on the others", d)
    return reader


def count_masked_tokens(reader: HiddenStateReader, target_vocab: int) -> torch.Tensor:
    """Token frequencies of the tokens the drafter must predict (loss_mask = 1)."""
    def masked():
        for t in reader.iter_chunks():
            yield t["input_ids"][t["loss_mask"].bool()]

    counts = count_tokens(masked(), target_vocab)
    if int(counts.sum()) == 0:
        raise PipelineError(f"shards {[str(d) for d in reader.shard_dirs]}: loss_mask is 0 everywhere, nothing to learn")
    return counts


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) and return a summary; the export and report are written by run_training."""
    cfg.validate()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = model_info(cfg.model_path)
    reader = open_data(cfg, info)
    n_aux = len(reader.capture_layers)
    device = pick_device(cfg.device)

    vocab = load_or_build_vocab(out / VOCAB_FILE, lambda: count_masked_tokens(reader, info.vocab_size),
                                cfg.draft_vocab_size, info.vocab_size)
    embed_w, head_w = load_target_head(cfg.model_path)
    embed = embed_w.float().to(device)
    target_head = head_w[vocab.draft_ids].float().to(device)

    torch.manual_seed(cfg.seed)
    dcfg = DrafterConfig.from_target(info, vocab.size, n_aux)
    drafter = Eagle3Drafter(dcfg)
    if cfg.init_lm_head_from_target:
        drafter.lm_head.weight.data.copy_(target_head.cpu())  # start from the target's own readout
    drafter.to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    order = BatchOrder(reader, cfg.batch_size, cfg.seed)
    steps_per_epoch = order.batches_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise PipelineError(f"{order.batches_per_epoch} micro-batches < grad_accum {cfg.grad_accum}: not one step")
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))

    ckpt_dir, metrics_path = out / "checkpoints", out / "metrics.jsonl"
    step, epoch, batch_pos = 0, 0, 0
    last = latest_checkpoint(ckpt_dir)
    if last is not None:
        ck = torch.load(last, map_location="cpu", weights_only=False)
        if ck["fingerprint"] != cfg.fingerprint():
            raise PipelineError(f"{last}: written with other training params; use a new output_dir or delete it")
        drafter.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        set_rng_state(ck["rng"])
        step, epoch, batch_pos = ck["step"], ck["epoch"], ck["batch_pos"]
        truncate_metrics(metrics_path, step)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", last, step, epoch, batch_pos)
    else:
        metrics_path.unlink(missing_ok=True)

    on_gpu = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    # Static shapes: batches are padded to a multiple of pad_multiple, so few graphs are compiled.
    compiled = torch.compile(ttt_loss, dynamic=False) if (cfg.compile and on_gpu) else None

    def loss_fn(*args):
        nonlocal compiled
        if compiled is not None:
            try:
                return compiled(*args)
            except Exception as e:  # noqa: BLE001 - a compiler bug must not end a long run: go on eagerly
                log.warning("torch.compile of the TTT loss failed (%s: %s); continuing in eager mode",
                            type(e).__name__, str(e).strip().splitlines()[-1][:300] if str(e).strip() else "")
                compiled = None
                torch._dynamo.reset()
        return ttt_loss(*args)
    # Compiled, every micro-batch has batch_size rows and a power-of-two bucketed length: static shapes, so a
    # few graphs are built once. Eager, batches stay as long as their longest sample (chunks hold samples of
    # similar length, so that is little padding).
    pad_multiple, batch_rows = (cfg.pad_multiple, cfg.batch_size) if compiled is not None else (1, 0)
    t_start, tokens_done = time.time(), 0

    def micro_batches():
        nonlocal epoch, batch_pos
        while True:
            for index, samples in order.epoch(epoch, skip=batch_pos):
                batch_pos = index + 1
                yield samples
            epoch, batch_pos = epoch + 1, 0

    stream = micro_batches()
    drafter.train()
    start_step, last_log = step, time.time()
    with open(metrics_path, "a") as mf:
        while step < total_steps:
            opt.zero_grad(set_to_none=True)
            sums = torch.zeros(cfg.ttt_steps, 3, dtype=torch.float64)
            loss_total = 0.0
            for _ in range(cfg.grad_accum):
                samples = next(stream)
                batch = to_device(collate(samples, cfg.max_seq_len, pad_multiple, batch_rows), device)
                with autocast:
                    loss, stats = loss_fn(drafter, batch, embed, target_head, cfg.ttt_steps, cfg.step_decay)
                (loss / cfg.grad_accum).backward()
                loss_total += float(loss.detach()) / cfg.grad_accum
                tokens_done += sum(min(len(s["input_ids"]), cfg.max_seq_len) for s in samples)  # real tokens only
                sums += stats.double().cpu()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            step += 1
            if step % cfg.log_every == 0 or step == total_steps:
                rec = {
                    "step": step, "epoch": epoch, "lr": lr, "loss": loss_total, "grad_norm": float(grad_norm),
                    "loss_k": (sums[:, 0] / sums[:, 2].clamp(min=1)).tolist(),
                    "acc_k": (sums[:, 1] / sums[:, 2].clamp(min=1)).tolist(),
                    "tokens_per_s": tokens_done / max(1e-9, time.time() - t_start),
                }
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
            now = time.time()
            if now - last_log >= cfg.log_every_s or step == total_steps:  # the task log: progress, rate, ETA
                last_log = now
                rate = (step - start_step) / max(1e-9, now - t_start)
                log.info("step %d/%d  loss %.4f  acc@k0 %.3f  %.0f tok/s  ETA %.0f s", step, total_steps, loss_total,
                         float(sums[0, 1] / sums[0, 2].clamp(min=1)), tokens_done / max(1e-9, now - t_start),
                         (total_steps - step) / max(rate, 1e-9))
            if step % cfg.checkpoint_every == 0 or step == total_steps:
                save_checkpoint(ckpt_dir, step, {
                    "model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "rng": rng_state(), "step": step, "epoch": epoch, "batch_pos": batch_pos,
                    "fingerprint": cfg.fingerprint(),
                }, cfg.keep_checkpoints)
            if cfg.stop_after_steps and step >= cfg.stop_after_steps:
                break
    return {"drafter": drafter.cpu().eval(), "vocab": vocab, "info": info, "capture_layers": reader.capture_layers,
            "steps": step, "total_steps": total_steps, "tokens": reader.num_tokens, "samples": reader.num_samples,
            "seconds": time.time() - t_start}


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def main(argv: list[str]) -> int:
    """`python -m eagle3.train.trainer CONFIG.json`: train only (used by the resume test and the GPU bench)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = TrainConfig(**read_json(argv[0]))
    res = train(cfg)
    print(json.dumps({"steps": res["steps"], "tokens": res["tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
