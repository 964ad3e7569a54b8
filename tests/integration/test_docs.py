"""The docs are true: every command they show runs as written, and they list exactly the options and
keys.

Which commands (README.md and docs/*.md):
- only fenced code blocks whose info string is `bash`, `sh`, `shell` or `console` (a block without
one, such
  as a usage line, or a `python` block, is not run);
- a line ending in `\\` continues on the next; a leading `$ ` prompt is dropped;
- a line is a command when its first word is `vit` or `torchrun`; other lines (`make demo`, `source
...`)
  are not run. It is split as a shell splits it (shlex); `#` starts a comment, and the first `>`,
  `>>`, `|`, `&&` or `;` (written with spaces around) ends the command;
- a comment `# needs: <what>` (the Hub, your images) marks a command that cannot run offline: its
arguments
  are parsed by the command's own parser, nothing runs.

How each runs: in-process through `cli.main()`, exit code 0 required, in a sandbox directory
standing in for a user's checkout after `make demo`: `recipes/` is the repository's, and the files
of STAND_INS sit at the paths the docs use.
- pretrain, finetune, eval-fewshot, resize-posemb: with `--dry-run` added when absent, so the recipe
is
  resolved and checked and the checkpoints read, but nothing trains or is written;
- inspect, plot: run for real on the sandbox's tiny runs;
- `torchrun [its options] -m vitcli.cli ARGS`: torchrun's own parser reads its options, then ARGS
run as above
  with WORLD_SIZE = nnodes x nproc-per-node, so the split of the global batch over the processes is
  checked.
"""

import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest
import typer.main
import yaml
from torch.distributed.run import get_args_parser

from helpers import REPO, export_npz, tiny_vit
from vitcli import cli
from vitcli.recipe.resolve import STAGE_DEFAULTS, VTAB_PROTOCOL
from vitcli.recipe.schema import Recipe

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
COMMAND_ENDS = (">", ">>", "|", "&&", ";")
DRY_RUN = ("pretrain", "finetune", "eval-fewshot", "resize-posemb")

# Tiny, fast versions of the quickstart runs: the recipe as shipped, 3 steps on 64 images.
TINY = ["schedule.epochs=0", "schedule.steps=3", "schedule.warmup_steps=1", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.batch_size=32", "run.ckpt_every=3"]
QUICK = "recipes/quickstart"
# path the docs use -> (what stands in for it, how the sandbox makes it)
STAND_INS = {
    "runs/quickstart/pretrain": ("3 steps of the quickstart pretraining",
                                 ["pretrain", "-r", f"{QUICK}/pretrain.yaml", *TINY]),
    "runs/quickstart/pretrain_mpp": ("3 steps of the quickstart masked patch prediction",
                                     ["pretrain", "-r", f"{QUICK}/pretrain_mpp.yaml", *TINY]),
    "runs/quickstart/pretrain_mae": ("3 steps of the quickstart masked autoencoder",
                                     ["pretrain", "-r", f"{QUICK}/pretrain_mae.yaml", *TINY]),
    "runs/quickstart/pretrain_dino": ("3 steps of the quickstart self-distillation (DINO)",
                                      ["pretrain", "-r", f"{QUICK}/pretrain_dino.yaml", *TINY,
                                       "fewshot.every=0", "dino.koleo_group=32"]),
    "runs/quickstart/finetune": ("3 steps of the quickstart fine-tune from the pretraining above",
                                 ["finetune", "-r", f"{QUICK}/finetune.yaml", "--init",
                                  "runs/quickstart/pretrain", *TINY]),
    "runs/quickstart/finetune_scratch": ("the same from random initialisation",
                                         ["finetune", "-r", f"{QUICK}/finetune.yaml", *TINY]),
    "ViT-B_16.npz": ("a random 2-block ViT (width 32, 2 heads, patch 8, 32 px) in vit_jax's .npz layout",
                     None),
}


@dataclasses.dataclass(frozen=True)
class Documented:
    """One command as the docs show it."""

    where: str  # file:line
    args: tuple[str, ...]  # after `vit` (or the whole torchrun line)
    needs: str  # "" or what it needs that a test does not have


def logical_lines(block: list[str]) -> list[tuple[int, str]]:
    """(offset of the first line, text) of a code block's lines with `\\` continuations joined."""
    out, start, buf = [], 0, ""
    for i, line in enumerate(block):
        if not buf:
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    return out + ([(start, buf)] if buf else [])


def parse_command(text: str) -> tuple[tuple[str, ...], str] | None:
    """(words from the program name on, `needs` note) of a `vit` / `torchrun` line, else None."""
    text = text.strip().removeprefix("$ ")
    needs = re.search(r"#\s*needs:\s*(.+)$", text)
    words = shlex.split(text, comments=True)
    if not words or words[0] not in ("vit", "torchrun"):
        return None
    end = next((i for i, w in enumerate(words) if w in COMMAND_ENDS), len(words))
    return tuple(words[:end]), needs.group(1).strip() if needs else ""


def documented_commands(page: Path) -> list[Documented]:
    """Every command in the shell code blocks of one Markdown page."""
    found, block, info, first = [], None, "", 0
    for n, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            block, info, first = [], fence.group(1), n + 1
        elif fence:
            if info in SHELL_BLOCKS:
                for offset, text in logical_lines(block):
                    parsed = parse_command(text)
                    if parsed:
                        found.append(Documented(f"{page.name}:{first + offset}", *parsed))
            block = None
        elif block is not None:
            block.append(line)
    return found


ALL = [c for page in PAGES for c in documented_commands(page)]


# ---------------------------------------------------------------- the sandbox


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A directory laid out as the docs assume: recipes/, the quickstart runs and ViT-B_16.npz
    (STAND_INS)."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "recipes").symlink_to(REPO / "recipes")
    export_npz(tiny_vit(), root / "ViT-B_16.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.delenv("WORLD_SIZE", raising=False)
        for path, (_, args) in STAND_INS.items():
            if args is not None:
                assert call_vit(mp, [*args, "--workdir", path]) == 0, f"could not make the stand-in {path}"
    missing = [p for p in STAND_INS if not (root / p).exists()]
    assert not missing, missing
    return root


def call_vit(mp: pytest.MonkeyPatch, args: list[str]) -> int:
    """`vit ARGS` through cli.main(); its exit code."""
    mp.setattr(sys, "argv", ["vit", *args])
    try:
        cli.main()
    except SystemExit as e:
        return e.code or 0
    return 0


def as_run(args: tuple[str, ...]) -> tuple[list[str], int]:
    """(the `vit` arguments the test runs, world size) for a documented `vit ...` or `torchrun ...`
    line."""
    world = 1
    if args[0] == "torchrun":
        ns = get_args_parser().parse_args(list(args[1:]))
        assert ns.module and ns.training_script == "vitcli.cli", "torchrun must run `-m vitcli.cli`"
        world = int(ns.nnodes.split(":")[-1]) * int(ns.nproc_per_node)
        args = ("vit", *ns.training_script_args)
    run = list(args[1:])
    if run and run[0] in DRY_RUN and "--dry-run" not in run:
        run.append("--dry-run")
    return run, world


def parse_only(args: list[str]) -> None:
    """Parse a command's arguments with its own click parser (raises on an unknown option or a bad
    value)."""
    group = typer.main.get_command(cli.app)
    parent = group.make_context("vit", [args[0]])
    group.commands[args[0]].make_context(args[0], args[1:], parent=parent)


@pytest.mark.parametrize("doc", ALL, ids=[c.where for c in ALL])
def test_every_documented_command_runs_as_written(doc, sandbox, monkeypatch, capsys):
    run, world = as_run(doc.args)
    assert run and run[0] in cli.COMMANDS, f"{doc.where}: `{' '.join(doc.args)}` names no vit command"
    if doc.needs:
        parse_only(run)
        return
    monkeypatch.chdir(sandbox)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("VITCLI_DEBUG", raising=False)
    code = call_vit(monkeypatch, run)
    out, err = capsys.readouterr()
    assert code == 0, f"{doc.where}: `{' '.join(doc.args)}` exited {code}: {err.strip()[-400:]}"
    if "--slurm" in run:  # a dry run of a submission prints the batch script
        assert out.startswith("#!/bin/bash") and "#SBATCH" in out, f"{doc.where}: no batch script printed"
    elif run[0] in DRY_RUN[:3] and "--list-tasks" not in run:
        assert yaml.safe_load(out)["stage"] == run[0], f"{doc.where}: no resolved recipe printed"


def test_the_docs_show_every_command_and_the_cluster():
    shown = {as_run(c.args)[0][0] for c in ALL} | {"torchrun" for c in ALL if c.args[0] == "torchrun"}
    assert shown >= {*cli.COMMANDS, "torchrun"}
    assert any("--nnodes" in c.args and "--rdzv-endpoint" in c.args for c in ALL), "no multi-node example"


def test_the_extraction_rule():
    block = ["$ vit plot a \\", "    b --out c.png  # two runs", "make demo",
             "vit inspect --ckpt x --out y > log", "vit pretrain -r r.yaml  # needs: the Hub"]
    got = [parse_command(text) for _, text in logical_lines(block)]
    assert got == [(("vit", "plot", "a", "b", "--out", "c.png"), ""), None,
                   (("vit", "inspect", "--ckpt", "x", "--out", "y"), ""),
                   (("vit", "pretrain", "-r", "r.yaml"), "the Hub")]


# ---------------------------------------------------------------- options and keys, listed exactly


def table(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells) of every Markdown table between `heading` and the next heading of its
    level."""
    level = heading.split(" ")[0]
    lines = text.splitlines()
    assert heading in lines, f"no heading {heading!r}"
    rows = []
    for line in lines[lines.index(heading) + 1:]:
        if line.startswith("#") and line.split(" ")[0] in ("#" * n for n in range(1, len(level) + 1)):
            break
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [r for r in rows if r[0] not in ("option", "argument", "key")]  # header rows


def command_params(name: str):
    """(options, arguments, help option names) of `vit NAME` as click builds it."""
    group = typer.main.get_command(cli.app)
    command = group.commands[name]
    options = [p for p in command.params if p.param_type_name == "option"]
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    return options, arguments, group.make_context("vit", [name]).help_option_names


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_each_command_page_lists_exactly_its_options(name):
    text = (REPO / "docs" / f"{name}.md").read_text()
    options, arguments, help_names = command_params(name)
    rows = table(text, "## Options")
    listed = {opt for row in rows for opt in re.findall(r"`(--?[\w-]+)`", row[0])}
    assert listed == {o for p in options for o in p.opts + p.secondary_opts} | set(help_names)
    listed_args = {a.lower() for row in table(text, "## Arguments")
                   for a in re.findall(r"`([A-Z_]+)(?:\.\.\.)?`", row[0])}
    assert listed_args == {p.name for p in arguments}
    for p in options:
        if p.default not in (None, False):
            row = next(r for r in rows if f"`{p.opts[0]}`" in r[0])
            assert f"`{p.default}`" in row[1], f"{name} {p.opts[0]}: default {p.default} not in {row[1]!r}"


def recipe_defaults(obj=None, prefix: str = "") -> dict:
    """Every leaf key of the Recipe dataclasses by dotted path, with its default."""
    obj = Recipe() if obj is None else obj
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out.update(recipe_defaults(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value)
                   else {f"{prefix}{f.name}": value})
    return out


def flat(nested: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in nested.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def documented_defaults(heading: str) -> dict:
    """{key: default as YAML} of the tables under `heading` in docs/recipes.md."""
    rows = table((REPO / "docs" / "recipes.md").read_text(), heading)
    return {row[0].strip("`"): yaml.safe_load(row[1].strip("`")) for row in rows}


def test_recipes_page_lists_every_key_with_its_default():
    documented, schema = documented_defaults("## Every key"), recipe_defaults()
    assert set(schema) - set(documented) == set(), "keys missing from docs/recipes.md"
    assert set(documented) - set(schema) == set(), "keys docs/recipes.md lists but Recipe lacks"
    wrong = {k: (documented[k], v) for k, v in schema.items() if documented[k] != v}
    assert not wrong, f"(documented, actual) defaults differ: {wrong}"


def test_recipes_page_lists_the_stage_and_vtab_defaults():
    assert documented_defaults("## Stage defaults") == flat(STAGE_DEFAULTS["finetune"])
    assert documented_defaults("## VTAB protocol (`--task`)") == flat(VTAB_PROTOCOL)
    assert not any(STAGE_DEFAULTS[s] for s in ("pretrain", "eval-fewshot")), (
        "recipes.md says they add nothing")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip("# ").lower()).replace(" ", "-")


def test_links_between_the_pages_reach_a_file_and_heading():
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", page.read_text()):
            path = (page.parent / target) if target else page
            assert path.is_file(), f"{page.name}: link to missing {target}"
            if anchor and path.suffix == ".md":
                heads = [slug(h) for h in path.read_text().splitlines() if h.startswith("#")]
                assert anchor in heads, f"{page.name}: no heading #{anchor} in {path.name}"
