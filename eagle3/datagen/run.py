"""One dataset, end to end: prompts -> generations.jsonl (resumable) -> tokenized.jsonl -> report, manifest.

Folder `<out>/<dataset>/`:
  generations.jsonl    append-only raw answers (sample_id, messages, answer, usage, finish_reason...):
                       the resumable part; tokenization can be redone from it without regenerating
  generations.meta.json the params the generations were made with (other params -> the old file is set aside)
  errors.jsonl         samples that failed after all retries (append-only, one line per failure)
  too_long.jsonl       prompts the endpoint rejected as longer than its context: bad input lines, recorded
                       once and never sent again (delete the file to re-send them, e.g. after raising the
                       server's context length)
  tokenized.jsonl      the merge's input (eagle3.datagen.contract), in prompt-file order
  report.json          counts, drops by reason, tokens, wall, rates, cost
  manifest.json        written last (io.PhaseOutput): {"complete": true, fingerprint, rows, sha256...}

The prompt file is read and checked first, and an endpoint is only connected to (a local server only started)
when prompts are left to generate. Everything written is redacted (eagle3.datagen.redact).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, ContextManager, Iterator

from eagle3.datagen.auto_server import resolved_config
from eagle3.datagen.client import (AUTH_STATUS, Endpoint, RunStats, SampleFailed, cost_usd, generate_all, make_client,
                                   reason_label, reason_retried)
from eagle3.datagen.contract import TOKENIZED, tokenized_line
from eagle3.datagen.prompts import MAX_REPORTED_BAD_LINES, Prompt, read_prompts
from eagle3.datagen.redact import redact, redacting_logger, register_secret
from eagle3.datagen.server import DEFAULT_SERVER_COMMAND, LocalServer
from eagle3.datagen.config import ClientConfig, DatagenConfig, DatasetSpec
from eagle3.datagen.store import AppendWriter, iter_records, repair_tail, scan_and_repair
from eagle3.datagen.tokenize import MaskMismatch, tokenize_conversation
from eagle3.errors import ConfigError, PipelineError
from eagle3.identity import tokenizer_identity
from eagle3.io import (DiskFullError, PhaseOutput, atomic_path, atomic_write_json, fingerprint, read_json,
                       remove_stale_temps, sha256_file)

log = redacting_logger(__name__)

GENERATIONS = "generations.jsonl"
GENERATIONS_META = "generations.meta.json"
ERRORS = "errors.jsonl"
TOO_LONG = "too_long.jsonl"
REPORT = "report.json"
DROP_REASONS = ("empty", "refused", "truncated", "mask_mismatch")
# what an endpoint's answers depend on: files made with other sampling params are set aside together
FINGERPRINTED = (GENERATIONS, TOO_LONG)

# the endpoint, or a way to get one for the duration of the generation (a local server's lifetime)
EndpointSource = Callable[[], ContextManager[Endpoint]]


class FailureBudgetExceeded(PipelineError):
    """More samples failed than the budget allows; retried only if some failure may pass on a later try
    (a 5xx, a timeout, a reset connection), not when every one was refused (401/403: a wrong key; 400...)."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message, retried=any(reason_retried(r) for r in reasons))
        auth = {str(s) for s in AUTH_STATUS} & set(reasons)
        self.kind = ("authentication refused" if auth and not self.retried else
                     "requests the endpoint refuses" if not self.retried else "a fault")


class EmptyDatasetError(PipelineError):
    """Every answer of a dataset was dropped or failed: nothing to train on, and the same run drops them again."""

    retried = False
    kind = "no usable sample"


def generation_fingerprint(spec: DatasetSpec, cfg: ClientConfig) -> str:
    """What makes two answers to one prompt interchangeable: the model and the sampling params."""
    return fingerprint({"model": cfg.model, **spec.sampling_params()})


def drop_reason(rec: dict, spec: DatasetSpec, refusal: list[re.Pattern]) -> str | None:
    answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    if not answers or any(not a.strip() for a in answers):
        return "empty"
    if any(p.search(a) for a in answers for p in refusal):
        return "refused"
    if spec.drop_truncated and "length" in rec.get("finish_reasons", [rec.get("finish_reason")]):
        return "truncated"
    return None


def _set_aside_old_generations(folder: Path, gen_fp: str) -> None:
    meta_path = folder / GENERATIONS_META
    old = read_json(meta_path).get("fingerprint") if meta_path.exists() else "unknown"
    if old != gen_fp:
        for name in FINGERPRINTED:
            path = folder / name
            if path.exists():
                # answers made with other params must not mix with new ones; keep them (nothing written is lost)
                aside = folder / f"{path.stem}.{old}.jsonl"
                path.rename(aside)
                log.warning("%s was made with other params (fingerprint %s != %s): moved to %s", path, old,
                            gen_fp, aside)
    atomic_write_json(meta_path, {"fingerprint": gen_fp})


def _index_lines(path: Path, wanted: set[str]) -> dict[str, int]:
    """Byte offset of each wanted id's first line, so samples can be read back in prompt order."""
    offsets, pos = {}, 0
    prefix = b'{"sample_id": "'
    with open(path, "rb") as f:
        for line in f:
            end = line.find(b'"', len(prefix))
            sid = line[len(prefix):end].decode()
            if sid in wanted and sid not in offsets:
                offsets[sid] = pos
            pos += len(line)
    return offsets


def tokenize_dataset(folder: Path, prompts: list[Prompt], spec: DatasetSpec, tokenizer) -> dict:
    """generations.jsonl -> tokenized.jsonl in prompt order, applying the drop rules. Returns counts."""
    gen_path = folder / GENERATIONS
    offsets = _index_lines(gen_path, {p.sample_id for p in prompts}) if gen_path.exists() else {}
    refusal = [re.compile(p, re.IGNORECASE) for p in spec.refusal_patterns]
    dropped = {r: 0 for r in DROP_REASONS}
    dropped_examples: dict[str, list[str]] = {r: [] for r in DROP_REASONS}
    rows = tokens = loss_tokens = 0
    p_tok = c_tok = 0
    with atomic_path(folder / TOKENIZED) as tmp, open(tmp, "w") as out, contextlib.ExitStack() as stack:
        gen = stack.enter_context(open(gen_path, "rb")) if offsets else None
        for p in prompts:
            if p.sample_id not in offsets:
                continue
            gen.seek(offsets[p.sample_id])
            rec = json.loads(gen.readline())
            p_tok += rec["usage"]["prompt_tokens"]
            c_tok += rec["usage"]["completion_tokens"]
            reason = drop_reason(rec, spec, refusal)
            if reason is None:
                try:
                    tok = tokenize_conversation(tokenizer, rec["messages"])
                except MaskMismatch as e:
                    log.warning("%s: %s", p.sample_id, e)
                    reason = "mask_mismatch"
            if reason is not None:
                dropped[reason] += 1
                if len(dropped_examples[reason]) < 5:
                    dropped_examples[reason].append(p.sample_id)
                continue
            out.write(tokenized_line(p.sample_id, spec.name, tok.input_ids, tok.loss_mask))
            rows += 1
            tokens += len(tok.input_ids)
            loss_tokens += sum(tok.loss_mask)
    return {"generated": len(offsets), "rows": rows, "tokens": tokens, "loss_tokens": loss_tokens,
            "dropped": dropped, "dropped_examples": {k: v for k, v in dropped_examples.items() if v},
            "usage_prompt_tokens": p_tok, "usage_completion_tokens": c_tok}


def run_fingerprint(spec: DatasetSpec, cfg: ClientConfig, tokenizer_path) -> str:
    return fingerprint({"gen": generation_fingerprint(spec, cfg), "prompts_sha256": sha256_file(spec.prompt_file),
                        "limit": spec.limit, "on_bad_line": spec.on_bad_line, "drop_truncated": spec.drop_truncated,
                        "refusal_patterns": spec.refusal_patterns, "tokenizer": tokenizer_identity(tokenizer_path)})


def _tokenized_matches(folder: Path) -> Callable[[dict], bool]:
    def verify(manifest: dict) -> bool:
        tok_path = folder / TOKENIZED
        return tok_path.is_file() and sha256_file(tok_path) == manifest.get("sha256")
    return verify


def run_dataset(spec: DatasetSpec, cfg: ClientConfig, endpoint: Endpoint | EndpointSource | None,
                tokenizer_path: str, out_dir: str | Path, tokenizer=None) -> dict:
    """Generate (resuming), tokenize, report. Returns the report dict; raises on a blown failure budget.

    A full disk raises DiskFullError naming the file and the phase; what was committed stays, a re-run resumes."""
    try:
        return _run_dataset(spec, cfg, endpoint, tokenizer_path, Path(out_dir), tokenizer)
    except DiskFullError as e:
        raise DiskFullError(f"datagen, dataset {spec.name}: {e}") from e


def _run_dataset(spec: DatasetSpec, cfg: ClientConfig, endpoint: Endpoint | EndpointSource | None,
                 tokenizer_path: str, out_dir: Path, tokenizer) -> dict:
    folder = out_dir / spec.name
    pset = read_prompts(spec.prompt_file, spec.name, spec.on_bad_line, spec.limit)  # before any server starts
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    gen_fp = generation_fingerprint(spec, cfg)
    run_fp = run_fingerprint(spec, cfg, tokenizer_path)
    out = PhaseOutput(folder, run_fp)
    if out.completed(verify=_tokenized_matches(folder)) is not None:
        log.info("%s: complete (manifest fingerprint %s matches): skipped", spec.name, run_fp)
        return {**read_json(folder / REPORT), "skipped": True}
    out.invalidate()

    _set_aside_old_generations(folder, gen_fp)
    scan = scan_and_repair(folder / GENERATIONS)
    repair_tail(folder / ERRORS)  # append-only too: a kill can cut its last line
    too_long_ids = scan_and_repair(folder / TOO_LONG).done_ids
    todo = [p for p in pset.prompts if p.sample_id not in scan.done_ids and p.sample_id not in too_long_ids]
    resumed = sum(p.sample_id in scan.done_ids for p in pset.prompts)
    log.info("%s: %d prompts, %d already done (resume), %d too long (not sent again), %d to generate%s",
             spec.name, len(pset.prompts), resumed, len(pset.prompts) - resumed - len(todo), len(todo),
             f"; repaired a truncated last line ({scan.truncated_bytes} bytes)" if scan.truncated_bytes else "")

    stats, endpoint_url = RunStats(), None
    if todo:
        if endpoint is None:
            raise PipelineError(f"{spec.name}: {len(todo)} prompts left to generate but no endpoint was given")
        with (endpoint() if callable(endpoint) else contextlib.nullcontext(endpoint)) as ep:
            endpoint_url = ep.base_url
            stats = asyncio.run(_generate(todo, spec, cfg, ep, folder, len(pset.prompts)))
    wall = stats.elapsed() if todo else 0.0

    if tokenizer is None:
        from eagle3.models import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
    t0 = time.monotonic()
    tok = tokenize_dataset(folder, pset.prompts, spec, tokenizer)
    too_long = _too_long_lines(folder, pset.prompts, spec.prompt_file)
    report = {
        "dataset": spec.name, "prompt_file": str(spec.prompt_file), "model": cfg.model,
        "endpoint": redact(endpoint_url) if endpoint_url else None, "fingerprint": run_fp,
        "prompts": len(pset.prompts), "bad_lines": pset.bad_lines, "bad_line_messages": pset.bad_line_messages,
        "duplicate_prompt_lines": pset.duplicate_lines,
        "too_long": len(too_long), "too_long_lines": too_long[:MAX_REPORTED_BAD_LINES],
        "resumed_done": resumed, "resume_repaired_bytes": scan.truncated_bytes,
        "resume_dropped_corrupt_lines": len(scan.corrupt_lines),
        "this_run": {
            "attempted": len(todo), "generated": stats.done, "failed": stats.failed, "too_long": stats.too_long,
            "failures_by_reason": dict(stats.failures), "retries_by_reason": dict(stats.retries),
            "requests": stats.requests, "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens, "wall_s": round(wall, 3),
            "requests_per_s": round(stats.requests / wall, 3) if wall else 0.0,
            "tokens_per_s": round((stats.prompt_tokens + stats.completion_tokens) / wall, 1) if wall else 0.0,
            "completion_tokens_per_s": round(stats.completion_tokens / wall, 1) if wall else 0.0,
            "cost_usd": round(cost_usd(stats.prompt_tokens, stats.completion_tokens, cfg), 6),
            "aborted": stats.aborted, "redacted_secrets": stats.redacted_secrets,
        },
        "generated": tok["generated"], "missing": len(pset.prompts) - tok["generated"] - len(too_long),
        "dropped": tok["dropped"], "dropped_examples": tok["dropped_examples"],
        "rows": tok["rows"], "tokens": tok["tokens"], "loss_tokens": tok["loss_tokens"],
        "usage": {"prompt_tokens": tok["usage_prompt_tokens"], "completion_tokens": tok["usage_completion_tokens"]},
        "cost_usd": round(cost_usd(tok["usage_prompt_tokens"], tok["usage_completion_tokens"], cfg), 6),
        "prices_per_million": {"prompt": cfg.price_prompt_per_m, "completion": cfg.price_completion_per_m},
        "tokenize_s": round(time.monotonic() - t0, 3),
        "client": {k: v for k, v in asdict(cfg).items() if not k.startswith("price")},
        "sampling": spec.sampling_params(),
    }
    budget_blown = stats.aborted is not None
    report["status"] = "failed" if budget_blown or not tok["rows"] else "complete"
    atomic_write_json(folder / REPORT, report)
    if budget_blown:
        top = ", ".join(f"{reason_label(k)}: {v}" for k, v in stats.failures.most_common())
        auth = [s for s in AUTH_STATUS if str(s) in stats.failures]
        hint = (f"; HTTP {auth[0]}: the endpoint refuses the API key (the Connection's password, or the variable "
                f"named by --api-key-env)" if auth else "")
        raise FailureBudgetExceeded(
            f"{spec.name}: {stats.failed} samples failed, {stats.aborted}; failures by reason: {top}{hint}; see "
            f"{folder / ERRORS} ({stats.done} samples were generated and kept: a re-run resumes)", list(stats.failures))
    if not tok["rows"]:
        raise EmptyDatasetError(no_rows_message(report, folder))
    if stats.redacted_secrets:
        log.warning("%s: the endpoint's answers held the API key %d times: masked as *** in the stored answers",
                    spec.name, stats.redacted_secrets)
    if report["missing"]:
        log.warning("%s: %d prompts failed within the budget (max_failed_fraction=%s): listed in %s",
                    spec.name, report["missing"], cfg.max_failed_fraction, folder / ERRORS)
    out.commit({
        "dataset": spec.name, "file": TOKENIZED, "sha256": sha256_file(folder / TOKENIZED), "rows": tok["rows"],
        "tokens": tok["tokens"], "loss_tokens": tok["loss_tokens"], "prompts": len(pset.prompts),
        "missing": report["missing"], "too_long": len(too_long), "dropped": tok["dropped"]})
    log.info("%s: %d rows, %d tokens (%d under the loss mask), dropped %s, too long %d, missing %d, cost $%.4f -> %s",
             spec.name, tok["rows"], tok["tokens"], tok["loss_tokens"], tok["dropped"], len(too_long),
             report["missing"], report["cost_usd"], folder)
    return report


# what to change when every answer was dropped for a reason
NO_ROWS_ADVICE = {
    "truncated": "raise the dataset's max_tokens (answers hit it) or set drop_truncated=false",
    "refused": "check the dataset's refusal_patterns (every answer matched one)",
    "empty": "check the endpoint's answers in generations.jsonl (every one was empty)",
    "mask_mismatch": "the target's chat template does not reproduce the answers (see the task log)",
    "too_long": "use shorter prompts or a server with a longer context",
    "failed": "see errors.jsonl",
}


def no_rows_message(report: dict, folder: Path) -> str:
    counts = {**{k: v for k, v in report["dropped"].items() if v}, "too_long": report["too_long"],
              "failed": report["missing"]}
    counts = {k: v for k, v in counts.items() if v}
    what = ", ".join(f"{k} {v}" for k, v in counts.items()) or "none generated"
    todo = "; ".join(f"{k}: {NO_ROWS_ADVICE[k]}" for k in counts)
    return (f"dataset {report['dataset']}: no usable sample: of {report['prompts']} prompts ({report['bad_lines']} "
            f"bad lines skipped) none is left: {what}. What to change: {todo or 'add prompts'}; see "
            f"{folder / REPORT} (the answers in {folder / GENERATIONS} are kept: a re-run with other drop rules "
            f"does not ask again)")


def _too_long_lines(folder: Path, prompts: list[Prompt], prompt_file: str) -> list[str]:
    """`file:line: reason` of every prompt of this file the endpoint rejected as too long, in file order."""
    path = folder / TOO_LONG
    if not path.exists():
        return []
    line_of = {p.sample_id: p.line_no for p in prompts}
    recs = sorted((line_of[r["sample_id"]], r["message"]) for r in iter_records(path) if r["sample_id"] in line_of)
    return [f"{prompt_file}:{line}: {message}" for line, message in recs]


async def _generate(todo: list[Prompt], spec: DatasetSpec, cfg: ClientConfig, endpoint: Endpoint,
                    folder: Path, dataset_size: int) -> RunStats:
    client = make_client(endpoint, cfg)
    with (AppendWriter(folder / GENERATIONS) as gen, AppendWriter(folder / ERRORS) as err,
          AppendWriter(folder / TOO_LONG) as too_long):
        def record(p: Prompt, e: SampleFailed) -> dict:
            return {"sample_id": p.sample_id, "dataset": spec.name, "line": p.line_no, "reason": e.reason,
                    "message": e.message, "attempts": e.attempts, "time": time.time()}

        def on_too_long(p: Prompt, e: SampleFailed) -> None:
            too_long.write(record(p, e))
            log.warning("%s:%d: longer than the endpoint's context (%s): a bad line, recorded in %s and not sent "
                        "again", spec.prompt_file, p.line_no, e.message, folder / TOO_LONG)

        try:
            return await generate_all(client, todo, spec, cfg, gen.write, lambda p, e: err.write(record(p, e)),
                                      dataset_size=dataset_size, on_too_long=on_too_long)
        finally:
            await client.close()


SERVER_LOG = "server.log"  # the local server's output, beside the dataset's files


@contextlib.contextmanager
def local_server_endpoint(cfg: DatagenConfig, api_key: str, log_file: Path | None = None) -> Iterator[Endpoint]:
    """The task's own server for the duration of the generation: started, awaited, always stopped. Its output
    goes to `log_file` (the task log names it: a server prints thousands of lines the task log would bury)."""
    server = LocalServer(cfg.server_command or DEFAULT_SERVER_COMMAND, cfg.server_extra_args,
                         model_path=cfg.target.model_path, gguf=cfg.gguf or "", port=cfg.server_port,
                         ready_timeout_s=cfg.server_ready_timeout_s,
                         log_file=None if log_file is None else str(log_file))
    with server:  # stops the server on success, failure and Airflow's SIGTERM on task kill
        yield Endpoint(server.base_url, api_key)


def run_datagen(spec: DatasetSpec, cfg: DatagenConfig, *, base_url: str | None = None, api_key: str = "EMPTY",
                tokenizer=None) -> dict:
    """One dataset of the datagen task. remote: the endpoint at `base_url` answers; local: the task's own server
    answers, started only when prompts are left to generate. `api_key` goes to either."""
    register_secret(api_key)  # before a local server starts: it may print its --api-key
    cfg = resolved_config(cfg)  # "auto" server values, when no preflight resolved them (the CLI, tests)
    if cfg.mode == "remote":
        if base_url is None:
            raise ConfigError(f"datagen: mode 'remote' needs the endpoint's base URL (from conn_id {cfg.conn_id!r})")
        source: Endpoint | EndpointSource = Endpoint(base_url, api_key)
    else:
        source = functools.partial(local_server_endpoint, cfg, api_key,
                                   Path(cfg.output_dir) / spec.name / SERVER_LOG)
    return run_dataset(spec, cfg.client_config(), source, cfg.target.model_path, cfg.output_dir, tokenizer)
