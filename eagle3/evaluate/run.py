"""The evaluation phase as the DAG runs it: export + target + held-out conversations (MT-bench) ->
<eval_dir>/{report.json, acceptance.png} (eagle3.evaluate.evaluation: every turn, each k, lossless check).
report.json is the phase's record (eagle3.io.PhaseOutput): written last, it says the phase is complete.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from eagle3.errors import DeviceOOMError, PipelineError
from eagle3.evaluate.config import EvalConfig
from eagle3.evaluate.evaluation import MTBENCH
from eagle3.identity import file_identity, model_identity
from eagle3.io import PhaseOutput, atomic_path, atomic_write_json, fingerprint, sha256_file
from eagle3.train.export import WEIGHTS_FILE, load_exported
from eagle3.train.trainer import pick_device

REPORT = "report.json"

log = logging.getLogger(__name__)


def plot_acceptance(reports: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in reports.items():
        xs = list(range(1, r["k"] + 1))
        ax.plot(xs, r["acceptance_rate_by_position"], "o-", label=f"{name}: conditional (tau {r['tau'] or 0:.2f})")
        ax.plot(xs, r["accepted_at_least"], "x--", label=f"{name}: P(>= i accepted)")
    ax.set(xlabel="draft position i", ylabel="acceptance rate", ylim=(0, 1.02), title="Acceptance by draft position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


def load_conversations(cfg: EvalConfig):
    from eagle3.evaluate.evaluation import EvalConversation, read_conversations, select

    convs = [EvalConversation([p], question_id=f"prompts[{i}]") for i, p in enumerate(cfg.prompts)]
    if cfg.prompts_file:
        convs += read_conversations(cfg.prompts_file)
    return select(convs, cfg.max_prompts)


def _headline(results: dict, key: str) -> dict:
    return {k: r[key] for k, r in results["by_k"].items()}


@contextlib.contextmanager
def out_of_memory(cfg: EvalConfig):
    """Decoding the GPU cannot hold, said with the params that fit it (retried: another process may have held
    the memory)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise DeviceOOMError(
            f"eval: out of GPU memory while decoding: lower eval_batch_tokens ({cfg.batch_tokens} now: rows x "
            f"(longest prompt + eval_max_new_tokens) a batch; the figures do not depend on it) or "
            f"eval_max_new_tokens ({cfg.max_new_tokens}). ({str(e).splitlines()[0][:200]})") from None


def speculate(cfg: EvalConfig, convs: list, device: torch.device, tp: bool = False) -> dict:
    """Load the export and the target; speculate on `convs` with the trained drafter (and the random floor).
    tp: this process is one rank of target.tp_size: the target is loaded with transformers' tp_plan (its ranks run
    every forward together, each with the whole drafter)."""
    from eagle3.models import load_model, load_tokenizer
    from eagle3.evaluate.evaluation import evaluate_conversations, make_decoder
    from eagle3.train.model import Eagle3Drafter

    drafter, vocab, config = load_exported(cfg.export_dir)
    drafter.to(device)
    capture = config["eagle3_pipeline"]["capture_layers"]
    tok = load_tokenizer(cfg.target.model_path)
    if tp:
        from transformers import AutoModelForCausalLM

        from eagle3.extract.backend import distributed_config

        target = AutoModelForCausalLM.from_pretrained(str(cfg.target.model_path), dtype=torch.float32,
                                                      distributed_config=distributed_config(cfg.target.model_path, "auto"))
        target.eval()
    else:
        target = load_model(cfg.target.model_path, device=str(device))
    dec = make_decoder(cfg.decoder, target, drafter, vocab, capture, tok.eos_token_id, cfg.batch_tokens)
    context = getattr(target.config, "max_position_embeddings", None) or 0
    with out_of_memory(cfg):
        trained = evaluate_conversations(dec, tok, convs, cfg.max_new_tokens, cfg.ks, max_context=context)
    results = {"trained": trained}
    if cfg.random_floor:
        torch.manual_seed(cfg.seed)
        floor = Eagle3Drafter(drafter.cfg).eval().to(device)
        floor_dec = make_decoder(cfg.decoder, target, floor, vocab, capture, tok.eos_token_id, cfg.batch_tokens)
        with out_of_memory(cfg):
            results["random_init"] = evaluate_conversations(
                floor_dec, tok, convs, cfg.max_new_tokens, cfg.ks[:1],
                turns=trained["turns"][: cfg.floor_max_prompts or None], check_greedy=False)
        results["random_init"].pop("turns")
    return results


def speculate_rank(cfg: EvalConfig, convs: list) -> dict | None:
    """One rank of a tensor-parallel evaluation (run by eagle3.launch.run_distributed): rank 0 returns the results."""
    import torch.distributed as dist

    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    results = speculate(cfg, convs, device, tp=True)
    return results if dist.get_rank() == 0 else None


def speculate_tp(cfg: EvalConfig, convs: list, device: torch.device) -> dict:
    """speculate() with the target in cfg.target.tp_size ranks (nccl on GPUs, gloo on the CPU); the checks first."""
    from eagle3.fit import check_tp_divides, load_config
    from eagle3.launch import backend_for, run_distributed

    t = cfg.target
    check_tp_divides(load_config(t.model_path), t.tp_size, "extract_tp_size", where=str(t.model_path))
    backend = backend_for(device, t.tp_size, "extract_tp_size")
    return run_distributed("eagle3.evaluate.run:speculate_rank", (cfg, convs), nprocs=t.tp_size, backend=backend,
                           timeout_s=cfg.rank_timeout_s, name="eagle3-evaluate")[0]


def evaluate_phase(cfg: EvalConfig) -> dict:
    out = Path(cfg.output_dir)
    export_cfg = Path(cfg.export_dir) / "config.json"
    if not export_cfg.is_file():
        raise PipelineError(f"eval param export_dir: {cfg.export_dir} holds no drafter export (no config.json)")
    # how, not what: the ranks the target runs in and the batches do not change the answers
    params = {k: v for k, v in asdict(cfg).items()
              if k not in ("target", "rank_timeout_s", "batch_tokens", "output_dir", "export_dir", "prompts_file")}
    # what, not where: the target, the prompts and the export by content
    params["model"] = model_identity(cfg.target.model_path)
    params["prompts"] = cfg.prompts_file if cfg.prompts_file == MTBENCH else file_identity(cfg.prompts_file)
    record = PhaseOutput(out, fingerprint({**params, "export_sha256": sha256_file(Path(cfg.export_dir) /
                                                                                   WEIGHTS_FILE)}), REPORT)
    if (done := record.completed()) is not None:
        log.info("evaluation already complete in %s for this export (same weights' sha256) and these params: "
                 "skipping\n%s", out, results_text(done))
        return done
    record.invalidate()
    convs = load_conversations(cfg)  # a bad prompt file fails before the models load
    device = pick_device(cfg.device)
    results = speculate_tp(cfg, convs, device) if cfg.target.tp_size > 1 else speculate(cfg, convs, device)
    trained = results["trained"]
    turns = trained.pop("turns")
    out.mkdir(parents=True, exist_ok=True)
    plot_acceptance({f"{name} k={k}": r for name, res in results.items() for k, r in res["by_k"].items()},
                    out / "acceptance.png")
    report = {"params": asdict(cfg), "device": str(device), "tp_size": cfg.target.tp_size, "conversations": len(convs),
              "answers": len(turns), "turns_past_context": trained["turns_past_context"], "ks": cfg.ks,
              "tau": _headline(trained, "tau"),
              "tau_ended_with_eos": _headline(trained, "tau_ended_with_eos"),
              "share_hit_cap": _headline(trained, "share_hit_cap"),
              "tau_per_turn": {k: {t: s["tau"] for t, s in r["per_turn"].items()} for k, r in trained["by_k"].items()},
              "tau_per_category": {k: {c: s["tau"] for c, s in r["per_category"].items()}
                                   for k, r in trained["by_k"].items()},
              "tau_random_init": _headline(results["random_init"], "tau") if cfg.random_floor else None,
              "identical_to_greedy": trained["identical_to_greedy"], "results": results,
              "plot": str(out / "acceptance.png")}
    if trained["mismatches"]:  # the report stays beside the failure for inspection, without a fingerprint
        atomic_write_json(out / "report.failed.json", {**report, "fingerprint": None})
        raise PipelineError(f"speculative output differs from greedy decoding (not lossless) on "
                            f"{len(trained['mismatches'])} of {len(turns) * len(cfg.ks)} answers: "
                            f"{trained['mismatches'][:5]}; report: {out / 'report.failed.json'}")
    done = record.commit(report)
    log.info("evaluation of %s on %d answers:\n%s", cfg.export_dir, len(turns), results_text(done))
    return done


def results_text(report: dict) -> str:
    """The report's tables as text, for the task log (the run page's Drafter tab shows the same)."""
    from eagle3.results import evaluation_table, lossless_text, text_table

    tables = evaluation_table(report)
    lossless = lossless_text(report.get("identical_to_greedy"))
    return "\n\n".join(t for t in (text_table(tables["by_k"]), text_table(tables["by_category"]),
                                     f"speculative output: {lossless}") if t)
