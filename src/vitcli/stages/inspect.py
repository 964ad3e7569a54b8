"""`vit inspect`: the paper's Figure 7 for any ViT checkpoint we read, from a few real images.

The recipe the command resolved (stage `inspect`) holds the checkpoint's own architecture at its
native resolution, headless, so whatever vit reads (our workdirs, timm files, Google .npz, Hub
names) can be inspected; a checkpoint without attention blocks is refused there
(checkpoints.complete). A figure that does not apply to the network (the hybrid and T2T-ViT have no
pixel patch filters; a model without a position table has no similarities) is skipped with the
reason.

An MAE run (objective: mae) also gets MAE's Figure 2 (figures.figure2): its model.safetensors holds
the encoder only, so the encoder and decoder are read together from the run's newest training state
(state-<step>.pt, weights_only), and a few images of the run's own held-out split are masked,
reconstructed and drawn. An MAE encoder whose decoder is not at hand (a lone model.safetensors,
MAE's .pth) is inspected as any ViT and the figure skipped with the reason.

A DINO run (objective: dino in its model.safetensors' recipe, which holds the teacher's backbone)
also gets DINO's Figure 1 (figures.attention): the class token's last-layer attention per head on a
few images of the run's own held-out split. Other networks do not: see docs/inspect.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vitcli.checkpoints.export_hf import is_mae_encoder
from vitcli.checkpoints.manager import latest_good_state
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.transfer import load_for_eval
from vitcli.data.batching import batches
from vitcli.data.rows import sources
from vitcli.errors import CheckpointError, DataError, ModelError, RecipeError
from vitcli.figures import attention, figure2, figure7
from vitcli.figures.attention import attention_probabilities
from vitcli.models import mae, zoo
from vitcli.models.mae import MaeModel
from vitcli.models.t2t import TokensToToken
from vitcli.recipe.layers import merge
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import pick_device
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console, pairs_table, stdout
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.runtime.workdir import check_workdir

FILTERS, POSITIONS, DISTANCES = "embedding_filters.png", "position_similarity.png", "attention_distance.png"
DISTANCES_JSON = "attention_distance.json"
RECONSTRUCTION = "mae_reconstruction.png"
RECONSTRUCTED = 4  # images in MAE's Figure 2: the first of the run's held-out split
ATTENTION = "dino_attention.png"
ATTENDED = 4  # images in DINO's Figure 1: the first of the run's held-out split
BATCH = 32  # images per forward pass: attention maps of every layer are reduced as they come


@dataclass
class Report:
    """What `vit inspect` found and wrote; `as_dict` is what the stage returns (--json prints
    it)."""

    summary: dict
    written: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # figure file -> why it does not apply
    explained_variance: list[float] = field(default_factory=list)  # of the filter components shown
    attention: dict = field(default_factory=dict)  # attention_distance.json's content
    # what MAE's Figure 2 shows; {} when not drawn
    reconstruction: dict = field(default_factory=dict)
    # what DINO's Figure 1 shows; {} when not drawn
    cls_attention: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The report as JSON-able numbers and paths."""
        return {"model": self.summary, "written": self.written, "skipped": self.skipped,
                "filter_explained_variance": self.explained_variance, "attention_distance": self.attention,
                "mae_reconstruction": self.reconstruction, "dino_attention": self.cls_attention}


def inspect(recipe: Recipe, out: Path, split: str = "test", images: int = 128) -> dict:
    """Write Figure 7's three panels of recipe.init.checkpoint (and the distances as JSON) into
    `out`, the distances measured on `images` images of recipe.data.source's `split`; print a
    summary; return it all."""
    if images < 1:
        raise DataError(f"--images {images}: need at least one image to measure attention distances")
    check_workdir(out)
    model = load_for_eval(recipe)
    report = Report(_summary(recipe, model))
    out.mkdir(parents=True, exist_ok=True)
    _filters(model, recipe, out, report)
    _positions(model, recipe, out, report)
    _distances(model, recipe, split, images, out, report)
    _reconstruction(recipe, out, report)
    _cls_attention(model, recipe, out, report)
    _print(report)
    return report.as_dict()


def _summary(recipe: Recipe, model: nn.Module) -> dict:
    """The rows of the summary table: which network, at which resolution, with which tables."""
    m, grid = recipe.model, tuple(model.patch_embed.grid_size)
    return {"checkpoint": recipe.init.checkpoint, "model": m.name, "parameters": zoo.count_params(model),
            "width": m.embed_dim, "depth": len(model.blocks), "heads": m.num_heads, "grid": list(grid),
            "patch_size": m.img_size // grid[0], "pool": m.pool, "pos_embed": m.pos_embed,
            "img_size": m.img_size}


# ---------------------------------------------------------------- the three panels


def _skip(report: Report, name: str, why: str) -> None:
    report.skipped[name] = why
    console.log(f"[yellow]skipped {name}: {why}")


def _filters(model: nn.Module, recipe: Recipe, out: Path, report: Report) -> None:
    """Figure 7 left, when the patch embedding is a convolution over RGB pixels."""
    kernel, why = pixel_filters(model)
    if kernel is None:
        return _skip(report, FILTERS, why)
    components, explained = figure7.filter_components(kernel)
    title = f"{recipe.model.name}: top {len(components)} principal components of the patch filters"
    figure7.save_figure(figure7.filters_figure(components, explained, title), out / FILTERS)
    report.explained_variance = [float(v) for v in explained]
    report.written.append(str(out / FILTERS))


def pixel_filters(model: nn.Module) -> tuple[np.ndarray | None, str]:
    """(patch filters (D, 3, P, P), "") or (None, why the model has none)."""
    embed = model.patch_embed
    if isinstance(embed, TokensToToken):
        return None, ("T2T-ViT embeds pixels through overlapping soft splits and token mixing, not linear "
                      "patch filters")
    proj = getattr(embed, "proj", None)
    if isinstance(proj, nn.Conv2d) and proj.in_channels == 3:
        return proj.weight.detach().float().cpu().numpy(), ""
    if isinstance(proj, nn.Conv2d):
        return None, (f"the patch embedding projects {proj.in_channels}-channel features "
                      "(the hybrid's ResNet map), not RGB pixels: there are no pixel patch filters")
    return None, f"the patch embedding ({type(embed).__name__}) has no convolution over pixels"


def _positions(model: nn.Module, recipe: Recipe, out: Path, report: Report) -> None:
    """Figure 7 centre, for any learned or fixed position table."""
    grid = tuple(model.patch_embed.grid_size)
    table = position_table(model, grid)
    if table is None:
        return _skip(report, POSITIONS, "the model has no position table "
                     f"(pos_embed: {recipe.model.pos_embed})")
    maps = figure7.cosine_maps(table, grid)
    title = f"{recipe.model.name}: position embedding similarity ({recipe.model.pos_embed})"
    figure7.save_figure(figure7.position_figure(maps, title), out / POSITIONS)
    report.written.append(str(out / POSITIONS))


def position_table(model: nn.Module, grid: tuple[int, int]) -> np.ndarray | None:
    """Each patch's position embedding (H*W, D) as the model adds it; None when it adds none."""
    if getattr(model, "pos_embed_row", None) is not None:
        table = model.learned_2d_table()  # (1, H*W, D): the App. D.4 pair as the model adds it
    else:
        table = getattr(model, "pos_embed", None)  # (1, prefix + H*W, D), or None
    if table is None:
        return None
    return figure7.patch_table(grid, table.detach().float().cpu().numpy()[0])


def _distances(model: nn.Module, recipe: Recipe, split: str, images: int, out: Path, report: Report) -> None:
    """Figure 7 right and its numbers, from `images` images of the data source."""
    grid, img_size = tuple(model.patch_embed.grid_size), recipe.model.img_size
    ds = sources.load_split(recipe.data, split)
    ds = ds.select(range(min(images, len(ds))))
    cell = img_size / grid[1]  # pixels between patch centres (the hybrid's: its ResNet stride)
    per_head, seen = mean_attention_distances(model, _stream(ds, recipe), grid, cell,
                                              pick_device(recipe.run.device))
    title = f"{recipe.model.name}: attention distance ({seen} images)"
    uniform = figure7.uniform_distance(figure7.patch_distances(grid, cell))
    figure7.save_figure(figure7.distance_figure(per_head, img_size, title, uniform), out / DISTANCES)
    report.attention = {
        "checkpoint": recipe.init.checkpoint, "data": sources.origin(ds), "images": seen,
        "img_size": img_size, "grid": list(grid), "pixels_between_patches": cell,
        "definition": "per head: mean over images and query patches of the sum over key patches of attention "
                      "x pixel distance between patch centres; class/prefix tokens dropped, "
                      "weights renormalised",
        "mean_distance_px": per_head.tolist(),  # [layer][head]
        "uniform_attention_px": uniform,  # what a head attending to every patch alike would give
    }
    write_text(out / DISTANCES_JSON, json.dumps(report.attention, indent=2) + "\n")
    report.written += [str(out / DISTANCES), str(out / DISTANCES_JSON)]


def _stream(ds, recipe: Recipe) -> batches.BatchStream:
    return batches.eval_batches(ds, recipe.data, recipe.model.img_size,
                                min(BATCH, recipe.data.eval_batch_size))


def mean_attention_distances(model: nn.Module, stream, grid: tuple[int, int], cell: float,
                             device: torch.device) -> tuple[np.ndarray, int]:
    """((layers, heads) mean attention distance in pixels over every image of `stream`, images
    seen)."""
    model = model.to(device).eval()
    distances = figure7.patch_distances(grid, cell).to(device)  # (N, N)
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    sums: dict[int, torch.Tensor] = {}

    # (B, heads, T, T) -> summed over the batch (heads,)
    def add(layer: int, probs: torch.Tensor) -> None:
        total = figure7.attention_distance(probs, distances, prefix).sum(dim=0)
        sums[layer] = sums[layer] + total if layer in sums else total

    seen = 0
    with attention_probabilities(model.blocks, add), torch.inference_mode():
        for x, _ in stream:
            model(x.to(device))
            seen += len(x)
    return torch.stack([sums[i] for i in sorted(sums)]).cpu().numpy() / max(seen, 1), seen


# ---------------------------------------------------------------- MAE's Figure 2


@dataclass
class MaeRun:
    """An MAE run's encoder and decoder as its training state holds them."""

    recipe: Recipe  # the run's own, as it trained
    model: MaeModel
    step: int
    path: Path  # the state-<step>.pt read


def mae_run(checkpoint: str) -> tuple[MaeRun | None, str]:
    """(the MAE run behind `checkpoint`, ""); (None, why not) for an MAE encoder whose decoder is
    not at hand; (None, "") for any other network."""
    if not checkpoint or not is_mae_encoder(read_checkpoint(checkpoint), 0):  # "": init.random
        return None, ""
    path = Path(checkpoint)
    workdir = path if path.is_dir() else path.parent if path.name == MODEL_FILE else None
    if workdir is None:
        return None, (f"{checkpoint} holds MAE's encoder only; the decoder is in an MAE run's training state "
                      "(state-<step>.pt): give inspect the run's workdir")
    try:
        found = latest_good_state(workdir, verbose=False)
    except CheckpointError as e:
        return None, str(e)
    if found is None or found[0].is_dir():
        sharded = " (a sharded run's state-<step>/ is not read here)" if found else ""
        return None, (f"{workdir} holds no whole training state (state-<step>.pt), where an MAE run "
                      f"keeps its decoder{sharded}")
    return _mae_model(*found)


def _mae_model(path: Path, saved: dict) -> tuple[MaeRun | None, str]:
    """The encoder and decoder of the training state `saved` (read from `path`), in eval mode."""
    recipe, why = _saved_recipe(saved["recipe"], path)
    if recipe is None:
        return None, why
    if not any(k.startswith("decoder.") for k in saved["model"]):  # only MAE's holds a decoder
        return None, f"{path} holds no MAE decoder (objective: {recipe.objective})"
    with torch.random.fork_rng():  # draws overwritten by the state; the caller's RNG untouched
        model = MaeModel(zoo.build_model(recipe.model, 0), recipe.mae, recipe.model.patch_size, fresh=False)
    model.load_state_dict(saved["model"])
    return MaeRun(recipe, model.eval(), int(saved["step"]), path), ""


def reconstruct(run: MaeRun, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor, str]:
    """(images (B, 3, H, W) as fed, pred (B, N, P*P*3), mask (B, N), split) for the first `count`
    images of the run's validation split (else its test split), each masked by mae.mask_noise of
    (run.seed, its index): the same masks on every call."""
    r = run.recipe
    split = r.data.val_split or r.data.test_split
    x = held_out(r.data, split, r.model.img_size, count).to(device)
    grid = tuple(run.model.backbone.patch_embed.grid_size)
    noise = mae.mask_noise(r.run.seed, torch.arange(len(x)), grid[0] * grid[1])  # (B, N)
    with torch.inference_mode():
        pred, _, mask = run.model.to(device)(x, noise)
    return x.cpu(), pred.cpu(), mask.cpu(), split


def held_out(data, split: str, img_size: int, count: int) -> torch.Tensor:
    """The first `count` images of `split` as evaluation feeds them (B, 3, S, S): a run's own
    held-out images, for MAE's and DINO's figures; an empty split is a DataError."""
    ds = sources.load_split(data, split)
    if not len(ds):
        raise DataError(f"the run's {split} split is empty")
    ds = ds.select(range(min(count, len(ds))))
    return torch.cat([x for x, _ in batches.eval_batches(ds, data, img_size, count)])


def _reconstruction(recipe: Recipe, out: Path, report: Report) -> None:
    """MAE's Figure 2, for an MAE run whose training state holds the decoder."""
    run, why = mae_run(recipe.init.checkpoint)
    if run is None:
        return _skip(report, RECONSTRUCTION, why) if why else None
    r = run.recipe
    try:
        images, pred, mask, split = reconstruct(run, RECONSTRUCTED, pick_device(recipe.run.device))
    except DataError as e:
        return _skip(report, RECONSTRUCTION, f"the run's images cannot be read ({e})")
    tiles = figure2.panels(images, pred, mask, r.model.patch_size, r.mae.norm_pix_loss, r.data.mean,
                           r.data.std)
    n, kept = mask.shape[1], run.model.keep
    grey = figure2.is_grey(images, r.data.mean, r.data.std)
    title = (f"{r.model.name}, MAE at step {run.step}: mask ratio {r.mae.mask_ratio:g} "
             f"({n - kept} of {n} patches removed), {split} images\n"
             + figure2.caption(r.mae.norm_pix_loss, grey))
    figure7.save_figure(figure2.reconstruction_figure(tiles, title), out / RECONSTRUCTION)
    report.reconstruction = {"state": str(run.path), "step": run.step, "mask_ratio": r.mae.mask_ratio,
                             "removed_patches": n - kept, "patches": n, "data": r.data.source, "split": split,
                             "images": len(images), "norm_pix_loss": r.mae.norm_pix_loss,
                             "grey": grey}
    report.written.append(str(out / RECONSTRUCTION))


# ---------------------------------------------------------------- DINO's Figure 1


def dino_run(checkpoint: str) -> tuple[Recipe | None, str]:
    """(the recipe of the DINO run that wrote `checkpoint`, ""); (None, why) when it does not read
    today; (None, "") for any other network."""
    # "": init.random
    saved = read_checkpoint(checkpoint).meta.get("recipe") if checkpoint else None
    if not isinstance(saved, dict) or saved.get("objective") != "dino":
        return None, ""
    return _saved_recipe(saved, checkpoint)


def _saved_recipe(saved: dict, where) -> tuple[Recipe | None, str]:
    """(the recipe a run saved, ""), or (None, why) when it does not read today."""
    recipe = Recipe(stage="pretrain")
    try:
        merge(recipe, saved)
    except RecipeError as e:
        return None, f"{where}: its recipe does not read today ({e})"
    return recipe, ""


def _cls_attention(model: nn.Module, recipe: Recipe, out: Path, report: Report) -> None:
    """DINO's Figure 1, for a DINO run's teacher, on the first images of the run's validation split
    (else its test split)."""
    run, why = dino_run(recipe.init.checkpoint)
    if run is None:
        return _skip(report, ATTENTION, why) if why else None
    if getattr(model, "cls_token", None) is None:
        return _skip(report, ATTENTION, f"the model has no class token (pool: {recipe.model.pool})")
    data = dataclasses.replace(run.data, label_column="")  # DINO's images need no labels
    split = data.val_split or data.test_split
    if not split:
        return _skip(report, ATTENTION, "the run has no held-out split (data.val_split and "
                     "data.test_split are both empty)")
    try:
        x = held_out(data, split, recipe.model.img_size, ATTENDED)
    except DataError as e:
        return _skip(report, ATTENTION, f"the run's images cannot be read ({e})")
    device = pick_device(recipe.run.device)
    with torch.inference_mode():
        try:  # (B, heads, grid_h, grid_w)
            maps = attention.cls_attention(model.to(device).eval(), x.to(device)).float().cpu()
        except ModelError as e:
            return _skip(report, ATTENTION, str(e))
    title = (f"{recipe.model.name}, DINO teacher: the class token's last-layer attention, "
             f"{split} images\n"
             "each map on its own min-max scale (its peak weight above it)\n"
             f"2nd column: the image dimmed outside {attention.MASS:.0%} of the mean map's mass")
    images = attention.pixels(x, data.mean, data.std)
    figure7.save_figure(attention.attention_figure(images, maps.numpy(), title), out / ATTENTION)
    report.cls_attention = {"data": data.source, "split": split, "images": len(x),
                            "heads": maps.shape[1], "grid": list(maps.shape[2:]),
                            "mass": attention.MASS}
    report.written.append(str(out / ATTENTION))


# ---------------------------------------------------------------- output


def _print(report: Report) -> None:
    """The summary table and the files written."""
    s = report.summary
    rows = [("checkpoint", s["checkpoint"]), ("model", s["model"]), ("parameters", f"{s['parameters']:,}"),
            ("width / depth / heads", f"{s['width']} / {s['depth']} / {s['heads']}"),
            ("grid", f"{s['grid'][0]}x{s['grid'][1]}"), ("patch size", f"{s['patch_size']} px"),
            ("pooling", s["pool"]), ("position embedding", s["pos_embed"]),
            ("image size", f"{s['img_size']} px")]
    stdout.print(pairs_table("vit inspect", [(what, str(detail)) for what, detail in rows]))
    for path in report.written:
        stdout.print(f"wrote {path}", highlight=False)
