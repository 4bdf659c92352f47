"""Train the EAGLE-3 drafter on extracted hidden states with training-time test (TTT).

For sequence slot t and TTT step k (k = 0..K-1) the drafter reads the embedding of token t+1+k and
(step 0) the fused target features of token t, or (k >= 1) its own step k-1 output state at slot t;
it runs at position t+k and must predict token t+2+k. Its teacher is the target's distribution for
that token: softmax(final_hidden[t+1+k] @ lm_head^T) restricted to the draft vocabulary. The loss
mask is the mask of the predicted token, loss_mask[t+2+k]: shifted exactly like the targets
(leaving it unshifted trains on prompt tokens and skips the first answer token).

loss = sum_k decay^k * soft_cross_entropy_k, each step averaged over its masked slots.

Resumable: every `checkpoint_every` optimizer steps a checkpoint is written (eagle3.train.checkpoint);
the data order is a pure function of seed and epoch (eagle3.train.batches), so a resumed run continues
on the same batch sequence.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3.errors import ConfigError, PipelineError
from eagle3.extract.reader import HiddenStateReader
from eagle3.io import read_json
from eagle3.knobs import build
from eagle3.models import model_info
from eagle3.prefetch import prefetched
from eagle3.train.batches import (BatchOrder, collate, count_truncation, held_out_samples, out_of_memory, part_rows,
                                   step_inputs, to_device)
from eagle3.train.checkpoint import Checkpoints
from eagle3.train.config import TrainConfig
from eagle3.train.distributed import (Ranks, full_state, grad_sync, load_full_state, local_value,
                                      masked_counts, wrap)
from eagle3.faults import maybe_kill_rank
from eagle3.train.model import DrafterConfig, Eagle3Drafter
from eagle3.train.tracking import MetricsTracker, tracking_params
from eagle3.train.validation import VALIDATION_FILE, Validator, read_validation, selection_summary
from eagle3.train.vocab import VOCAB_FILE, count_tokens, load_or_build_vocab

log = logging.getLogger(__name__)


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
# the TTT loss


def shift_left(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """x[:, n:n+length] along dim 1, zero-padded at the end."""
    piece = x[:, n:n + length]
    if piece.shape[1] < length:
        pad = torch.zeros((x.shape[0], length - piece.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
        piece = torch.cat([piece, pad], 1)
    return piece


def ttt_loss(drafter: Eagle3Drafter, batch: dict, embed: torch.Tensor, target_head: torch.Tensor,
             ttt_steps: int, step_decay: float, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted TTT loss and per-step stats [K, 3] = (masked loss sum, correct top-1, masked count).

    embed: the target's embedding [V, H]; target_head: the target's lm_head rows of the draft vocab [Vd, H].
    counts [K]: the masked slots of each step over the whole optimizer step (every micro-batch, every rank's
    share: the training loop passes them, so the shares' losses sum to the step's mean); None = this batch's own
    counts. `drafter` may be its DDP wrapper: it is called.
    """
    ids, mask, aux, final = batch["input_ids"], batch["loss_mask"], batch["aux"], batch["final"]
    B, T = ids.shape
    S = T - 1  # slots t = 0..T-2 (slot t needs token t+1)
    positions = torch.arange(S, device=ids.device).expand(B, S)
    with torch.no_grad():
        # teacher for slot t at step k lives in final[t+1+k]; compute once for all positions
        teacher = torch.softmax((final[:, 1:] @ target_head.T.to(final.dtype)).float(), dim=-1)  # [B, T-1, Vd]
    embeds = [F.embedding(shift_left(ids, 1 + k, S), embed) for k in range(ttt_steps)]
    all_logits = drafter(aux[:, :S], embeds, positions)  # ttt_forward, through DDP's forward when wrapped
    total = torch.zeros((), device=ids.device)
    stats = []  # per step: (masked loss sum, correct, count); tensors, so the GPU is synced once per step
    for k, logits in enumerate(all_logits):
        p = shift_left(teacher, k, S)
        m = shift_left(mask, 2 + k, S).float()  # mask of the PREDICTED token t+2+k
        ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        count = m.sum()
        loss_k = (ce * m).sum() / (count if counts is None else counts[k]).clamp(min=1)
        total = total + (step_decay ** k) * loss_k
        correct = ((logits.argmax(-1) == p.argmax(-1)).float() * m).sum()
        stats.append(torch.stack([(ce * m).sum().detach(), correct, count]))
    return total, torch.stack(stats)


def lr_lambda_factory(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


# ----------------------------------------------------------------------------------------------
# the run


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def open_data(cfg: TrainConfig, info) -> HiddenStateReader:
    if not cfg.shard_dirs:
        raise ConfigError("train param shard_dirs is empty: no extracted hidden states to train on")
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


def loss_function(compile_on_gpu: bool):
    """The TTT loss, compiled when asked (GPU): a compiler failure falls back to eager for the rest of the run."""
    compiled = torch.compile(ttt_loss, dynamic=False) if compile_on_gpu else None

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

    return loss_fn, compiled is not None


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) and return a summary; the export and report are written by train_phase. With
    num_gpus > 1 the loop runs in that many ranks (eagle3.train.distributed) and this process waits for them."""
    if cfg.num_gpus > 1 and not Ranks.current().distributed:
        return train_on_ranks(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = Ranks.current()
    info = model_info(cfg.model_path)
    reader = open_data(cfg, info)
    truncation = count_truncation(reader, cfg.max_seq_len)
    device = ranks.device(pick_device(cfg.device))

    vocab = load_or_build_vocab(out / VOCAB_FILE, lambda: count_masked_tokens(reader, info.vocab_size),
                                cfg.draft_vocab_size, info.vocab_size)
    embed_w, head_w = load_target_head(cfg.model_path)
    embed = embed_w.float().to(device)
    target_head = head_w[vocab.draft_ids].float().to(device)

    drafter = new_drafter(cfg, info, vocab, len(reader.capture_layers), target_head).to(device)
    fsdp = ranks.distributed and cfg.parallel == "fsdp"
    model = wrap(drafter, ranks, device, "fsdp") if fsdp else drafter  # FSDP2 shards before the optimizer sees it
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda" and not fsdp)
    order = BatchOrder(reader, cfg.batch_size, cfg.seed,
                       held_out_samples(reader.num_samples, cfg.holdout_fraction, cfg.seed))
    steps_per_epoch = order.batches_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise PipelineError(f"{order.batches_per_epoch} micro-batches < grad_accum {cfg.grad_accum}: not one step")
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    checkpoints = Checkpoints(out / "checkpoints", cfg.fingerprint(), cfg.keep_checkpoints)
    metrics_path = out / "metrics.jsonl"
    pos, best = checkpoints.restore(drafter, opt, sched, [metrics_path, out / VALIDATION_FILE] if ranks.main else None,
                                    load_states=load_full_state if fsdp else None)
    if not fsdp:
        model = wrap(drafter, ranks, device)  # after the restore: DDP starts every rank from rank 0's weights

    on_gpu = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    loss_fn, compiled = loss_function(cfg.compile and on_gpu)
    # Compiled, every forward has part_rows rows (a rank's share, ceil(batch_size / N), or fewer where
    # micro_batch_tokens parts a micro-batch of long samples: a function of the padded length) and a power-of-two
    # bucketed length: static shapes, so a few graphs are built once. Eager, batches stay as long as their longest
    # sample (chunks hold samples of similar length, so that is little padding).
    share_rows = -(-cfg.batch_size // ranks.world)
    pad_multiple = cfg.pad_multiple if compiled else 1
    # data_s: host time waiting for the next step's batches (a thread batches them ahead, eagle3.prefetch) and
    # copying them to the device: the share of the wall time a faster input path could still win. The loss and
    # metrics stay on the device and are read only where they are logged, so the host queues the next micro-batch
    # while the GPU computes this one.
    t_start, tokens_done, data_s = time.time(), 0, 0.0
    validator = Validator(order, out, cfg.validation_interval, cfg.ttt_steps, cfg.max_seq_len,
                          vocab.draft_ids.to(device), ranks, ranks.main)

    def pinned(t: torch.Tensor) -> torch.Tensor:  # copied to the GPU without waiting for it (non_blocking)
        return t.pin_memory() if on_gpu else t

    def collated(samples: list[dict]) -> list[dict]:
        rows = part_rows(samples, cfg.micro_batch_tokens, share_rows, cfg.max_seq_len, pad_multiple)
        return [{k: pinned(v) for k, v in collate(part, cfg.max_seq_len, pad_multiple, rows if compiled else 0).items()}
                for part in ranks.share_in_parts(samples, rows)]

    def counted(samples: list[dict]) -> torch.Tensor:
        return pinned(masked_counts(samples, cfg.max_seq_len, cfg.ttt_steps))

    stream = prefetched(step_inputs(order, pos.epoch, pos.batch_pos, cfg.grad_accum, collated, counted), depth=2,
                        name="train-batches")
    model.train()
    start_step, last_log = pos.step, time.time()
    metrics_file = open(metrics_path, "a") if ranks.main else None  # rank 0 records, the others only train
    tracker = None
    if ranks.main:
        tracker = MetricsTracker(out, pos.step, mlflow_uri=cfg.mlflow_tracking_uri,
                                 mlflow_experiment=cfg.mlflow_experiment, params=tracking_params(cfg))
    ok = False
    try:
        while pos.step < total_steps:
            opt.zero_grad(set_to_none=True)
            t_data = time.perf_counter()
            step_in = next(stream)
            # the step's loss is a mean over the masked slots of all its micro-batches (every rank's): a step of
            # grad_accum micro-batches trains what one batch of them all would
            counts = step_in.counts.to(device, non_blocking=True)
            data_s += time.perf_counter() - t_data
            sums = torch.zeros(cfg.ttt_steps, 3, device=device)
            loss_total = torch.zeros((), device=device)
            for micro, host_batch in enumerate(step_in.batches):
                t_data = time.perf_counter()
                batch = to_device(host_batch, device)
                data_s += time.perf_counter() - t_data
                # DDP all-reduces gradients at the last forward of a step only
                last = micro == len(step_in.batches) - 1
                with grad_sync(model, ranks, last=last), out_of_memory(cfg, batch, vocab.size):
                    with autocast:
                        loss, stats = loss_fn(model, batch, embed, target_head, cfg.ttt_steps, cfg.step_decay,
                                              counts)
                    # DDP averages the ranks' gradients: N x each rank's part gives the gradient of their sum
                    (loss * ranks.world).backward()
                loss_total += loss.detach()
                sums += stats.float()
            tokens_done += sum(min(len(s["input_ids"]), cfg.max_seq_len) for m in step_in.samples for s in m)
            pos.epoch, pos.batch_pos = step_in.epoch, step_in.batch_pos
            if ranks.distributed:  # the metrics of the whole step: every rank's part summed (on the device)
                both = ranks.sum(torch.cat([sums.flatten(), loss_total.view(1)]))
                sums, loss_total = both[:-1].view_as(sums), both[-1]
            grad_norm = local_value(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            pos.step += 1
            step = pos.step
            maybe_kill_rank(ranks.rank, step)
            if metrics_file and (step % cfg.log_every == 0 or step == total_steps):
                sums = sums.double().cpu()
                rec = {
                    "step": step, "epoch": pos.epoch, "lr": lr, "loss": float(loss_total),
                    "grad_norm": float(grad_norm),
                    "loss_k": (sums[:, 0] / sums[:, 2].clamp(min=1)).tolist(),
                    "acc_k": (sums[:, 1] / sums[:, 2].clamp(min=1)).tolist(),
                    "tokens_per_s": tokens_done / max(1e-9, time.time() - t_start),
                    "data_share": data_s / max(1e-9, time.time() - t_start),
                }
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                tracker.log(rec)
            now = time.time()
            if ranks.main and (now - last_log >= cfg.log_every_s or step == total_steps):  # progress, rate, ETA
                last_log = now
                rate = (step - start_step) / max(1e-9, now - t_start)
                elapsed = max(1e-9, now - t_start)
                log.info("step %d/%d  loss %.4f  acc@k0 %.3f  %.0f tok/s  data %.0f%%  ETA %.0f s", step, total_steps,
                         float(loss_total), float(sums[0, 1] / sums[0, 2].clamp(min=1)), tokens_done / elapsed,
                         100 * data_s / elapsed, (total_steps - step) / max(rate, 1e-9))
            validated = validator.due(step, total_steps)
            if step % cfg.checkpoint_every == 0 or step == total_steps or validated:
                states = full_state(drafter, opt) if fsdp else None  # a collective: every rank gathers
                if validated:
                    result = validator.measure(model, embed, device, autocast)
                    validator.record(step, result)
                    if best is None or result["sim_tau"] > best["sim_tau"]:
                        best = {"step": step, "sim_tau": result["sim_tau"]}
                        if ranks.main:
                            checkpoints.save_best(step, result["sim_tau"], states[0] if states else drafter.state_dict())
                if ranks.main:
                    checkpoints.save(pos, drafter, opt, sched, states, best=best)
        ok = True
    finally:
        stream.close()  # stops the batching thread
        if metrics_file:
            metrics_file.close()
        if tracker:
            tracker.close(ok)  # an MLflow run ends FAILED on an exception
    selection = {}
    if validator.enabled:
        selection = selection_summary(read_validation(out / VALIDATION_FILE), best and best["step"],
                                      validator.held_out) if ranks.main else {}
        if best and not ranks.distributed:
            checkpoints.load_best(drafter, best)  # the export holds the best validation's weights
            log.info("exporting step %d (simulated tau %.3f; the last step, %d: %.3f)", best["step"],
                     best["sim_tau"], pos.step, selection.get("last_sim_tau", float("nan")))
    return {"drafter": None if ranks.distributed else drafter.cpu().eval(), "vocab": vocab, "info": info,
            "capture_layers": reader.capture_layers, "selection": selection,
            "steps": pos.step, "total_steps": total_steps, "tokens": reader.num_tokens, "samples": reader.num_samples,
            "truncation": truncation.to_dict(), "seconds": time.time() - t_start}


def new_drafter(cfg: TrainConfig, info, vocab, num_aux_layers: int, target_head: torch.Tensor) -> Eagle3Drafter:
    """The seeded initial drafter (its lm_head from the target's rows when asked)."""
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Drafter(DrafterConfig.from_target(info, vocab.size, num_aux_layers))
    if cfg.init_lm_head_from_target:
        drafter.lm_head.weight.data.copy_(target_head.cpu())  # start from the target's own readout
    return drafter


def train_rank(cfg: TrainConfig) -> dict:
    """One rank of a num_gpus > 1 run (started by run_distributed): the training loop, a small summary back."""
    res = train(cfg)
    return {k: v for k, v in res.items() if k not in ("drafter", "vocab", "info")}


def train_on_ranks(cfg: TrainConfig) -> dict:
    """Run the loop in cfg.num_gpus ranks and return train()'s summary, the drafter read from the final checkpoint
    (rank 0 writes one at the last step). The vocabulary is built here first, so the ranks only read it."""
    from eagle3.launch import backend_for, run_distributed

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = model_info(cfg.model_path)
    reader = open_data(cfg, info)
    vocab = load_or_build_vocab(out / VOCAB_FILE, lambda: count_masked_tokens(reader, info.vocab_size),
                                cfg.draft_vocab_size, info.vocab_size)
    backend = backend_for(pick_device(cfg.device), cfg.num_gpus, "train_num_gpus")
    summary = run_distributed("eagle3.train.trainer:train_rank", (cfg,), nprocs=cfg.num_gpus, backend=backend,
                              timeout_s=cfg.dist_timeout_s, name="eagle3-train")[0]
    checkpoints = Checkpoints(out / "checkpoints", cfg.fingerprint(), cfg.keep_checkpoints)
    drafter = Eagle3Drafter(DrafterConfig.from_target(info, vocab.size, len(reader.capture_layers)))
    step = checkpoints.load_model(drafter)
    if step != summary["steps"]:
        raise PipelineError(f"{checkpoints.folder}: the last checkpoint is at step {step}, the ranks ended at step "
                            f"{summary['steps']}")
    best = summary["selection"].get("best_step")
    if best is not None:
        checkpoints.load_best(drafter, {"step": best})
    return {**summary, "drafter": drafter.eval(), "vocab": vocab, "info": info}


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def main(argv: list[str]) -> int:
    """`python -m eagle3.train.trainer CONFIG.json`: train only (used by the resume test and the GPU bench)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = build(TrainConfig, read_json(argv[0]), where=argv[0])
    res = train(cfg)
    print(json.dumps({"steps": res["steps"], "tokens": res["tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
