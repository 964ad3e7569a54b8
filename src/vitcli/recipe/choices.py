"""The closed sets of values recipe keys take, defined once and torch-free.

The checks read them at resolve time (before torch is imported); the modules that act on a value
(position tables, masked patch prediction, precision, trackers, few-shot preprocessing) import them
from here. A recipe key with a closed set is annotated in schema.py with its `Literal` from here,
and each tuple is read off its Literal: one list of names per set, which the reading of a recipe
(layers._coerce) and the checks (checks.CHOICES) both take from the annotation.
"""

from __future__ import annotations

from typing import Literal, get_args

# one per command that reads a recipe: the command sets recipe.stage, the checks ask what it
# requires
Stage = Literal["pretrain", "finetune", "eval-fewshot", "evaluate", "predict", "inspect", "export",
                "prepare-data"]
STAGES = get_args(Stage)
TRAINS = ("pretrain", "finetune")  # the stages that train, and so need a length and a whole batch
LABELLED = (*TRAINS, "evaluate")  # the stages that read a split's labels
# the stages that run a checkpoint as it is, head included (evaluate a split, predict images)
CLASSIFIES = ("evaluate", "predict")
# the stages that take a checkpoint's network as trained, at its native resolution and without its
# head: few-shot and inspect read its features, export puts the head back
AS_TRAINED = ("eval-fewshot", "inspect", "export")
WEIGHTED = (*AS_TRAINED, *CLASSIFIES)  # the stages that need a checkpoint named (--ckpt)
# a stage that reads only some sections of a recipe; it takes them from a recipe file of any stage
SECTIONS = {"prepare-data": ("data",)}
EXPORT_FORMATS = ("hf", "onnx", "timm")  # `vit export --format`: vitcli.stages.export writes each
# model.pool: `token` reads the class token (the paper's); `gap` averages the patch tokens after the
# final norm (big_vision's GAP, no class token); `gap_fc_norm` keeps a class token in the sequence,
# averages the patch tokens alone and normalises the mean (MAE's global_pool, BEiT's mean pooling;
# timm's class_token=True, global_pool='avg', fc_norm=True): no final norm, an `fc_norm` after the
# pooling instead
Pool = Literal["token", "gap", "gap_fc_norm"]
POOLS = get_args(Pool)
CLASS_TOKEN_POOLS = ("token", "gap_fc_norm")  # the pools whose network carries a class token
VitPosEmbed = Literal["learned_1d", "learned_2d", "sincos_2d", "none"]
VIT_POS_EMBEDS = get_args(VitPosEmbed)
# model.pos_embed; sincos_1d: T2T-ViT's own fixed table
PosEmbed = Literal[VitPosEmbed, "sincos_1d"]
TTA_VIEWS = ("flip", "multicrop")  # `vit evaluate --tta`: vitcli.evaluators.tta makes each view
# bilinear: big_vision / vit_jax; bicubic: timm (antialiased)
PosembMethod = Literal["bilinear", "bicubic"]
POSEMB_METHODS = get_args(PosembMethod)
# `vit evaluate --imagenet-set`: the ImageNet sets an ImageNet-1k head is scored on
# (evaluators.robustness)
IMAGENET_SETS = ("imagenet", "imagenet-v2", "imagenet-a", "imagenet-r", "imagenet-sketch")
MppTarget = Literal["mean_color", "color_4x4", "pixels_l2"]
MPP_TARGETS = get_args(MppTarget)
MPP_CELLS = 4  # color_4x4 pools each patch to MPP_CELLS x MPP_CELLS cells
Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS = get_args(Precision)
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
# logger -> the package it needs (= the pip extra)
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
                   "trackio": "trackio"}
FewshotResizeMethod = Literal["big_vision"]
FEWSHOT_RESIZE_METHODS = get_args(FewshotResizeMethod)
# data.interpolation: the train and eval resizes
Interpolation = Literal["bilinear", "bicubic", "nearest"]
INTERPOLATIONS = get_args(Interpolation)
# data.eval_crop_mode, timm's crop_mode: center keeps the aspect (shorter side), squash does not
# (both sides: transformers' ViTImageProcessor, vit_jax's eval)
EvalCropMode = Literal["center", "squash"]
EVAL_CROP_MODES = get_args(EvalCropMode)
# fewshot.protocols: what scores frozen features; the all-data ones (vitcli.fewshot.protocols runs
# each) are logged as PROTOCOL/TASK/top1, and few-shot beside them
ALL_DATA_PROTOCOLS = ("knn", "linear", "ridge")
TRANSFER_PROTOCOLS = ("fewshot", *ALL_DATA_PROTOCOLS)
ErasingMode = Literal["pixel", "rand", "const"]  # data.erasing_mode: timm RandomErasing's modes
ERASING_MODES = get_args(ErasingMode)
MixMode = Literal["batch", "pair", "elem"]  # data.mix_mode: timm Mixup's modes
MIX_MODES = get_args(MixMode)
EmaSave = Literal["live", "ema"]  # ema.save: the weights model.safetensors holds
EMA_SAVES = get_args(EmaSave)
DistillType = Literal["none", "hard", "soft"]  # distill.type: DeiT's --distillation-type
DISTILL_TYPES = get_args(DistillType)
# the closed sets no module beside the checks names: only their Literal
Objective = Literal["supervised", "mpp", "mae", "dino"]  # objective: the last three pretrain without labels
# dino.centering: DINO's running centre of the teacher's outputs | DINOv2's Sinkhorn-Knopp
Centering = Literal["center", "sinkhorn"]
CENTERINGS = get_args(Centering)
OptimName = Literal["adamw", "sgd"]
Loss = Literal["softmax", "sigmoid"]
WeightDecayConvention = Literal["torch", "big_vision"]
Decay = Literal["linear", "cosine", "constant"]  # schedule.decay
Device = Literal["auto", "cpu", "cuda"]
# run.strategy; fsdp with one process is allowed: unsharded, same checkpoint format
Strategy = Literal["ddp", "fsdp"]
# data.label_rule: labels derived from raw columns (VTAB); vitcli.data.rows.tasks.LABEL_RULES holds
# their functions
LABEL_RULES = ("clevr_count", "clevr_distance", "kitti_closest_vehicle", "dsprites_location",
               "dsprites_orientation")
# data.source=synthetic, the built-in data: 6 shapes x 5 textures (vitcli.data.rows.synthetic draws
# them)
SYNTHETIC_MAX_CLASSES = 30
# the split name of the rows data.holdout keeps out of data.train_split (recipe.holdout_checks)
HOLDOUT = "holdout"
