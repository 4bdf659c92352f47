"""The datagen phase's output, as the merge reads it (contract 1): one folder per dataset, named after it, holding
`tokenized.jsonl` (one JSON object a line, these fields, in prompt-file order) and `manifest.json`, written last,
that says the dataset is complete."""

from __future__ import annotations

import json

TOKENIZED = "tokenized.jsonl"
FIELDS = ("sample_id", "dataset", "input_ids", "loss_mask")  # ids: token ids; loss_mask: 1 = trained on


def tokenized_line(sample_id: str, dataset: str, input_ids: list[int], loss_mask: list[int]) -> str:
    return json.dumps(dict(zip(FIELDS, (sample_id, dataset, input_ids, loss_mask)))) + "\n"
