#!/usr/bin/env bash
# The quickstart pretraining at 2 threads and at 1, interleaved twice: images/s of each, the 1-minute load
# beside it, and whether the run advised fewer threads (runtime/threads.py). On a machine shared with other
# work the two differ most; ~2 min on 2 cores.
set -euo pipefail
VIT=${VIT:-.venv/bin/vit}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for round in 1 2; do
  for threads in 2 1; do
    OMP_NUM_THREADS=$threads "$VIT" pretrain -r recipes/quickstart/pretrain.yaml schedule.epochs=0 \
      schedule.steps=60 schedule.warmup_steps=2 data.val_split= data.test_split= \
      data.synthetic.train_size=2048 --workdir "$OUT/t$threads" --overwrite --json \
      > "$OUT/summary.json" 2> "$OUT/log"
    img_s=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['train/img_per_s']))" \
      "$OUT/summary.json")
    advised=$(grep -c "cores are shared" "$OUT/log" || true)
    echo "round $round threads $threads img/s $img_s load $(cut -d' ' -f1 /proc/loadavg) advised $advised"
  done
done
