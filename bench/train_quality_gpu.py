"""Drafter quality on the real SmolLM2-135M-Instruct, on one GPU, through the pipeline's own phases; then ablations.

    ShareGPT conversations (`python -m eagle3 prompts sharegpt`, MT-bench removed; --gen-turns: every human turn,
       each answered after the target's own earlier answers, or the first only; first-turn rows are cut from
       all-turn answers, bench/quality_prompts.py)
    -> the target's own answers (batched HF generate, bf16): greedy; sampled at --temperature for that ablation
    -> merge -> extraction (bf16; float8_e4m3fn for that ablation) -> training -> export for SGLang
    -> MT-bench evaluation (evaluate_phase, batched decoder: both turns, k=5 and 7, tau over answers that end
       with eos, the share hitting max_new_tokens, per turn and category; lossless or the row says why not)

Two lanes share the GPU. A child process answers every prompt greedily, in parts of --part-size (the first parts
first). Meanwhile the base run and its ablations train on the first --ablation-prompts answers (equal data, one knob
each, bench/quality_plan.py's order: most informative first) and are evaluated on MT-bench answers of
--ablation-eval-new-tokens. Then the main run: every answered prompt, the recipe the finished ablations support
(quality_plan.recipe), its optimizer steps capped to end inside --deadline-s, evaluated at --eval-new-tokens and
every k. --studies adds issue 30's rows at the default recipe (data scaling, epochs, fp8, the checkpoint chosen by
simulated acceptance: quality_plan.studies); with --ablations none they run without the base row; --stage generate
only answers, for a session of its own (docs/device-runs.md, "Quality round 2"). Each row is configured as a
pipeline run is (row_config: its knobs as trigger-form params, composed and resolved by eagle3.config), in folders
of its own. Every finished row is written at once to --out/ablations.json and ablations.md (the table for
docs/benchmarks.md), the main run to quality_gpu.json.

Deadlines: the answers stop at --gen-by-s, the ablation rows start no later than --ablations-by-s (a row whose
estimate ends later is "not run"), everything ends by --deadline-s less --reserve-s (seconds from the start). Every
stage is resumable and skips finished work: the same command on the same --work continues where one stopped.

    python bench/train_quality_gpu.py --gguf SmolLM2.gguf --train-prompts sharegpt.jsonl \
        --eval-prompts mtbench.jsonl --work /root/q --out /root/qout --deadline-s 1400          # H200
    python bench/train_quality_gpu.py --smoke --work /tmp/qs --out /tmp/qs/out             # CPU, a few minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.quality_plan import (OVERRIDE_KNOBS, Clock, Variant, main_variant, plan, recipe, studies,  # noqa: E402
                                write_table)
from bench.quality_prompts import (  # noqa: E402
    GEN_ATTENTION, GEN_CACHES, TURNS, answered_parts, first_turns, generate, part_name, read_conversations,
)
from eagle3.config import RunConfig, resolve  # noqa: E402
from eagle3.errors import PipelineError  # noqa: E402
from eagle3.evaluate.run import evaluate_phase  # noqa: E402
from eagle3.extract.extractor import ShardExtractor  # noqa: E402
from eagle3.extract.plan import plan_shards  # noqa: E402
from eagle3.extract.run import extract_shard  # noqa: E402
from eagle3.io import atomic_write_json, read_json  # noqa: E402
from eagle3.merge.run import run_merge  # noqa: E402
from eagle3.models import convert_gguf, converted, load_tokenizer  # noqa: E402
from eagle3.train.run import train_phase  # noqa: E402

log = logging.getLogger("quality")


def target_folder(args, work: Path) -> Path:
    if args.model:
        return Path(args.model)
    out = work / "model"
    if not converted(out):
        convert_gguf(args.gguf, out)
    return out


def start_generation(until: float, work: Path) -> subprocess.Popen:
    """This script again as a child (--stage generate): the greedy answers of every prompt, beside the runs."""
    argv = [sys.executable, __file__, *sys.argv[1:], "--stage", "generate", "--until", str(until)]
    with open(work / "gen.log", "ab") as log_file:  # its tracebacks too
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)


def wait_for_parts(root: Path, parts: int, args, n_prompts: int, gen: subprocess.Popen | None) -> None:
    """Block until the first `parts` greedy parts exist (the generation child writes them in order)."""
    while answered_parts(root, args.part_size, n_prompts)[0] < parts:
        if gen is None or gen.poll() is not None:
            raise PipelineError(f"greedy answers: {answered_parts(root, args.part_size, n_prompts)[0]} of {parts} "
                                f"parts, and the generation has stopped (see {root.parent.parent}/gen.log)")
        time.sleep(2)


# the recipe's knobs that are no trigger-form param: the form's train_overrides, as a run would set them
TRAIN_OVERRIDES = {"warmup_ratio": 0.02, "checkpoint_every": 500, "log_every": 10}


def answers_dir(args, work: Path, d, answers: str) -> Path:
    """One answer set's parts as a data variant merges them: first turns of all-turn answers are cut from them
    (first_turns)."""
    cut = d.turns == "first" and args.gen_turns == "all"
    return work / "datagen" / (answers + ("-first" if cut else ""))


def merge_inputs(args, work: Path, d) -> list[str]:
    """Every part of each of the variant's answer sets (`greedy+sampled`: both)."""
    return [str(answers_dir(args, work, d, a) / part_name(a, p)) for a in d.answer_sets for p in range(d.parts)]


def row_config(args, model_path: Path, work: Path, v: Variant) -> RunConfig:
    """One row's run configuration from trigger-form params, resolved as preflight resolves it; then the bench's
    own folders (the rows of a data variant share its merge and extraction) and the main row's random floor."""
    d = v.data
    params = {"model_path": str(model_path), "output_root": str(work), "run_name": v.name,
              # the bench answers the prompts itself: no datagen server to resolve
              "datagen_mode": "remote", "datagen_conn_id": "unused", "served_model_name": "unused",
              "max_seq_len": d.max_seq_len, "storage_dtype": d.storage, "num_shards": args.shards,
              "token_budget": 65536, "chunk_mb": 256, **{k: x for k, x in v.train.items() if k not in OVERRIDE_KNOBS},
              "max_steps": args.max_steps,
              "train_overrides": {**TRAIN_OVERRIDES, "compile": args.train_compile,
                                  **{k: x for k, x in v.train.items() if k in OVERRIDE_KNOBS}},
              "eval_prompts": args.eval_prompts, "eval_ks": v.ks,
              "eval_max_new_tokens": v.eval_new_tokens, "eval_max_prompts": args.eval_conversations}
    cfg, _ = resolve(RunConfig.from_params(params, v.name))
    data, trained = work / f"data-{d.key}", work / f"train-{v.name}"
    return replace(
        cfg, merge=replace(cfg.merge, inputs=merge_inputs(args, work, d),
                           output_dir=str(data / "merge")),
        plan=replace(cfg.plan, merge_dir=str(data / "merge")),
        extract=replace(cfg.extract, extract_dir=str(data / "extract")),
        train=replace(cfg.train, output_dir=str(trained)),
        evaluate=replace(cfg.evaluate, export_dir=str(trained / "export"), output_dir=str(work / f"eval-{v.name}"),
                         random_floor=v.name == "main", floor_max_prompts=8))


def prepare_data(cfg: RunConfig, clock: Clock, weights: str = "bf16"):
    """Merge (the variant's answer parts, its length cap) and extraction (its storage dtype; from the target FP8 on
    load when `weights` is fp8, in a child process: extract_fp8_child) of one data variant: (its shard folders, the
    merge report)."""
    merged = run_merge(cfg.merge)
    t = time.time()
    specs = plan_shards(cfg.plan)
    if weights == "fp8":
        shards = [ShardExtractor(cfg.extract, spec).completed_summary() for spec in specs]
        if None in shards:
            extract_fp8_child(cfg)
            shards = [ShardExtractor(cfg.extract, spec).completed_summary() for spec in specs]
        left = [spec.shard for spec, done in zip(specs, shards) if done is None]
        if left:  # never extracted here: this process would load the target in bf16
            raise PipelineError(f"fp8 extraction: the child left shard(s) {left} of {cfg.extract.extract_dir} "
                                f"incomplete")
    else:
        shards = [extract_shard(cfg.extract, spec) for spec in specs]
    clock.record("extract", merged["tokens"], time.time() - t)
    return [s["shard_dir"] for s in shards], merged


FP8_CHILD_SCRIPT = Path(__file__).resolve().parent / "extract_fp8.py"


def extract_fp8_child(cfg: RunConfig) -> None:
    """The variant's shards from the target FP8 on load, extracted by bench/extract_fp8.py in a child process (its
    config as JSON in the variant's folder, its output in fp8_extract.log there): torchao never enters this one (a
    process that had quantized with torchao hung in the compiled training: torch 2.11, torchao 0.17, H100). Its
    failure fails the row, with the tail of its output."""
    folder = Path(cfg.extract.extract_dir).parent
    folder.mkdir(parents=True, exist_ok=True)
    config, log_path = folder / "fp8_extract_config.json", folder / "fp8_extract.log"
    atomic_write_json(config, cfg.to_dict())
    log.info("fp8 extraction in a child process (bench/extract_fp8.py, output in %s)", log_path)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the GPU memory this process's earlier rows cached, for the child's two targets
    with open(log_path, "ab") as log_file:
        rc = subprocess.run([sys.executable, str(FP8_CHILD_SCRIPT), str(config)], stdout=log_file,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        raise PipelineError(f"fp8 extraction child (bench/extract_fp8.py) exited {rc}: {lines[-1] if lines else ''} "
                            f"(all in {log_path}); its output ends:\n" + "\n".join(lines[-20:]))


class Runs:
    """What one variant needs besides its knobs: the target, the prompts, the data prepared so far, the clock."""

    def __init__(self, args, work: Path, model_path: Path, clock: Clock, prompts: list[str], device: str,
                 gen: subprocess.Popen | None):
        self.args, self.work, self.model_path, self.clock = args, work, model_path, clock
        self.prompts, self.device, self.gen, self.shards_of = prompts, device, gen, {}

    def other_answers(self, d) -> list[str]:
        """The variant's answer sets besides the greedy one (the generation child writes that), answered here for
        its prompts (a finished part is never redone: committed ones are unpacked first); what is still short."""
        n = min(len(self.prompts), d.parts * self.args.part_size)
        short = []
        for a in d.answer_sets:
            if a != "greedy":
                done = generate(self.args, self.prompts[:n], self.model_path, self.work / "datagen" / a,
                                self.args.temperature, self.clock, self.device)
                short += [f"{a} answers: {done} of {n} prompts by the deadline"] if done < n else []
        return short

    def data(self, v: Variant, cfg: RunConfig):
        args, d = self.args, v.data
        wait_for_parts(self.work / "datagen" / "greedy", d.parts, args, len(self.prompts), self.gen)
        short = self.other_answers(d)
        if short:
            raise PipelineError("; ".join(short))
        if d.turns == "all" and args.gen_turns != "all":
            raise PipelineError(f"{v.name} trains on every turn: generate them (--gen-turns all)")
        for a in d.answer_sets:
            if answers_dir(args, self.work, d, a).name.endswith("-first"):
                for p in range(d.parts):
                    part = part_name(a, p)
                    first_turns(self.work / "datagen" / a / part, answers_dir(args, self.work, d, a) / part)
        if d.key not in self.shards_of:
            self.shards_of[d.key] = prepare_data(cfg, self.clock, d.weights)
        return self.shards_of[d.key]

    def run(self, v: Variant, max_steps: int = 0, on_data=None) -> tuple[dict, tuple | None]:
        """Train and evaluate one variant: (its table row, (train, ev, merged, failure) or None)."""
        cfg = row_config(self.args, self.model_path, self.work, v)  # a ConfigError is the bench's bug: it stops
        try:
            shard_dirs, merged = self.data(v, cfg)
            max_steps = on_data(merged) if on_data else max_steps
            t = time.time()
            train = train_phase(replace(cfg.train, shard_dirs=shard_dirs, max_steps=max_steps or cfg.train.max_steps))
            train_s = time.time() - t
            self.clock.record("train_sample", train["steps"] * cfg.train.batch_size * cfg.train.grad_accum, train_s)
            t = time.time()
            failure = None
            try:
                ev = evaluate_phase(cfg.evaluate)
            except PipelineError as e:  # the phase wrote its figures before failing: keep them, say why
                failure, ev = str(e)[:300], read_json(Path(cfg.evaluate.output_dir) / "report.failed.json")
            row = v.row(status="done" if failure is None else "NOT LOSSLESS", train=train, ev=ev, merged=merged,
                        train_s=round(train_s, 1), eval_s=round(time.time() - t, 1), failure=failure)
            return row, (train, ev, merged, failure)
        except PipelineError as e:
            log.error("%s: %s", v.name, e)
            return v.row(status=f"failed: {str(e)[:200]}"), None


def run_ablations(runs: Runs, variants: list[Variant], until: float, out: Path, meta: dict,
                  rows: list[dict] | None = None) -> list[dict]:
    """The base run and its ablations (or other rows), each row added to `rows` and written to the table as it
    ends; a row whose estimate ends past `until` is "not run" (unless already finished: it is read back)."""
    args, work, clock = runs.args, runs.work, runs.clock
    for v in variants:  # sampled answers first: the child writes the greedy parts meanwhile
        if v.data.answers != "greedy" and clock.allows("variant", v.cost, until):
            runs.other_answers(v.data)  # a set left short fails its row later (Runs.data)
    rows = [] if rows is None else rows
    for v in variants:
        base = next((r for r in rows if r["name"] == "base" and r.get("draft_vocab")), None)
        resumed = (work / f"eval-{v.name}" / "report.json").is_file()
        if (v.group == "draft_vocab_size" and base and base["draft_vocab"] < args.draft_vocab
                and v.train["draft_vocab_size"] >= base["draft_vocab"]):
            # the base run already keeps every distinct token: this row would train the same drafter
            rows.append(v.row(status=f"same as base: the data has {base['draft_vocab']} distinct tokens"))
        elif not resumed and not clock.allows("variant", v.cost, until):
            rows.append(v.row(status="not run (deadline)"))
        else:
            t = time.time()
            rows.append(runs.run(v)[0])
            if v.name == "base":
                clock.record("variant", 1.0, time.time() - t)
        write_table(out, meta, rows, args.ks[0])
    return rows


def run_main(runs: Runs, rows: list[dict], variants: list[Variant], parts: int, answered: int, out: Path,
             meta: dict) -> dict:
    """The main run on every answered part, with the recipe of the finished rows, its steps fit to the deadline."""
    args, work, clock = runs.args, runs.work, runs.clock
    # the recipe is fixed when the main run first starts: a resumed run continues that training, whatever rows
    # have finished since (a new recipe would be a new run: delete <work>/train-main and main-recipe.json)
    chosen = work / "main-recipe.json"
    if not chosen.is_file():
        atomic_write_json(chosen, recipe(rows, variants) if args.main_recipe == "ablations" else ({}, {}, []))
    train_o, data_o, why = read_json(chosen)
    mv = main_variant(variants[0], parts, train_o, data_o, args.ks, args.eval_new_tokens)
    log.info("main run: %d prompts answered (%d parts); %s", answered, parts, mv.change)

    def fit_steps(merged: dict) -> int:
        """Optimizer steps that end before the deadline, less the evaluation (0 = the epochs fit)."""
        batch = mv.train["batch_size"]
        want = mv.train["epochs"] * -(-merged["rows"] // batch)
        left = clock.deadline - time.time() - args.main_eval_s
        fit = int(left / max(clock.estimate("train_sample", batch), 1e-9))
        if fit < want:
            log.info("main run: %d of %d steps fit before the deadline", max(fit, 1), want)
            return max(fit, 1)
        return 0

    row, res = runs.run(mv, on_data=fit_steps if "train_sample" in clock.rates else None)
    if res:
        save_main(out, work, meta, *res)
    return {**row, "recipe": why}


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_device_runs.py checks docs/device-runs.md's commands against it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF file (converted once into <work>/model)")
    src.add_argument("--model", help="an HF folder of the target")
    ap.add_argument("--train-prompts", help="prompt JSONL (python -m eagle3 prompts sharegpt OUT)")
    ap.add_argument("--eval-prompts", default="mtbench", help="MT-bench JSONL (python -m eagle3 prompts mtbench OUT)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=1400, help="wall seconds from start; everything ends by it")
    ap.add_argument("--reserve-s", type=float, default=0, help="seconds left free at the end (a later benchmark)")
    ap.add_argument("--gen-by-s", type=float, default=0, help="answers stop by then (0 = deadline less 500 s)")
    ap.add_argument("--ablations-by-s", type=float, default=0, help="no ablation row ends past it (0 = --gen-by-s)")
    ap.add_argument("--prompts", type=int, default=20000, help="train prompts (at most; the file may hold fewer)")
    ap.add_argument("--ablation-prompts", type=int, default=3000, help="the base run's and ablations' prompts")
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--part-size", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=1000, help="rows a generate call answers at most")
    ap.add_argument("--gen-batch-tokens", type=int, default=1_000_000, help="and at most this many KV-cache tokens, "
                    "rows x (longest context + --new-tokens): 1,000 rows of turn-2 contexts (up to 1,566 tokens) ran "
                    "out of an H100's 80 GB; 0 = no limit")
    ap.add_argument("--gen-group", type=int, default=1, help="parts answered by one call, turn by turn together "
                    "(their later turns' few conversations batched together); a part is kept once its group ends")
    ap.add_argument("--temperature", type=float, default=0.8, help="the sampled-answers ablation")
    ap.add_argument("--max-seq-len", type=int, default=512, help="the base run's (the ablation: 2048)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--max-steps", type=int, default=0, help="cap on optimizer steps (0 = epochs decide)")
    ap.add_argument("--eval-new-tokens", type=int, default=512, help="the main run's MT-bench answers")
    ap.add_argument("--ablation-eval-new-tokens", type=int, default=256, help="the base run's and ablations'")
    ap.add_argument("--main-eval-s", type=float, default=120, help="the main evaluation's time, reserved")
    ap.add_argument("--eval-conversations", type=int, default=0, help="MT-bench questions (0 = all 80)")
    ap.add_argument("--ks", type=lambda v: [int(x) for x in v.split(",")], default=[5, 7])
    ap.add_argument("--ablations", default="all", help="comma list of ablation names, `all` or `none`")
    ap.add_argument("--main-recipe", choices=("ablations", "base"), default="ablations")
    ap.add_argument("--no-main", action="store_true", help="the base run and ablations only (e.g. rows left)")
    ap.add_argument("--gen-turns", choices=TURNS, default="all", help="answer each conversation's first turn or all")
    ap.add_argument("--gen-cache", choices=tuple(GEN_CACHES), default="dynamic", help="HF generate's KV cache")
    ap.add_argument("--gen-attention", choices=GEN_ATTENTION, default="sdpa", help="the target's attention in "
                    "generation: transformers' sdpa, or grouped (the kv heads not repeated: eagle3.grouped_sdpa)")
    ap.add_argument("--gen-engine", choices=("generate", "continuous"), default="generate", help="answers by HF "
                    "generate in fixed batches, or by transformers' continuous batching (paged KV cache)")
    ap.add_argument("--all-turns-seq-len", type=int, default=2048, help="every-turn rows' cap; no turn past it")
    ap.add_argument("--studies", default="none", help="round-2 rows: groups (data, epochs, fp8, selection) or rows")
    ap.add_argument("--study-data", choices=TURNS, default="first", help="the epochs rows' data (full first/all)")
    ap.add_argument("--stage", choices=("all", "generate"), default="all",
                    help="generate: only the greedy answers, until --until (epoch seconds), e.g. a session of its own")
    ap.add_argument("--until", type=float, default=0, help="--stage generate: no part starts that ends past it")
    ap.add_argument("--gen-answers", choices=("greedy", "sampled"), default="greedy",
                    help="--stage generate: which answers (sampled: at --temperature; a second answer set to train on)")
    ap.add_argument("--train-compile", action="store_true", help="torch.compile the TTT loss (the trainer's GPU "
                    "default; 2.4x eager at the SmolLM2 shape in train_bench, never measured on these rows' data)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny everything (the cached SmolLM2 folder)")
    return ap


def parse_args():
    args = parser().parse_args()
    if args.smoke:
        args.prompts, args.part_size, args.new_tokens, args.gen_batch, args.max_steps = 12, 6, 12, 12, 3
        args.eval_new_tokens, args.eval_conversations, args.ks, args.shards, args.batch_size = 8, 1, [2, 3], 1, 4
        args.epochs, args.draft_vocab, args.max_prompt_tokens, args.ablation_prompts = 1, 2000, 96, 6
        args.ablation_eval_new_tokens, args.deadline_s = 6, max(args.deadline_s, 3600)
    args.gen_by_s = args.gen_by_s or max(0.0, args.deadline_s - 500)
    args.ablations_by_s = args.ablations_by_s or args.gen_by_s
    return args


def main() -> None:
    args = parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    lane = "gen" if args.stage == "generate" else "runs"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {lane} %(name)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(work / "run.log")])
    t0 = time.time()
    clock = Clock(t0 + args.deadline_s - args.reserve_s, work / f"clock-{lane}.json")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        from eagle3.models import ensure_smollm2

        args.model = args.model or str(ensure_smollm2())
    if not args.train_prompts:
        from eagle3.datagen.public_prompts import write_mtbench, write_sharegpt

        args.train_prompts = str(work / "sharegpt.jsonl")
        if not Path(args.train_prompts).is_file():
            write_sharegpt(args.train_prompts, limit=max(200, 2 * args.prompts))
        if args.eval_prompts == "mtbench":
            args.eval_prompts = str(work / "mtbench.jsonl")
            write_mtbench(args.eval_prompts)
    model_path = target_folder(args, work)
    tok = load_tokenizer(model_path)
    prompts = read_conversations(args.train_prompts, args.prompts, tok, args.max_prompt_tokens, args.gen_turns)
    greedy = work / "datagen" / "greedy"
    if args.stage == "generate":
        temperature = 0.0 if args.gen_answers == "greedy" else args.temperature
        generate(args, prompts, model_path, work / "datagen" / args.gen_answers, temperature, clock, device,
                 until=args.until)
        return
    gen = start_generation(t0 + args.gen_by_s, work)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
            "prompts": len(prompts)}
    runs = Runs(args, work, model_path, clock, prompts, device, gen)
    variants = plan(args, -(-min(args.ablation_prompts, len(prompts)) // args.part_size))
    round2 = args.studies != "none" and args.ablations == "none"  # the studies' rows without the 3K base run
    rows = [] if round2 else run_ablations(runs, variants, t0 + args.ablations_by_s, out, meta)
    gen.wait()
    rows = run_ablations(runs, studies(args, -(-len(prompts) // args.part_size)), clock.deadline, out, meta, rows)
    if not args.no_main:
        parts, answered = answered_parts(greedy, args.part_size, len(prompts))
        rows.append(run_main(runs, rows, variants, parts, answered, out, meta))
        write_table(out, meta, rows, args.ks[0])
    shutil.copy(work / "run.log", out / "run.log")
    print((out / "ablations.md").read_text())


def save_main(out: Path, work: Path, meta: dict, train: dict, ev: dict, merged: dict, failure) -> None:
    by_k = ev["results"]["trained"]["by_k"]
    summary = {**meta, "merged_rows": merged.get("rows"), "merged_tokens": merged.get("tokens"),
               "truncated": merged.get("truncated"), "draft_vocab": train["draft_vocab_size"], "steps": train["steps"],
               "first": train["first"], "last": train["last"], "tau": ev["tau"],
               "tau_ended_with_eos": ev["tau_ended_with_eos"], "share_hit_cap": ev["share_hit_cap"],
               "tau_per_turn": ev["tau_per_turn"], "tau_per_category": ev["tau_per_category"],
               "tau_random_init": ev["tau_random_init"], "identical_to_greedy": ev["identical_to_greedy"],
               "lossless_failure": failure, "answers": ev["answers"],
               "acceptance_rate_by_position": {k: r["acceptance_rate_by_position"] for k, r in by_k.items()},
               "eval_seconds": ev["results"]["trained"]["seconds"]}
    (out / "quality_gpu.json").write_text(json.dumps(summary, indent=1))
    for f in (work / "train-main" / "training.png", work / "eval-main" / "acceptance.png",
              work / "train-main" / "metrics.jsonl", work / "eval-main" / "report.json"):
        if f.is_file():
            shutil.copy(f, out / f"main-{f.name}")


if __name__ == "__main__":
    main()
