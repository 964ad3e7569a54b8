#!/usr/bin/env bash
# The quickstart, end to end and offline: pretrain a tiny ViT at 32 px on the built-in dataset, fine-tune it
# at 64 px (zero head, interpolated position embedding), measure linear few-shot accuracy, draw the paper's
# Figure 7 for the pretrained model and both runs' training curves.
# Re-running continues or reuses what is already in runs/quickstart (each stage resumes from its workdir).
# --record adds what the docs quote beyond the demo (make record keeps it in docs/measured/): the two
# baselines (the fine-tune from random initialisation, the few-shot table of the pretrained network's random
# initialisation) and `vit evaluate` of the fine-tune.
# RUNS=DIR runs it elsewhere; VIT='python -m vitcli' runs it without .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
VIT=${VIT:-.venv/bin/vit}
RUNS=${RUNS:-runs/quickstart}

$VIT pretrain --recipe recipes/quickstart/pretrain.yaml --workdir $RUNS/pretrain
$VIT finetune --recipe recipes/quickstart/finetune.yaml --init $RUNS/pretrain --workdir $RUNS/finetune
$VIT eval-fewshot --recipe recipes/quickstart/fewshot.yaml --ckpt $RUNS/pretrain --workdir $RUNS/fewshot
$VIT inspect --ckpt $RUNS/pretrain --out $RUNS/inspect
$VIT plot $RUNS/pretrain $RUNS/finetune --out $RUNS/curves.png
if [[ "${1:-}" == --record ]]; then
    $VIT finetune --recipe recipes/quickstart/finetune.yaml --workdir $RUNS/finetune_scratch
    $VIT eval-fewshot --recipe recipes/quickstart/fewshot.yaml --ckpt $RUNS/pretrain --random-init \
        --workdir $RUNS/fewshot_random_init
    $VIT evaluate --ckpt $RUNS/finetune --workdir $RUNS/evaluate
fi
