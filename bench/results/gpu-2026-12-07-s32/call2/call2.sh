#!/bin/bash
# session 32 call 2: the decode-attention kernel's loads beside the key mask's (tests, sweep, whole-step A/B)
export PYTHONUNBUFFERED=1 PYTHONPATH=src
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $S
t0=$SECONDS
HOBSON_DECODE_PLAN=mask_loads=0 timeout 100 python -m pytest -q tests/models/test_decode_attention_on_gpu.py tests/rl/test_engine_on_gpu.py \
  -k "engine_decodes or graph_replay" -p no:cacheprovider > $OUT/gpu-tests-free.txt 2>&1
echo "engine tests, loads beside the mask: rc=$? $(tail -1 $OUT/gpu-tests-free.txt) $((SECONDS-t0))s" | tee -a $S
timeout 120 python bench/decode_attention.py --sweep --models huginn --sweep-deadline 45 --json $OUT/decode_attention.json > $OUT/sweep.txt 2>&1
echo "sweep rc=$? $((SECONDS-t0))s" | tee -a $S
python - <<'PY'
import json, os
c = json.load(open(os.environ["OUT"] + "/decode_attention.json"))["cases"]
for x in c:
    t = sorted((v["us"], k) for k, v in x["times"].items() if "us" in v)
    base = next(k for k in x["times"] if k.startswith("kernel ("))
    print(f"# {x['model']} {x['dtype']} S={x['S']}: plan {x['times'][base].get('us', 0):.2f}, "
          f"free {x['times'].get('dot b64 w4 s2 free', {}).get('us', 0):.2f}, best "
          + ", ".join(f"{k} {u:.2f}" for u, k in t[:5]), file=open(os.environ["OUT"] + "/summary.txt", "a"))
PY
for i in 1 2; do for pl in "split=1" "mask_loads=0"; do
  [ $((SECONDS-t0)) -gt 250 ] && { echo "$i plan=$pl skipped: past 250 s" | tee -a $S; continue; }
  HOBSON_DECODE_PLAN=$pl timeout 100 python bench/rl_gpu.py --kind huginn_raven --work /tmp/w --parts rollout --rollout-dtype bfloat16 \
    --engines now --native-only > /tmp/r.txt 2>&1
  echo "$i plan=$pl rc=$? $((SECONDS-t0))s $(grep 'native engine' /tmp/r.txt | tail -1)" | tee -a $S
done; done
