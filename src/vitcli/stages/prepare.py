"""`vit prepare-data`: the source and its data.* keys resolved as training resolves them, the copy written by
data.prepare, and what was written (or, with --dry-run, would be) as a table."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from vitcli.data.prepare import Options, prepare
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.metrics import pairs_table, stdout

NAMED = 10  # undecodable images the table names per split; manifest.json names them all


def data_config(source: str, recipe_file: Path | None, overrides: list[str]) -> DataConfig:
    """The data.* section a training run with this source would use: --recipe's, then the dotted overrides
    (data.* keys only: nothing else bears on the copy), data.source set to SOURCE."""
    foreign = [o for o in overrides if not o.startswith("data.")]
    if foreign:
        raise RecipeError(f"{foreign[0]}: prepare-data takes data.* overrides only (e.g. "
                          "data.image_column=img data.synthetic.train_size=1000)")
    # the splits copied are --splits: the recipe's own split keys play no part and are not checked
    roles = {"data.train_split": "", "data.val_split": "", "data.test_split": ""}
    return resolve("pretrain", recipe_file, overrides, {"data.source": source, **roles}, inputs=False).data


def prepare_data(source: str, out: Path, *, recipe_file: Path | None = None, overrides: list[str] = (),
                 splits: str | None = None, options: Options | None = None, overwrite: bool = False,
                 dry_run: bool = False) -> dict:
    """Write (or plan) the pre-resized copy of `source` into `out`; print and return its manifest summary."""
    cfg = data_config(source, recipe_file, list(overrides))
    names = [s.strip() for s in splits.split(",") if s.strip()] if splits else None
    written = prepare(cfg, out, names, options or Options(), overwrite=overwrite, dry_run=dry_run)
    stdout.print(pairs_table("prepare-data (dry run: nothing written)" if dry_run else "prepare-data",
                             _rows(written, out)))
    return written


def _rows(manifest: dict, out: Path) -> list[tuple[str, str]]:
    """The table: where, how, and per split a row (rows, shards, undecodable images) and one more
    for each undecodable image, up to NAMED."""
    how = f"shorter side <= {manifest['max_size']} px, {manifest['format']}"
    if manifest["quality"]:
        how += f" quality {manifest['quality']}"
    rows = [("source", manifest["source"]), ("out", str(out)), ("images", how),
            ("classes", str(len(manifest["label_names"])))]
    for split, entry in manifest["splits"].items():
        shards = f", {len(entry['shards'])} shard(s)" if "shards" in entry else ""
        bad = f", {entry['undecodable']} undecodable (kept as they were)" if entry.get("undecodable") else ""
        rows.append((split, f"{entry['rows']} rows{shards}{bad}"))
        rows += _undecodable(entry.get("undecodable_images", []))
    written = all("shards" in entry for entry in manifest["splits"].values())  # not a dry run's plan
    return rows + ([("read it with", f"data.source={out}")] if written else [])


def _undecodable(names: list[str]) -> list[tuple[str, str]]:
    """Table rows naming a split's undecodable images (sources.image_name), the first NAMED."""
    rows = [("", escape(name)) for name in names[:NAMED]]
    more = len(names) - NAMED
    return rows + ([("", f"and {more} more: manifest.json names them all")] if more > 0 else [])
