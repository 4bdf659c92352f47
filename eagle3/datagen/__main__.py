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

from eagle3.cli import add_debug, guarded
from eagle3.errors import ConfigError
from eagle3.io import BadJSONLine, json_line
from eagle3.sections import TargetConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3.datagen", description=__doc__)
    ap.add_argument("--spec", required=True, help="dataset spec: a JSON file or inline JSON object")
    ap.add_argument("--out", required=True, help="datagen output folder (<out>/<dataset>/ is written)")
    ap.add_argument("--tokenizer", required=True, help="target model HF folder (tokenizer + chat template)")
    ap.add_argument("--model", default="default", help="served model name sent in each request")
    ap.add_argument("--client", default="{}", help="client params as JSON (DatagenConfig.client)")
    ap.add_argument("--base-url", help="remote mode: OpenAI-compatible base URL (…/v1)")
    ap.add_argument("--api-key-env", default="EAGLE3_API_KEY")
    ap.add_argument("--server-command", nargs="?", const="",
                    help="local mode: server command template ({model_path} {port} {host} {gguf}); "
                         "given without a value: SGLang's")
    ap.add_argument("--server-extra-args")
    ap.add_argument("--gguf")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    add_debug(ap)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return guarded("python -m eagle3.datagen", lambda: run(a), a.debug)


def json_arg(name: str, text: str):
    try:
        return json_line(text)
    except BadJSONLine as e:
        raise ConfigError(f"{name}: {e}") from None


def run(a: argparse.Namespace) -> int:
    from eagle3.datagen import DatagenConfig, DatasetSpec, run_datagen

    from_file = os.path.isfile(a.spec)
    spec_obj = json_arg(a.spec, open(a.spec, "rb").read()) if from_file else json_arg("--spec", a.spec)
    spec = DatasetSpec.from_dict(spec_obj, where=a.spec if from_file else "--spec")
    local = a.server_command is not None
    cfg = DatagenConfig(target=TargetConfig(model_path=a.tokenizer), output_dir=a.out,
                        mode="local" if local else "remote",
                        conn_id=None if local else "--base-url",  # here the endpoint is an argument, not a Connection
                        served_model_name=a.model, server_command=a.server_command or None,
                        server_extra_args=a.server_extra_args, gguf=a.gguf, client=json_arg("--client", a.client),
                        server_ready_timeout_s=a.ready_timeout)
    report = run_datagen(spec, cfg, base_url=a.base_url, api_key=os.environ.get(a.api_key_env, "EMPTY"))
    print(json.dumps({k: report[k] for k in ("dataset", "rows", "tokens", "missing", "dropped", "cost_usd")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
