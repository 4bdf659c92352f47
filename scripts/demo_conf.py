"""The DAG conf of the demo run: the real SmolLM2-135M-Instruct on the CPU, sized to finish in minutes.

Data generation runs llama.cpp's OpenAI-compatible server (the named server `llama.cpp`) on the model's GGUF as
the local server.
"""

import argparse
import json
from pathlib import Path

from eagle3.models import find_smollm2_gguf

REPO = Path(__file__).resolve().parents[1]
p = argparse.ArgumentParser()
p.add_argument("--model-path", required=True)
p.add_argument("--output-root", required=True)
p.add_argument("--run-name", default="demo")
a = p.parse_args()
print(json.dumps({
    "model_path": a.model_path,
    "output_root": a.output_root,
    "run_name": a.run_name,
    "allow_cpu": True,
    "estimated_tokens": 100_000,
    "datasets": [
        {"name": "A1", "prompt_file": str(REPO / "data/demo/A1.jsonl"), "max_tokens": 200, "drop_truncated": False},
        {"name": "B1", "prompt_file": str(REPO / "data/demo/B1.jsonl"), "max_tokens": 200, "drop_truncated": False},
    ],
    "datagen_mode": "local",
    "server_command": "llama.cpp",  # a named server: free-form commands are a deployment setting (off)
    "gguf": str(find_smollm2_gguf()),
    "served_model_name": "smollm2",
    "datagen_client": {"concurrency": 4},
    "num_shards": 2,
    "draft_vocab_size": 32000,
    "epochs": 8,
    "batch_size": 4,
    "lr": 1e-3,
    "eval_prompts": str(REPO / "data/demo/eval.jsonl"),
    "eval_max_prompts": 0,
    "eval_ks": [3],
    "eval_max_new_tokens": 32,
}))
