"""The objective's keys, checked without torch: which stages and networks a self-supervised
objective (mpp, mae) pretrains and what its own section may say; a teacher's distillation, which
needs a classifier. The one place besides objectives/registry.py that names objectives: a new one
(DINO's) adds its checks here.
"""

from __future__ import annotations

from vitcli.errors import RecipeError
from vitcli.recipe.choices import LABELLED, MPP_CELLS
from vitcli.recipe.names import HYBRID, is_vit_family
from vitcli.recipe.schema import Recipe


def check_objective(recipe: Recipe) -> None:
    """The self-supervised objectives pretrain a ViT of our own; their targets are cut from its
    patches."""
    if recipe.optim.patch_embed_lr_scale != 1 and recipe.objective != "dino":
        raise RecipeError(f"optim.patch_embed_lr_scale={recipe.optim.patch_embed_lr_scale:g} is DINOv2's "
                          "(objective: dino); other objectives train the patch embedding at the lr: "
                          "set it to 1")
    if recipe.objective == "supervised":
        if not recipe.data.label_column and recipe.stage in LABELLED:
            raise RecipeError("data.label_column is empty, but supervised training needs labels; name the "
                              "label column, or pretrain on unlabeled images with objective: mpp or mae")
        return
    m, objective = recipe.model, recipe.objective
    if recipe.stage != "pretrain":
        raise RecipeError(f"objective: {objective} is a pretraining objective; `vit {recipe.stage}` "
                          "trains with labels (objective: supervised)")
    if not is_vit_family(m.name) or m.name == HYBRID:
        raise RecipeError(f"objective: {objective} needs a plain ViT (a paper ViT name or custom), "
                          f"not model.name={m.name}")
    # the wrappers have no layers for timm to number: all would be one
    if recipe.optim.layer_decay != 1 and objective != "dino":
        raise RecipeError(f"optim.layer_decay={recipe.optim.layer_decay} is for supervised training (fine-"
                          f"tuning); objective: {objective} trains every layer at the lr, set it to 1")
    patches = (m.img_size // m.patch_size) ** 2
    {"mpp": _mpp, "mae": _mae, "dino": _dino}[objective](recipe, patches)


def _mpp(recipe: Recipe, patches: int) -> None:
    m, p = recipe.model, recipe.mpp
    if p.target == "color_4x4" and m.patch_size % MPP_CELLS:
        raise RecipeError("mpp.target=color_4x4 pools each patch to 4x4 cells: "
                          f"model.patch_size={m.patch_size} must be a multiple of 4")
    if p.mask_prob + p.random_prob > 1 or not 0 < p.corrupt_ratio <= 1:
        raise RecipeError(f"mpp: corrupt_ratio must be in (0, 1] and mask_prob + random_prob <= 1, got "
                          f"{p.corrupt_ratio}, {p.mask_prob} + {p.random_prob}")
    # models.mpp.corruption corrupts round(ratio * N) per image
    if round(p.corrupt_ratio * patches) < 1:
        raise RecipeError(f"mpp.corrupt_ratio={p.corrupt_ratio} of {patches} patches corrupts none of them; "
                          f"raise it above {0.5 / patches:.3g}")


def _mae(recipe: Recipe, patches: int) -> None:
    """MAE's encoder reads a few patches, its decoder all of them, both with MAE's sin-cos
    tables."""
    m, a = recipe.model, recipe.mae
    keep = int(patches * (1 - a.mask_ratio))  # models.mae.keep_count, MAE's len_keep
    if not 0 < keep < patches:
        raise RecipeError(f"mae.mask_ratio={a.mask_ratio} keeps {keep} of {patches} patches; the encoder "
                          "needs one and the loss one removed, so pick a ratio in between (MAE: 0.75)")
    if m.pool == "gap_fc_norm":  # that network has no final norm: MAE's encoder ends in one
        raise RecipeError("objective: mae pretrains MAE's encoder (a class token and a final norm): set "
                          "model.pool=token (or gap); gap_fc_norm is its fine-tune's pooling")
    if m.pos_embed != "learned_1d":  # the table MAE's own encoders carry, and fine-tuning trains
        raise RecipeError(f"objective: mae fixes the encoder's position table to MAE's 2-D sin-cos and "
                          f"exports it as timm's pos_embed, which fine-tuning trains; model.pos_embed="
                          f"{m.pos_embed} must be learned_1d (the default)")
    for key, width, heads in (("model.embed_dim", m.embed_dim, 0),
                              ("mae.decoder_embed_dim", a.decoder_embed_dim, a.decoder_num_heads)):
        if width % 4 or (heads and width % heads):
            raise RecipeError(f"{key}={width} must be a multiple of 4 (MAE's sin-cos table)"
                              + (f" and of mae.decoder_num_heads={heads}" if heads else ""))


def _dino(recipe: Recipe, patches: int) -> None:
    """DINO's student reads the class token of crops of two sides, with its position table resized
    to each; its teacher is its own EMA."""
    m, d, r = recipe.model, recipe.dino, recipe
    if m.pool != "token" or m.pos_embed not in ("learned_1d", "sincos_2d"):
        raise RecipeError(f"objective: dino reads the class token of a ViT with one position table: set "
                          f"model.pool=token and model.pos_embed=learned_1d (got {m.pool}, {m.pos_embed})")
    if d.local_crops and d.local_crop_size % m.patch_size:
        raise RecipeError(f"dino.local_crop_size={d.local_crop_size} must be a multiple of model.patch_size="
                          f"{m.patch_size} (DINO: 96 of 16)")
    if len(d.blur_sigma) != 2 or not 0 < d.blur_sigma[0] <= d.blur_sigma[1]:
        raise RecipeError(f"dino.blur_sigma={d.blur_sigma} must be [low, high] pixels with 0 < low <= high "
                          "(DINO: [0.1, 2.0])")
    for key in ("global_crop_scale", "local_crop_scale", "ibot_mask_ratio"):
        lo_hi = getattr(d, key)
        top = 1 if key != "ibot_mask_ratio" else 0.999
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] <= top:
            raise RecipeError(f"dino.{key}={lo_hi} must be [low, high] with 0 < low <= high <= {top:g}")
    if len(d.blur_prob) != 3 or not all(0 <= p <= 1 for p in d.blur_prob):
        raise RecipeError(f"dino.blur_prob={d.blur_prob} must be three probabilities: the first global crop, "
                          "the second, each local crop (DINO: [1.0, 0.1, 0.5])")
    ignored = [key for key, on in (("data.randaugment", r.data.randaugment), ("data.three_augment",
               r.data.three_augment), ("data.erasing", r.data.erasing), ("data.color_jitter",
               r.data.color_jitter), ("data.hflip=false", not r.data.hflip)) if on]
    if ignored:  # data.augmentation.multicrop makes every view
        raise RecipeError(f"{ignored[0]}: objective: dino augments its crops as DINO does (the dino "
                          "section: crops, flips, BYOL's colour ops); unset it")
    if d.koleo_weight and r.data.batch_size % d.koleo_group:
        raise RecipeError(f"dino.koleo_group={d.koleo_group} must divide data.batch_size="
                          f"{r.data.batch_size}: KoLeo's neighbours are sought within whole groups")
    if d.clip_grad and r.optim.clip_grad_norm:
        raise RecipeError(f"dino.clip_grad={d.clip_grad:g} clips each parameter's gradient as DINO does, "
                          f"and optim.clip_grad_norm={r.optim.clip_grad_norm:g} the global norm: set one of "
                          "them to 0")
    if r.ema.decay:
        raise RecipeError(f"ema.decay={r.ema.decay}: objective: dino's teacher is already the student's EMA "
                          "(dino.momentum); set ema.decay=0")
    if r.run.strategy != "ddp":
        raise RecipeError(f"run.strategy={r.run.strategy}: objective: dino trains with ddp (its teacher "
                          "follows the student parameter by parameter, not yet over FSDP's shards)")
    epochs = d.freeze_last_layer_epochs or d.warmup_teacher_temp_epochs
    if r.data.streaming and epochs and not r.schedule.epochs:
        raise RecipeError("data.streaming=true has no epoch to count dino.freeze_last_layer_epochs and "
                          "dino.warmup_teacher_temp_epochs by: set schedule.epochs to the epochs "
                          "schedule.steps covers, or set both to 0")


def check_distill(recipe: Recipe) -> None:
    """A teacher and a way to distil from it come together, and they distil a classifier."""
    d = recipe.distill
    if d.type != "none" and not d.teacher:
        raise RecipeError(f"distill.type={d.type} needs a teacher: set distill.teacher to a workdir, a "
                          "weights file or a timm model name")
    if d.teacher and d.type == "none":
        raise RecipeError(f"distill.teacher={d.teacher} is set but distill.type is none; set distill.type "
                          "to hard or soft (DeiT's best: hard), or distill.teacher to ''")
    if d.teacher_model and not d.teacher:
        raise RecipeError(f"distill.teacher_model={d.teacher_model} names the teacher's architecture, but "
                          "distill.teacher (its weights) is empty")
    if d.type != "none" and recipe.objective != "supervised":
        raise RecipeError(f"distill.type={d.type} distils a classifier's logits, but objective: "
                          f"{recipe.objective} has none; set distill.type=none, or objective: supervised")


def check_searchable(recipe: Recipe) -> None:
    """`--search` chooses on val/top1 (stages/search.py): a dev split, and the supervised
    objective's head to score it."""
    if not recipe.data.val_split or recipe.objective != "supervised":
        raise RecipeError("--search chooses on val/top1: it needs data.val_split (a dev split) and "
                          f"objective: supervised (this recipe: objective {recipe.objective!r}, "
                          f"data.val_split {recipe.data.val_split!r})")
