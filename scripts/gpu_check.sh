#!/usr/bin/env bash
# One run on a GPU machine, for docs/gpu.md: the GPU tier, the digits quickstart, and resnet50 on 2 GPUs.
# Usage (repository root, venv active): scripts/gpu_check.sh [summary file, default gpu_check_summary.md]
# Aimed at under 10 minutes on one H100 (first run, 2026-11-28: the tier 7 min 37 s, the quickstart 26 s).
# Exits with the GPU tier's status (pytest's: 0 only if the tier passed), after writing one summary file to paste
# into docs/gpu.md: the tier's result line, each "docs/gpu.md row:" line the
# tests print (the "Measured on GPUs" table), benchmark.py's table, the quickstart's val_top1 and 2-GPU img/s.
set -uo pipefail
summary=${1:-gpu_check_summary.md}
work=$(mktemp -d)
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
gpu=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')")
{
  echo "# scripts/gpu_check.sh on $(hostname), $(date -u +%Y-%m-%dT%H:%MZ): $gpus x $gpu"
  echo "torch $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'), commit $(git rev-parse --short HEAD)"
} > "$summary"
part() { echo -e "\n## $1 ($(($(date +%s) - start)) s)" >> "$summary"; }

start=$(date +%s)
python -m pytest tests/test_gpu.py -m gpu -s -q -n 0 -p no:cacheprovider 2>&1 | tee "$work/tier.log"  # the tier is this file
tier_status=${PIPESTATUS[0]}  # pytest's, not tee's: the script exits with it
part "GPU tier: python -m pytest tests/test_gpu.py -m gpu -s -q -n 0 (exit status $tier_status)"
tail -n 1 "$work/tier.log" >> "$summary"
grep -E "^(FAILED|ERROR|SKIPPED)" "$work/tier.log" >> "$summary"
echo -e "\nRows for docs/gpu.md's \"Measured on GPUs\" table (written there: the first run's figures):" >> "$summary"
grep -o "docs/gpu.md row: .*" "$work/tier.log" | sed 's/^docs\/gpu.md row: //; s/  (written there.*//' >> "$summary"
grep -E "^resnet50 |largest power-of-two|^\| *(model|resnet50)" "$work/tier.log" >> "$summary"

start=$(date +%s)
python train.py --config configs/digits.yaml output_dir="$work/digits" 2>&1 | tail -n 3
part "digits quickstart: python train.py --config configs/digits.yaml"
python - "$work/digits/metrics.jsonl" >> "$summary" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{len(rows)} epochs, last val_top1 {rows[-1]['val_top1']:.2f}, best {max(r['val_top1'] for r in rows):.2f}")
PY

start=$(date +%s)
python benchmark.py --model resnet50 --batch-size 256 --img-size 224 --amp auto --channels-last true --mode train \
  --warmup 10 --steps 50 --json "$work/bench.json" | tee -a "$work/bench.txt"
part "benchmark.py resnet50, batch 256, one GPU (benchmark.py times one process)"
cat "$work/bench.txt" >> "$summary"
start=$(date +%s)
if [ "$gpus" -ge 2 ]; then
  torchrun --nproc_per_node=2 train.py --config resnet50 output_dir="$work/r50x2" data.name=dummy \
    data.dummy_image_size=256 data.dummy_train_size=20480 data.dummy_val_size=512 data.dummy_num_classes=1000 \
    train.max_steps=30 logging.progress=false logging.wandb=false 2>&1 | tail -n 3
  part "resnet50 recipe on 2 GPUs (torchrun, DDP, dummy data, 30 steps of 256 per GPU)"
  python - "$work/r50x2/metrics.jsonl" >> "$summary" <<'PY'
import json, sys
row = [json.loads(line) for line in open(sys.argv[1])][-1]
print(f"train_img_per_s {row['train_img_per_s']:.0f} (both GPUs), step {row['train_step_s'] * 1000:.1f} ms, "
      f"input wait {row['train_input_wait']:.3f}")
PY
else
  part "resnet50 recipe on 2 GPUs: skipped, this machine has $gpus GPU(s)"
fi
echo "summary: $summary (scratch: $work); the GPU tier exited $tier_status"
exit "$tier_status"  # a failed tier fails the script (the summary is written either way)
