"""Data generation: the target model's own answers to prompt datasets, resumable, with accounting.

    spec.py      DatasetSpec (JSON-schema checked), ClientConfig and the task's DatagenConfig
    prompts.py   JSONL prompt readers (messages / prompt / ShareGPT conversations), stable sample ids
    client.py    async bounded-concurrency client with retries, backoff, failure budget, progress
    store.py     append-only generations file and the resume scan (truncated-line repair)
    tokenize.py  chat template -> input_ids + loss_mask, verified by decoding
    server.py    a local inference server tied to the task's lifetime
    redact.py    secrets (API keys, Authorization values, URL userinfo) out of everything written
    run.py       one dataset end to end -> tokenized.jsonl, report.json, manifest.json
"""

from eagle3.datagen.client import Endpoint
from eagle3.datagen.run import FailureBudgetExceeded, run_datagen, run_dataset
from eagle3.datagen.server import DEFAULT_SERVER_COMMAND, LocalServer
from eagle3.datagen.spec import ClientConfig, DatagenConfig, DatasetSpec

__all__ = ["ClientConfig", "DatagenConfig", "DatasetSpec", "Endpoint", "FailureBudgetExceeded", "LocalServer",
           "DEFAULT_SERVER_COMMAND", "run_datagen", "run_dataset"]
