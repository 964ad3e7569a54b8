"""Fine-tuning: the paper's transfer protocol on top of the shared trainer.

What differs from pretraining is only where the weights come from: the architecture is taken from the
checkpoint, the pretrained head (and by default the representation layer) is replaced by a zero-initialised
D x K head, and the position embedding is resized once, in 2-D, to the fine-tuning resolution.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import math
from pathlib import Path

import torch

from vitcli import checkpoint, models, weights
from vitcli.dist import Dist
from vitcli.errors import CheckpointError, RecipeError
from vitcli.metrics import console
from vitcli.recipe import Recipe, check

# ModelConfig fields that define the pretrained architecture; img_size, dropout and the head are the
# fine-tuning recipe's own.
ARCH_FIELDS = ("name", "patch_size", "embed_dim", "depth", "num_heads", "mlp_dim", "pool", "pos_embed",
               "representation_size")


@functools.lru_cache(maxsize=2)
def read_init(src: str) -> weights.Loaded:
    """Read starting weights once per process, however many stages ask."""
    return weights.read_checkpoint(src)


def infer_architecture(sd: dict[str, torch.Tensor]) -> dict:
    """ModelConfig fields of a plain ViT from a timm-layout state dict (for timm / Google checkpoints)."""
    if "patch_embed.proj.weight" not in sd or "blocks.0.mlp.fc1.weight" not in sd:
        raise CheckpointError(
            "cannot infer the architecture of this checkpoint (no patch_embed/blocks keys); "
            "set model.name to its architecture (e.g. model.name=ViT-B/16 or a timm name)"
        )
    embed_dim, _, patch, _ = sd["patch_embed.proj.weight"].shape  # (D, C, P, P)
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    arch = {
        "name": "custom",
        "patch_size": int(patch),
        "embed_dim": int(embed_dim),
        "depth": depth,
        "num_heads": max(1, int(embed_dim) // 64),  # every ViT of the paper uses 64-dim heads
        "mlp_dim": int(sd["blocks.0.mlp.fc1.weight"].shape[0]),
        "pool": "token" if "cls_token" in sd else "gap",
        "pos_embed": "learned_1d" if "pos_embed" in sd else "none",
        "representation_size": int(sd["pre_logits.fc.weight"].shape[0]) if "pre_logits.fc.weight" in sd else 0,
    }
    return arch


def adopt_architecture(recipe: Recipe, keep_representation: bool | None = None) -> None:
    """Make recipe.model describe the checkpoint's network, so the fine-tuned model loads its weights."""
    loaded = read_init(recipe.init.checkpoint)
    if keep_representation is None:
        keep_representation = recipe.init.keep_representation
    spec = loaded.meta.get("model") if isinstance(loaded.meta, dict) else None
    if spec:
        arch = {k: spec[k] for k in ARCH_FIELDS if k in spec}
    elif recipe.model.name != "custom":
        return  # the recipe names the architecture (a paper or timm name); trust it
    else:
        arch = infer_architecture(loaded.state_dict)
    for k, v in arch.items():
        setattr(recipe.model, k, v)
    if not keep_representation:
        recipe.model.representation_size = 0  # the paper drops the pre-logits layer for transfer


def native_img_size(loaded: weights.Loaded, patch_size: int) -> int | None:
    """The resolution a checkpoint was trained at: its recipe says, or its square position grid does."""
    spec = loaded.meta.get("model") if isinstance(loaded.meta, dict) else None
    if spec and "img_size" in spec:
        return int(spec["img_size"])
    posemb = loaded.state_dict.get("pos_embed")
    if posemb is None:
        return None
    n = posemb.shape[1] - (1 if "cls_token" in loaded.state_dict else 0)
    side = math.isqrt(n)
    return side * patch_size if side * side == n else None


def load_for_eval(recipe: Recipe) -> torch.nn.Module:
    """The checkpoint's own network at its native resolution, every weight loaded (head and pre-logits kept)."""
    loaded = read_init(recipe.init.checkpoint)
    adopt_architecture(recipe, keep_representation=True)
    models.resolve_model(recipe.model)
    recipe.model.img_size = native_img_size(loaded, recipe.model.patch_size) or recipe.model.img_size
    head = loaded.state_dict.get("head.weight")
    num_classes = int(head.shape[0]) if head is not None else 0
    model = models.build_model(recipe.model, num_classes)
    has_representation = any(k.startswith("pre_logits.") for k in loaded.state_dict)
    sd, _ = weights.adapt_state_dict(
        loaded.state_dict, model, keep_head=True, keep_representation=has_representation,
        method=recipe.init.posemb_method, pos_embed_kind=recipe.model.pos_embed,
    )
    model.load_state_dict(sd, strict=True)
    return model.eval()


def load_init(model: torch.nn.Module, recipe: Recipe, num_classes: int, dist: Dist) -> list[tuple[str, str]]:
    """Load the starting weights into `model` (head zeroed, posemb resized) and show what was done."""
    init = recipe.init
    loaded = read_init(init.checkpoint)
    if not init.keep_head:
        models.zero_head(model, num_classes)
    sd, rows = weights.adapt_state_dict(
        loaded.state_dict, model, keep_head=init.keep_head, keep_representation=init.keep_representation,
        method=init.posemb_method, pos_embed_kind=recipe.model.pos_embed,
    )
    model.load_state_dict(sd, strict=True)
    rows = [("source", f"{init.checkpoint} ({loaded.kind})"), *rows]
    if dist.is_main:
        _print_rows("starting weights", rows)
    return rows


def _print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for what, detail in rows:
        table.add_row(what, detail)
    console.print(table)


def run_finetune(recipe: Recipe, workdir: Path, *, resume: bool | None = None, lr_sweep: str | None = None,
                 task: str | None = None) -> dict:
    """`vit finetune`: one run, an lr sweep picked on the dev split, or the VTAB-1k protocol."""
    from vitcli.stages import run_training

    if not recipe.init.checkpoint:
        console.log("no --init: fine-tuning from random initialisation (a baseline, not transfer)")
    else:
        adopt_architecture(recipe)
    check(recipe)
    if task:
        from vitcli.vtab import run_vtab

        return run_vtab(recipe, workdir, task, resume=resume, lr_sweep=lr_sweep)
    if lr_sweep:
        return sweep(recipe, workdir, parse_lrs(lr_sweep), resume=resume)
    return run_training(recipe, workdir, resume)


def parse_lrs(text: str) -> list[float]:
    """`0.001,0.003` -> [0.001, 0.003], with a one-line error for anything else."""
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RecipeError(f"--lr-sweep: expected comma-separated numbers, got {text!r}") from None
    if not lrs or any(lr <= 0 for lr in lrs):
        raise RecipeError(f"--lr-sweep: expected positive learning rates, got {text!r}")
    return lrs


def sweep(recipe: Recipe, workdir: Path, lrs: list[float], resume: bool | None = None) -> dict:
    """Fine-tune once per learning rate, pick the best on the dev split (data.val_split), report its test top-1."""
    from vitcli.stages import run_training

    if not recipe.data.val_split:
        raise RecipeError("--lr-sweep needs a dev split to choose on: set data.val_split (e.g. train[98%:])")
    rows = []
    for lr in lrs:
        r = copy.deepcopy(recipe)
        r.optim.lr = lr
        results = run_training(r, workdir / f"lr_{lr:g}", resume)
        rows.append({"lr": lr, "dev/top1": results.get("val/top1"), "test/top1": results.get("test/top1")})
    best = max(rows, key=lambda row: row["dev/top1"])
    summary = {"best_lr": best["lr"], "dev/top1": best["dev/top1"], "test/top1": best["test/top1"], "runs": rows}
    checkpoint.write_text(workdir / "sweep.json", json.dumps(summary, indent=2) + "\n")
    with checkpoint.atomic_path(workdir / "sweep.csv") as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["lr", "dev/top1", "test/top1"])
        writer.writeheader()
        writer.writerows(rows)
    _print_sweep(rows, best)
    return summary


def _print_sweep(rows: list[dict], best: dict) -> None:
    from rich.table import Table

    table = Table(title="learning-rate sweep (chosen on dev)")
    for col in ("lr", "dev top-1", "test top-1"):
        table.add_column(col, justify="right")
    for row in rows:
        mark = " *" if row is best else ""
        test = "" if row["test/top1"] is None else f"{row['test/top1']:.4f}"
        table.add_row(f"{row['lr']:g}{mark}", f"{row['dev/top1']:.4f}", test)
    console.print(table)
