"""`vit predict`: a checkpoint's top-k classes for image files and folders, with class names where
the checkpoint stores them (else timm's ImageNet lemmas for a head of ImageNet-1k's or -21k's
width).

The images go through `vit evaluate`'s own pass (vitcli.stages.evaluate.predictions: the same eval
preprocessing, batching and precision), so a file scores exactly as the same image in a split does.
An image that does not decode is named once, by its path: in a warning as it is skipped, or in the
error when no image decodes; nothing is written.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import datasets
from PIL import Image, UnidentifiedImageError
from rich.markup import escape
from rich.table import Table
from torchvision.datasets.folder import IMG_EXTENSIONS

from vitcli.checkpoints.complete import trained_precision
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.transfer import head_names, load_for_eval, preprocessing_row
from vitcli.data.decoding import bad_images
from vitcli.errors import DataError
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import setup
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.precision import resolved_for
from vitcli.stages.evaluate import predictions


def image_files(paths: list[Path]) -> list[Path]:
    """The files named, and the image files (by extension, torchvision's list) below the folders
    named, sorted per folder; a path that does not exist, or no image at all, is a one-line
    error."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
        elif path.is_file():
            found.append(path)
        else:
            raise DataError(f"{path}: no such file or directory")
    if not found:
        raise DataError(f"no image files ({', '.join(IMG_EXTENSIONS)}) in {', '.join(map(str, paths))}")
    return found


def decodable(files: list[Path]) -> list[Path]:
    """The files PIL decodes. Each other one is named once, with the reason: in a warning as it is
    left out; when none decodes, the first in the error (and the others in warnings before it)."""
    good, bad = [], []
    for path in files:
        why = undecodable(path)
        if why is None:
            good.append(path)
        else:
            bad.append((path, why))
    for path, why in bad if good else bad[1:]:
        console.log(f"[yellow]warning: {escape(str(path))}: cannot decode ({escape(why)}); skipped")
    if not good:
        path, why = bad[0]
        k = len(bad) - 1
        more = f"; {k} other{'s' * (k > 1)} named above" if k else ""
        raise DataError(f"none of the {len(files)} image file(s) decodes ({path}: {why}{more})")
    return good


def undecodable(path: Path) -> str | None:
    """Why PIL cannot decode the file, as training says it (bad_images.one_line); None when it
    decodes. Read from its bytes, so PIL's message does not repeat the path the caller names."""
    try:
        with Image.open(io.BytesIO(path.read_bytes())) as img:
            img.load()
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
        return bad_images.one_line(e)
    return None


def predict(recipe: Recipe, paths: list[Path], top_k: int = 5) -> list[dict]:
    """One record per image that decodes, in file order: {"path", "top": [{"rank", "class_index",
    "class_name", "probability"}, ...]}; rank 0 prints them as a table (the caller may silence
    it)."""
    files = image_files(paths)
    dist = setup(recipe.run.device)  # first: rank 0 alone warns about the files that do not decode
    files = decodable(files)
    recipe, why = resolved_for(recipe, dist.device, trained_precision(recipe.init.checkpoint))
    console.log(f"inference in {recipe.run.precision} ({why})")
    # the files as a split of their own: evaluate's pass reads it as it reads any split (labels are
    # unused)
    data = dataclasses.replace(recipe.data, image_column="image", label_column="label")
    recipe = dataclasses.replace(recipe, data=data)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": [str(p) for p in files], "label": [0] * len(files)}, features)
    ds.info.description = "the images given"
    model = load_for_eval(recipe, recipe.model.num_classes).to(dist.device)
    console.log("{}: {}".format(*preprocessing_row(recipe)))
    k = min(top_k, recipe.model.num_classes)
    rows, top, probs, _, _ = predictions(model, ds, recipe, dist, bad_images.Skipped(), k)
    names, names_from = head_names(read_checkpoint(recipe.init.checkpoint), recipe.model.num_classes)
    records = [{"path": str(files[row]),
                "top": [{"rank": j + 1, "class_index": int(c), "class_name": names[c] if names else str(c),
                         "probability": float(p)} for j, (c, p) in enumerate(zip(top[i], probs[i]))]}
               for i, row in enumerate(rows)]
    if dist.is_main:
        if names_from not in ("", "checkpoint"):
            console.log(f"class names: {names_from} ({recipe.init.checkpoint} stores none)")
        show(records, recipe.optim.loss, names_from)
    return records


def show(records: list[dict], loss: str, names_from: str = "") -> None:
    """A table: each image's path, then its top-k classes with their probabilities; its title says
    where the class names come from when the checkpoint does not store them."""
    names = f"; class names: {names_from}" if names_from not in ("", "checkpoint") else ""
    table = Table(title=f"predictions ({'softmax' if loss == 'softmax' else 'sigmoid'} probabilities{names})")
    for col in ("image", "rank", "class", "probability"):
        table.add_column(col, justify="right" if col in ("rank", "probability") else "left",
                         overflow="fold")  # a long path folds, never cut to `…`
    for record in records:
        for guess in record["top"]:
            first = guess["rank"] == 1
            name = f"{escape(guess['class_name'])} ({guess['class_index']})"
            table.add_row(escape(record["path"]) if first else "", str(guess["rank"]), name,
                          f"{guess['probability']:.4f}", end_section=guess is record["top"][-1])
    stdout.print(table)

