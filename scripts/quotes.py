"""Quoted figures: every number README.md, docs/ and the recipe headers take from a recorded run is marked
where it stands, checked against its record and rewritten from it.

A quote is a marker right before the figure, in Markdown and in a recipe's YAML comments alike (rendered
Markdown hides it):

    test top-1 <!-- quote: quickstart.pretrain.test_top1 -->75.4%

Its key is RECORD.PATH: the file docs/measured/RECORD.json, then the path of keys into it. The figure is
what follows the marker: one number for a number, the list's numbers joined by ` / ` or ` -> ` for a list
(`25.2 / 30.5 / 31.9 / 32.9`), or a date (`2026-11-25`). A number shows the record's value rounded to the
decimals the quote shows, so a rewrite keeps each quote's precision: to show more, write more.

    python scripts/quotes.py          # the quotes that differ from their records; exit 1 if any
    python scripts/quotes.py --write  # rewrite them from the records (make quotes)

tests/integration/test_quotes.py fails on a quote that differs, and on a quoted figure that also stands
unmarked elsewhere (a copy nobody would rewrite).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "docs" / "measured"
MARKER = re.compile(r"<!-- quote: (?P<key>[\w.]+) -->")
NUMBER = r"-?\d+(?:\.\d+)?"
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
JOIN = r"\s*(?:/|->)\s*"  # between the numbers of a list: `25.2 / 30.5`, `2.31 -> 0.51`


def quoting_files(root: Path = REPO) -> list[Path]:
    """The files that may quote: README.md, docs/*.md and every recipe (quotes sit in their headers)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "recipes").rglob("*.yaml"))]


@dataclasses.dataclass(frozen=True)
class Quote:
    """One marked figure: where it is, what it says and what its record says it should."""

    path: Path
    line: int
    key: str
    start: int  # the figure's span in the file's text
    end: int
    shown: str  # the figure as the file has it ("" when nothing after the marker has the record's shape)
    expected: str  # the record's value as this quote would show it

    def where(self) -> str:
        """file:line, relative to the repository."""
        return f"{shown_path(self.path)}:{self.line}"


def shown_path(path: Path) -> Path:
    """A path as messages give it: relative to the repository when it is in it."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def load_records(directory: Path = RECORDS) -> dict[str, object]:
    """{record name: its JSON} of every docs/measured/*.json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def lookup(records: dict, key: str) -> object:
    """The value at a quote's dotted key; KeyError naming the key when the record lacks it."""
    value: object = records
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"no {key!r} in docs/measured/ (no {part!r})")
        value = value[part]
    return value


def figure_pattern(value: object) -> re.Pattern:
    """What a quote of `value` looks like: a date, a number, or a list's numbers joined."""
    if isinstance(value, str):
        return DATE
    count = len(value) if isinstance(value, list) else 1
    return re.compile(JOIN.join([f"({NUMBER})"] * count))


def render(value: object, like: str) -> str:
    """`value` as a quote shows it, each number with as many decimals as its counterpart in `like` (the
    quote as written, whose joins are kept), or as the record has it when `like` is not a quote of it."""
    if isinstance(value, str):
        return value
    values = value if isinstance(value, list) else [value]
    shown = figure_pattern(value).fullmatch(like)
    if shown is None:
        return " / ".join(str(v) for v in values)
    out, last = [], 0
    for i, v in enumerate(values, 1):
        decimals = len(shown.group(i).partition(".")[2])
        out += [like[last:shown.start(i)], f"{v:.{decimals}f}"]
        last = shown.end(i)
    return "".join(out)


def quotes_in(path: Path, records: dict) -> list[Quote]:
    """Every marked figure of one file."""
    text, found = path.read_text(), []
    for m in MARKER.finditer(text):
        try:
            value = lookup(records, m["key"])
        except KeyError as e:
            raise KeyError(f"{path}:{line_of(text, m.start())}: {e.args[0]}") from None
        figure = figure_pattern(value).match(text, m.end())
        shown = figure[0] if figure else ""
        found.append(Quote(path, line_of(text, m.start()), m["key"], m.end(), m.end() + len(shown), shown,
                           render(value, shown)))
    return found


def line_of(text: str, offset: int) -> int:
    """The 1-based line of a character offset."""
    return text.count("\n", 0, offset) + 1


def rewrite(path: Path, records: dict) -> list[Quote]:
    """Rewrite the file's quotes that differ from their records; returns those it changed."""
    stale = [q for q in quotes_in(path, records) if q.shown != q.expected]
    for q in stale:
        if not q.shown:  # nothing of the record's shape to replace: the marker stands before prose
            raise SystemExit(f"{q.where()}: no figure shaped like {q.expected!r} after the marker of "
                             f"{q.key}; write one there, then rewrite")
    text = path.read_text()
    for q in reversed(stale):  # from the end, so the earlier spans stay where they were
        text = text[:q.start] + q.expected + text[q.end:]
    if stale:
        path.write_text(text)
    return stale


def unmarked_copies(files: list[Path], quotes: list[Quote]) -> list[str]:
    """'file:line: figure' for each place outside a code block where a quoted figure stands unmarked.

    Only figures with a decimal point are looked for (75.4, 2.31 -> 0.51): a bare `2` or `38` stands in too
    many sentences for a copy of it to mean anything, and dates are shared by every measurement of a day.
    Code blocks hold a command's output as it printed it, where no marker can stand. A stale copy (the
    number before the last run) cannot be found this way: marking every figure taken from a run is what
    keeps those out."""
    figures = {q.shown for q in quotes if "." in q.shown}
    marked = {(q.path, q.start) for q in quotes}
    found = []
    for path in files:
        text = without_code_blocks(path.read_text())
        for figure in figures:
            for m in re.finditer(rf"(?<![\d.]){re.escape(figure)}(?!\d)", text):
                if (path, m.start()) not in marked:
                    found.append(f"{shown_path(path)}:{line_of(text, m.start())}: {figure}")
    return sorted(found)


def without_code_blocks(text: str) -> str:
    """The text with every fenced code block's characters blanked, lines and offsets kept."""
    fence = re.compile(r"^[ \t]*```.*?^[ \t]*```", flags=re.DOTALL | re.MULTILINE)
    return fence.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)


def main(argv: list[str] | None = None) -> int:
    """List every quote that differs from its record (exit 1 if one does) or, with --write, rewrite them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the quotes that differ")
    args = parser.parse_args(argv)
    records, differ = load_records(), []
    for path in quoting_files():
        differ += rewrite(path, records) if args.write else [
            q for q in quotes_in(path, records) if q.shown != q.expected]
    for q in differ:
        print(f"{q.where()}: {q.key} {q.shown!r} -> {q.expected!r}")
    verb = "rewritten" if args.write else "differ from their records"
    print(f"{len(differ)} quotes {verb}", file=sys.stderr)
    return 0 if args.write or not differ else 1


if __name__ == "__main__":
    sys.exit(main())
