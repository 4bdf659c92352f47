"""`python -m eagle3.datagen`: run one dataset from the command line (also what the kill tests drive).

The API key is read from the environment variable named by --api-key-env (never from argv,
which `ps` shows to every user).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from eagle3.datagen import ClientConfig, DatasetSpec, Endpoint, LocalServer, is_complete, run_dataset
from eagle3.datagen.server import DEFAULT_SERVER_COMMAND


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3.datagen", description=__doc__)
    ap.add_argument("--spec", required=True, help="dataset spec: a JSON file or inline JSON object")
    ap.add_argument("--out", required=True, help="datagen output folder (<out>/<dataset>/ is written)")
    ap.add_argument("--tokenizer", required=True, help="target model HF folder (tokenizer + chat template)")
    ap.add_argument("--client", default="{}", help="ClientConfig fields as JSON")
    ap.add_argument("--base-url", help="remote mode: OpenAI-compatible base URL (…/v1)")
    ap.add_argument("--api-key-env", default="EAGLE3_API_KEY")
    ap.add_argument("--server-command", help="local mode: server command template ({model_path} {port} {host} {gguf})",
                    nargs="?", const=DEFAULT_SERVER_COMMAND)
    ap.add_argument("--server-extra-args", default="")
    ap.add_argument("--model-path", default="")
    ap.add_argument("--gguf", default="")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    spec_obj = json.loads(open(a.spec).read()) if os.path.isfile(a.spec) else json.loads(a.spec)
    spec = DatasetSpec.from_dict(spec_obj, where=a.spec if os.path.isfile(a.spec) else "--spec")
    cfg = ClientConfig.from_dict(json.loads(a.client))
    key = os.environ.get(a.api_key_env, "EMPTY")
    if a.server_command and not is_complete(spec, cfg, a.tokenizer, a.out):
        with LocalServer(a.server_command, a.server_extra_args, model_path=a.model_path or a.tokenizer,
                         gguf=a.gguf, ready_timeout_s=a.ready_timeout) as srv:
            report = run_dataset(spec, cfg, Endpoint(srv.base_url, key), a.tokenizer, a.out)
    else:
        endpoint = Endpoint(a.base_url, key) if a.base_url else None
        report = run_dataset(spec, cfg, endpoint, a.tokenizer, a.out)
    print(json.dumps({k: report[k] for k in ("dataset", "rows", "tokens", "missing", "dropped", "cost_usd")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
