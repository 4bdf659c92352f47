"""The DAG conf of the demo run: the small real model on the CPU, sizes that finish in minutes."""

import argparse
import json

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
}))
