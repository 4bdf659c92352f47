"""Data generation: the target model's own answers to prompt datasets, resumable, with accounting.

    config.py    DatasetSpec (JSON-schema checked), ClientConfig and the task's DatagenConfig
    prompts.py   JSONL prompt readers (messages / prompt / ShareGPT conversations), stable sample ids
    client.py    async bounded-concurrency client with retries, backoff, failure budget, progress
    store.py     append-only generations file and the resume scan (truncated-line repair)
    tokenize.py  chat template -> input_ids + loss_mask, verified by decoding
    server.py    a local inference server tied to the task's lifetime
    redact.py    secrets (API keys, Authorization values, URL userinfo) out of everything written
    run.py       one dataset end to end -> tokenized.jsonl, report.json, manifest.json
    contract.py  what the merge reads: tokenized.jsonl and its fields
"""

# Loaded on first use: reading prompt files (eagle3.datagen.prompts) must not need the HTTP client's packages
# (openai, aiohttp), which a GPU box that only extracts or evaluates may lack.
_EXPORTS = {"Endpoint": "client", "FailureBudgetExceeded": "run", "run_datagen": "run", "run_dataset": "run",
            "DEFAULT_SERVER_COMMAND": "server", "LocalServer": "server", "ClientConfig": "config",
            "DatagenConfig": "config", "DatasetSpec": "config"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'eagle3.datagen' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"eagle3.datagen.{_EXPORTS[name]}"), name)
