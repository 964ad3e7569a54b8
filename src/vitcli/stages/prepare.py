"""`vit prepare-data`: the copy data.prepare writes of the source the recipe's data section names
(the command resolves it as training resolves it, stage `prepare-data`), and what was written (or,
with --dry-run, would be) as a table."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from vitcli.data.rows.prepare import Options, prepare
from vitcli.recipe.schema import Recipe
from vitcli.runtime.metrics import pairs_table, stdout

NAMED = 10  # undecodable images the table names per split; manifest.json names them all


def prepare_data(recipe: Recipe, out: Path, *, splits: str | None = None,
                 options: Options | None = None, overwrite: bool = False,
                 dry_run: bool = False) -> dict:
    """Write (or plan) the pre-resized copy of recipe.data.source into `out`: the comma-separated
    `splits`, else every split (the recipe's split keys play no part); print and return its manifest
    summary."""
    names = [s.strip() for s in splits.split(",") if s.strip()] if splits else None
    written = prepare(recipe.data, out, names, options or Options(), overwrite=overwrite,
                      dry_run=dry_run)
    stdout.print(pairs_table("prepare-data (dry run: nothing written)" if dry_run else "prepare-data",
                             _rows(written, out)))
    return written


def _rows(manifest: dict, out: Path) -> list[tuple[str, str]]:
    """The table: where, how, and per split a row (rows, shards, undecodable images) and one more
    for each undecodable image, up to NAMED."""
    how = f"shorter side <= {manifest['max_size']} px, {manifest['format']}"
    if manifest["quality"]:
        how += f" quality {manifest['quality']}"
    how += f", {manifest['shards']} shards"
    # tar: rows in a seeded shuffled order (prepare.shard_order)
    if manifest.get("shuffle_seed") is not None:
        how += f" (rows shuffled, seed {manifest['shuffle_seed']})"
    rows = [("source", manifest["source"]), ("out", str(out)), ("images", how),
            ("classes", str(len(manifest["label_names"])))]
    for split, entry in manifest["splits"].items():
        shards = f", {len(entry['shards'])} shard(s)" if "shards" in entry else ""
        bad = f", {entry['undecodable']} undecodable (kept as they were)" if entry.get("undecodable") else ""
        rows.append((split, f"{entry['rows']} rows{shards}{bad}"))
        rows += _undecodable(entry.get("undecodable_images", []))
    # not a dry run's plan
    written = all("shards" in entry for entry in manifest["splits"].values())
    return rows + ([("read it with", f"data.source={out}")] if written else [])


def _undecodable(names: list[str]) -> list[tuple[str, str]]:
    """Table rows naming a split's undecodable images (bad_images.image_name), the first NAMED."""
    rows = [("", escape(name)) for name in names[:NAMED]]
    more = len(names) - NAMED
    return rows + ([("", f"and {more} more: manifest.json names them all")] if more > 0 else [])
