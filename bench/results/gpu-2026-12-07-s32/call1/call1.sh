#!/bin/bash
# session 32 call 1: the split decode attention (tests, kernel sweep, whole-step A/B), and the
# shipped route table's default lookup (route tests)
export PYTHONUNBUFFERED=1 PYTHONPATH=src
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $S
t0=$SECONDS
timeout 200 python -m pytest -q tests/models/test_decode_attention_on_gpu.py tests/models/test_skinny_on_gpu.py \
  tests/rl/test_engine_on_gpu.py -k "split or huginn or graph_replay or route" -p no:cacheprovider > $OUT/gpu-tests.txt 2>&1
echo "tests rc=$? $(tail -1 $OUT/gpu-tests.txt) $((SECONDS-t0))s" | tee -a $S
timeout 170 python bench/decode_attention.py --sweep --models huginn --sweep-deadline 110 --json $OUT/decode_attention-huginn.json > $OUT/sweep.txt 2>&1
echo "sweep rc=$? $((SECONDS-t0))s" | tee -a $S
grep -E "huginn .* S=(176|1024) .*x[0-9]|best|kernel \(" $OUT/sweep.txt | sort -t: -k2 | head -60 >> $S
BEST=$(python - <<'PY'
import json, os
c = json.load(open(os.environ["OUT"] + "/decode_attention-huginn.json"))["cases"]
t = next(x for x in c if x["S"] == 176)["times"]
# the splits at the plan's own launch (64 positions, 4 warps, 2 stages): what HOBSON_DECODE_SPLIT sets
r = sorted((v["us"], k) for k, v in t.items() if "us" in v and k.startswith("dot b64 w4 s2 x"))
print(r[0][1].rsplit("x", 1)[1] if r else 3)
PY
)
echo "best split at the plan's launch: $BEST" | tee -a $S
for i in 1 2; do for sp in 1 $BEST; do
  HOBSON_DECODE_SPLIT=$sp timeout 100 python bench/rl_gpu.py --kind huginn_raven --work /tmp/w --parts rollout --rollout-dtype bfloat16 \
    --engines now --native-only --json $OUT/huginn-split$sp-$i.json > /tmp/r.txt 2>&1
  echo "$i split=$sp rc=$? $((SECONDS-t0))s $(grep 'native engine' /tmp/r.txt | tail -1)" | tee -a $S
done; done
