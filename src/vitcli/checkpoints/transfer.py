"""Starting weights into a built model: the paper's transfer protocol for fine-tuning, the body for
evaluation.

The architecture was already taken from the checkpoint when the recipe was resolved
(vitcli.recipe.resolve), so the model built from the recipe is the checkpoint's network. Here the
pretrained head (and by default the representation layer) is replaced by a zero-initialised D x K
head and the position embedding is resized once, in 2-D, to the model's grid; a table says what was
loaded, dropped and resized, and how images are fed.
"""

from __future__ import annotations

import torch

from vitcli.checkpoints import preprocessing
from vitcli.checkpoints.describe import CheckpointSpec, describe
from vitcli.checkpoints.fit import adapt_state_dict, with_grid
from vitcli.checkpoints.read import Loaded, read_checkpoint
from vitcli.data.rows import imagenet
from vitcli.models import layer_decay, zoo
from vitcli.recipe.names import PAPER_VITS, paper_size, size_origin
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist
from vitcli.runtime.metrics import console, pairs_table


def _spec(loaded: Loaded, recipe: Recipe) -> CheckpointSpec:
    """The checkpoint's spec, its heads labelled by their evidence (Table 1, kernels) when the
    recipe's agree, and its position table's grid known."""
    spec = describe(loaded)
    spec = spec if spec.num_heads == recipe.model.num_heads else describe(loaded, recipe.model.num_heads)
    # a 1-D table's grid, init.grid if given
    return with_grid(spec, loaded.state_dict, recipe.init.grid)


def load_init(model: torch.nn.Module, recipe: Recipe, num_classes: int, dist: Dist) -> list[tuple[str, str]]:
    """Load the starting weights into `model` (head zeroed, posemb resized); rank 0 shows what was
    done."""
    init = recipe.init
    loaded = read_checkpoint(init.checkpoint)
    spec = _spec(loaded, recipe)
    if not init.keep_head:
        zoo.zero_head(model, num_classes)
    sd, rows = adapt_state_dict(loaded.state_dict, model, spec, keep_head=init.keep_head,
                                keep_representation=init.keep_representation, method=init.posemb_method)
    model.load_state_dict(sd, strict=True)
    # a ViT read off the file
    arch = [("architecture", architecture_row(spec))] if spec.name else []
    # MAE's decoder, say
    dropped = [("dropped", "; ".join(loaded.dropped))] if loaded.dropped else []
    rows = [("source", f"{init.checkpoint} ({loaded.kind})"), *dropped, *arch, *read_rows(loaded), *rows,
            preprocessing_row(recipe, preprocessing.FEED), *lr_rows(model, recipe)]
    if dist.is_main:
        console.print(pairs_table("starting weights", rows))
    return rows


def read_rows(loaded: Loaded) -> list[tuple[str, str]]:
    """What reading a transformers folder decided (its config, a pooler kept or dropped); [] for
    others."""
    return [tuple(row) for row in loaded.meta.get("notes", [])] if loaded.kind == "hf" else []


def preprocessing_row(recipe: Recipe, keys: tuple[str, ...] = preprocessing.KEYS) -> tuple[str, str]:
    """("preprocessing", the `keys` of it the run feeds the starting weights, and where each came
    from)."""
    said = preprocessing.said_by(read_checkpoint(recipe.init.checkpoint), recipe.model.name)
    return "preprocessing", preprocessing.row(recipe.data, said, keys)


def lr_rows(model: torch.nn.Module, recipe: Recipe) -> list[tuple[str, str]]:
    """The row that says how optim.layer_decay spreads the lr over the layers; none when it is
    off."""
    decay = recipe.optim.layer_decay
    return [("layer decay", layer_decay.describe(model, decay))] if decay != 1 else []


def load_for_eval(recipe: Recipe, num_classes: int = 0) -> torch.nn.Module:
    """The checkpoint's network up to its pre-logits, at the resolved resolution, in eval mode; with
    `num_classes` (the width of the checkpoint's head) its classifier too (vit evaluate, predict,
    export); with init.random, the same network as the model's own initialiser draws it from
    run.seed (nothing is loaded)."""
    if recipe.init.random:
        with torch.random.fork_rng():  # the caller's RNG stream is left as it was
            torch.manual_seed(recipe.run.seed)
            return zoo.build_model(recipe.model, 0).eval()
    loaded = read_checkpoint(recipe.init.checkpoint)
    for what, said in read_rows(loaded):
        console.log(f"{recipe.init.checkpoint}: {what}: {said}")
    model = zoo.build_model(recipe.model, num_classes)
    sd, _ = adapt_state_dict(loaded.state_dict, model, _spec(loaded, recipe), keep_head=num_classes > 0,
                             keep_representation=recipe.model.representation_size > 0,
                             method=recipe.init.posemb_method)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def class_names(loaded: Loaded, num_classes: int) -> list[str] | None:
    """The names our checkpoint stores for its head's `num_classes` classes (metadata
    model.class_names), a transformers folder's id2label or a timm folder's label_names; None for
    other foreign files, headless runs, files written before names were stored, or names of another
    count."""
    model = loaded.meta.get("model") if loaded.kind == "vitcli" else loaded.meta
    names = model.get("class_names") if isinstance(model, dict) else None
    fits = isinstance(names, list) and len(names) == num_classes
    return [str(name) for name in names] if fits else None


def scored_weights(loaded: Loaded) -> str | None:
    """Which weights our model.safetensors holds, as its metadata says (ema.save: "live" or "ema"; a
    file from before the EMA existed holds the live ones); None for a foreign file, which does not
    say."""
    return loaded.meta.get("weights", "live") if loaded.kind == "vitcli" else None


def head_names(loaded: Loaded, num_classes: int) -> tuple[list[str] | None, str]:
    """(the head's class names, where they come from): the checkpoint's own ("checkpoint"); else,
    for a file that stores none (Google's .npz, timm weights) with a head of ImageNet's width,
    timm's WordNet lemmas ("timm imagenet-1k lemmas"); else (None, "")."""
    own = class_names(loaded, num_classes)
    if own is not None:
        return own, "checkpoint"
    found = imagenet.head_names(num_classes)
    return (found[0], f"timm {found[1]} lemmas") if found else (None, "")


def architecture_row(spec: CheckpointSpec) -> str:
    """`ViT-Ti/16 (DeiT-Ti / AugReg Ti), grid 14x14` for a paper or DeiT/AugReg size, else
    `custom patch 16, width 96, depth 4, 3 heads (metadata), grid 14x14`."""
    grid = f", grid {spec.grid[0]}x{spec.grid[1]}" if spec.grid else ""
    if spec.layer_norm_eps != 1e-6:  # timm's; transformers' configs say 1e-12
        grid += f", LayerNorm eps {spec.layer_norm_eps:g}"
    size = paper_size(spec.patch_size, spec.embed_dim, spec.depth, spec.num_heads, spec.mlp_dim)
    # not a hybrid or T2T of the same widths
    if size and (spec.name == "custom" or spec.name in PAPER_VITS):
        return f"{size} ({size_origin(size)}){grid}"
    return (f"{spec.name} patch {spec.patch_size}, width {spec.embed_dim}, depth {spec.depth}, "
            f"{spec.num_heads} heads ({spec.heads_from}){grid}")
