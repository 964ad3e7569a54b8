"""Output locations, checked before anything is written, and a finished run's files kept, never
deleted.

A run validates its whole input first; only then does it touch the workdir. A fresh run into a
workdir that holds a finished model needs `--overwrite`, and even then the old files are moved to
`previous-<time>/` beside the new ones (a user's finished work is sacred), only once the new run has
started cleanly.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vitcli.errors import OutputError, RecipeError
from vitcli.runtime.files import atomic_dir
from vitcli.runtime.metrics import console
from vitcli.runtime.run_dir import finished, newest_step
from vitcli.runtime.run_files import MODEL_FILE, RECIPE_FILE, RUN_OUTPUTS


def existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent (where it would be created)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_workdir(workdir: Path) -> None:
    """A directory, or a path where one can be made, that this user may write to."""
    if workdir.exists() and not workdir.is_dir():
        raise OutputError(f"workdir {workdir} is a file, not a directory; pass another --workdir")
    check_writable(workdir, "workdir")


def check_writable(path: Path, what: str) -> None:
    """An OutputError naming `what` when the directory that would hold `path` cannot be written."""
    where = existing_ancestor(path)
    if where.is_file():
        raise OutputError(f"{what} {path}: {where} is a file, so nothing can be created below it")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: {where} is not writable by this user; pick another location")


def check_output_file(path: Path, what: str, overwrite: bool | None = None) -> None:
    """An output file: not an existing directory, and creatable; with `overwrite` False, not an
    existing file either (None: an existing file may be replaced, as before this flag existed)."""
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; name a file")
    if overwrite is False and path.exists():
        raise OutputError(f"{what} {path} exists; name a new file, or pass --overwrite (the old one "
                          f"is then kept beside it as {path.name}.previous-<time>)")
    check_writable(path.parent, what)


@contextlib.contextmanager
def kept_file(path: Path) -> Iterator[None]:
    """Around the block that replaces the file `path` (atomically, by rename): the old one stays
    beside it as `<name>.previous-<time>` (a hard link to it, else a copy), said so once the block
    succeeds; a failure or Ctrl-C leaves `path` as it was and keeps no copy."""
    if not path.is_file():
        yield
        return
    aside = _unused(path.parent, f"{path.name}.previous")
    try:
        os.link(path, aside)
    except OSError:  # a file system without hard links
        shutil.copy2(path, aside)
    try:
        yield
    except BaseException:
        aside.unlink(missing_ok=True)
        raise
    console.log(f"the previous {path.name} is kept as {aside}")


def refuse_finished(workdir: Path, overwrite: bool) -> None:
    """A fresh run must not replace a finished one (run_dir.finished) by accident (a typo after
    `--no-resume`, say)."""
    if not overwrite and finished(workdir) is not None:
        raise OutputError(
            f"{workdir} holds a finished run; use a new --workdir, or pass --overwrite "
            "to start over there (its files are then kept in previous-<time>/ inside it)"
        )


def refuse_single_run(workdir: Path) -> None:
    """A sweep's workdir holds its points' runs, each in WORKDIR/<point>: one that holds a single
    run (its recipe.yaml, checkpoints or model at the top, finished or not) is refused before any
    point trains, rather than the points filling it around that run (--overwrite included: it starts
    each point over)."""
    held = [name for name in (RECIPE_FILE, MODEL_FILE) if (workdir / name).is_file()]
    held += ["state-<step> checkpoints"] * bool(newest_step(workdir))
    if held:
        what = "a finished single run" if finished(workdir) is not None else "a single run"
        raise OutputError(f"{workdir} holds {what} ({', '.join(held)}), not a sweep: a sweep puts "
                          "each point in WORKDIR/<point>; pass a new --workdir")


def refuse_other_run(workdir: Path, stage: str) -> None:
    """A stage that writes its results into a workdir (recipe.yaml, results.json) refuses one that
    holds another stage's run: its recipe.yaml would be replaced, its model left beside results it
    did not make. A workdir of the same stage is its own: whether it runs again there is
    vitcli.runtime.finished's call."""
    recipe = workdir / RECIPE_FILE
    said = _stage_line(recipe) if recipe.is_file() else stage
    if (workdir / MODEL_FILE).is_file() or said != stage:
        what = f"a {said} run" if said != stage else f"a training run ({MODEL_FILE})"
        raise OutputError(f"{workdir} holds {what}; `vit {stage}` writes its results to a workdir of its "
                          "own: pass another --workdir")


def _stage_line(recipe: Path) -> str:
    """The `stage:` a recipe.yaml says (a top-level line, as to_yaml writes it); "another" if
    none."""
    for line in recipe.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("stage:"):
            return line.partition(":")[2].strip() or "another"
    return "another"


def set_aside(workdir: Path, also: Iterable[Path] = (), outputs: bool = True,
              why: str = "the previous run's files") -> Path | None:
    """Move a previous run's outputs (RUN_OUTPUTS, unless not `outputs`, and the paths `also` names:
    its checkpoints) into WORKDIR/previous-<time>/ and say so, `why` first; None when there were
    none."""
    found = [workdir / name for name in RUN_OUTPUTS if outputs and (workdir / name).exists()] + list(also)
    if not found:
        return None
    kept = _unused(workdir, "previous")
    kept.mkdir()
    for path in found:
        path.rename(kept / path.name)
    console.log(f"{why} are kept in {kept}")
    return kept


def _unused(parent: Path, name: str) -> Path:
    """parent/<name>-<time>, with -1, -2... added while taken: where earlier outputs are kept."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return next(p for n in itertools.count()
                if not (p := parent / f"{name}-{stamp}{f'-{n}' if n else ''}").exists())


def check_out_dir(out: Path, overwrite: bool) -> None:
    """An --out folder (`vit prepare-data`, `vit export`): one to create, an empty one, or with
    --overwrite a full one, to be set aside by `published_dir`; never a file."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file; name a directory (created if needed)")
    check_writable(out, "--out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"--out {out} is not empty; name a new directory, or pass --overwrite (the old one "
                          f"is then kept beside it as {out.name}.previous-<time>)")


def check_apart(source: str, out: Path, flag: str = "--ckpt") -> None:
    """--out neither the folder `source` is read from nor inside it, nor holding it (symlinks and
    relative paths resolved): publishing --out with --overwrite would set a training workdir aside
    and put the export in its place, or nest the export inside the run it came from. A source that
    is not a local path (a hub name) is no folder of the user's."""
    src = Path(source)
    if not src.exists():
        return
    src, where = src.resolve(), out.resolve()
    if not (where.is_relative_to(src) or src.is_relative_to(where)):
        return
    how = ("is the folder" if where == src else "is inside the folder" if where.is_relative_to(src)
           else "holds the path")
    # the one the other is in
    outer = Path(os.path.normpath(source if where.is_relative_to(src) else out))
    outer = outer if outer.name else outer.resolve()  # `.` has no name to build on
    raise OutputError(f"--out {out} {how} {flag} {source}: name an --out folder apart from it, "
                      f"e.g. {outer.parent / (outer.name + '-export')}")


@dataclass
class Published:
    """The folder `published_dir` fills (`tmp`), and where the old --out went (`aside`; None:
    nothing)."""

    tmp: Path
    aside: Path | None = None


@contextlib.contextmanager
def published_dir(out: Path) -> Iterator[Published]:
    """A temporary folder beside `out` to fill; when the block succeeds it is sealed and renamed
    onto `out` (runtime.files.atomic_dir), a non-empty `out` first renamed to
    `<name>.previous-<time>` beside it and said so. A failure or Ctrl-C leaves `out` as it was. Pass
    an absolute `out`: `.` has no name to use."""
    with atomic_dir(out) as tmp:
        published = Published(tmp)
        yield published
        if out.is_dir() and any(out.iterdir()):
            published.aside = _unused(out.parent, f"{out.name}.previous")
            out.rename(published.aside)
            console.log(f"the previous contents of {out} are kept in {published.aside}")


def check_space(path: Path, needed: int, what: str) -> None:
    """An OutputError when the file system that would hold `path` has less than `needed` bytes
    free."""
    free = shutil.disk_usage(existing_ancestor(path)).free
    if free < needed:
        raise OutputError(f"{path}: {what} needs about {needed / 2**30:.2f} GiB, but only "
                          f"{free / 2**30:.2f} GiB is free there; free some space or pick another --workdir")


def check_resume_flags(resume: bool | None, overwrite: bool) -> None:
    """--overwrite starts over and --resume continues: both at once is refused, by --dry-run as by
    the run."""
    if overwrite and resume:
        raise RecipeError("--overwrite starts over and --resume continues the run there: pass one of them")
