#!/bin/bash
# one device call: GPU tests, then bench runs; at most three files come back ($C-gpu.txt, $C.tar.xz, cache.tar.xz)
C=${1:-call}
T0=$(date +%s)
W=/tmp/out/$C; mkdir -p $W
S=$OUT/$C-gpu.txt
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $S 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site2 . >/dev/null 2>&1
mkdir -p /tmp/fla && tar xJf .whl/fla.tar.xz -C /tmp/fla
export TRITON_CACHE_DIR=/tmp/cache/triton TRITON_CACHE_AUTOTUNING=1 TILELANG_CACHE_DIR=/tmp/cache/tilelang
[ -f .dev/cache.tar.xz ] && tar xJf .dev/cache.tar.xz -C /tmp
echo "setup $(( $(date +%s) - T0 )) s" >> $S
if [ -n "$TESTS" ]; then
  PYTHONPATH=/tmp/site:/tmp/site2:$PWD timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -s -p no:cacheprovider $TESTS > $W/tests.txt 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s" >> $S
  tail -40 $W/tests.txt >> $S
fi
B="python3 bench/recipe_gpu.py train --device cuda --steps 10 --set grad_accum=1 --set chain_kernel=liger --no-baseline"
for spec in $RUNS; do  # name:micro_batch:multiple:warmup (multiple 0 = no graphs)
  IFS=: read name mb mult wu <<< "$spec"
  extra=""; [ "$mult" != 0 ] && extra="--set cuda_graphs=true --set graph_length_multiple=$mult"
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  [ $left -lt 40 ] && { echo "$name skipped: $left s left" >> $S; continue; }
  PYTHONPATH=/tmp/fla:/tmp/site:/tmp/site2:$PWD timeout $left $B --warmup ${wu:-3} --set micro_batch_size=$mb $extra --json $W/$name.json > $W/$name.txt 2>&1
  echo "$name rc=$? at $(( $(date +%s) - T0 )) s" >> $S
  python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['train']; print({k: t.get(k) for k in ('mfu','hfu','tokens_per_s','padding_share','peak_alloc_gib','peak_reserved_gib','warmup_s','wall_s','graphs')})" $W/$name.json >> $S 2>&1
done
tar cJf $OUT/$C.tar.xz -C /tmp/out $C
tar cf - -C /tmp cache 2>/dev/null | xz -3 -T8 > $OUT/cache.tar.xz
echo "done at $(( $(date +%s) - T0 )) s" >> $S
