"""The figures the docs quote are the recorded ones: each number README.md, docs/ and the recipe
headers take from a run is marked (`<!-- quote: KEY -->`, scripts/quotes.py), equals its record in
docs/measured/ (written by `make record`) and stands nowhere else unmarked. `make quotes` rewrites
what differs.

It reads files only: the runs are measured by `make record`, never here."""

import importlib.util
import sys

import pytest

from helpers import REPO

SPEC = importlib.util.spec_from_file_location("quotes", REPO / "scripts/quotes.py")
quotes = sys.modules["quotes"] = importlib.util.module_from_spec(SPEC)  # dataclasses look their module up
SPEC.loader.exec_module(quotes)

# Where a quickstart figure must be quoted: the walkthrough, and the header of the recipe that
# measures it (a figure there without its marker would go stale unseen).
MUST_QUOTE = {
    "README.md": {"quickstart.pretrain.test_top1", "quickstart.finetune.test_top1",
                  "quickstart.finetune_scratch.test_top1", "quickstart.fewshot.top1"},
    "recipes/quickstart/pretrain.yaml": {"quickstart.pretrain.test_top1"},
    "recipes/quickstart/finetune.yaml": {"quickstart.finetune.test_top1",
                                         "quickstart.finetune_scratch.test_top1"},
    "recipes/quickstart/fewshot.yaml": {"quickstart.fewshot.top1", "quickstart.fewshot_random_init.top1"},
}


@pytest.fixture(scope="module")
def records():
    """{name: record} of docs/measured/*.json."""
    return quotes.load_records()


@pytest.fixture(scope="module")
def quoted(records):
    """Every marked figure of every file that may quote one."""
    return [q for path in quotes.quoting_files() for q in quotes.quotes_in(path, records)]


def test_every_quote_equals_its_record(quoted):
    differ = [f"{q.where()}: {q.key} reads {q.shown!r}, its record {q.expected!r}"
              for q in quoted if q.shown != q.expected]
    assert not differ, "`make quotes` rewrites them:\n" + "\n".join(differ)


def test_no_quoted_figure_stands_unmarked(quoted):
    copies = quotes.unmarked_copies(quotes.quoting_files(), quoted)
    assert not copies, "mark them (`<!-- quote: KEY -->` before the figure):\n" + "\n".join(copies)


def test_the_quickstart_figures_are_quoted_where_users_read_them(quoted):
    for page, keys in MUST_QUOTE.items():
        missing = keys - {q.key for q in quoted if q.path == REPO / page}
        assert not missing, f"{page} quotes no {sorted(missing)}"


def test_each_record_says_when_where_and_how_it_was_measured(records):
    assert records, "no docs/measured/*.json"
    for name, record in records.items():
        assert {"date", "machine", "command"} <= set(record), name
        assert {"cpu", "cores"} <= set(record["machine"]), name


def test_evaluate_gives_back_what_the_fine_tune_reported(records):
    """README and docs/evaluate.md say so of the recorded runs, quoting one figure for both."""
    run, evaluate = records["quickstart"]["finetune"], records["quickstart"]["evaluate"]
    assert (evaluate["top1"], evaluate["loss"]) == (run["test_top1"], run["test_loss"])


def test_a_rewrite_keeps_each_quotes_decimals_and_joins(tmp_path):
    records = {"r": {"top1": 75.42, "loss": [2.3136, 0.5071], "date": "2026-11-25", "shots": [25.2, 30.46]}}
    page = tmp_path / "page.md"
    page.write_text("test <!-- quote: r.top1 -->77.7% (77.7 in a table), loss <!-- quote: r.loss -->2.3 -> "
                    "0.512 on <!-- quote: r.date -->2026-11-24; <!-- quote: r.shots -->24.0 / 28.9%\n")
    assert [q.key for q in quotes.rewrite(page, records)] == ["r.top1", "r.loss", "r.date", "r.shots"]
    assert page.read_text() == ("test <!-- quote: r.top1 -->75.4% (77.7 in a table), loss "
                                "<!-- quote: r.loss -->2.3 -> 0.507 on <!-- quote: r.date -->2026-11-25; "
                                "<!-- quote: r.shots -->25.2 / 30.5%\n")
    assert quotes.rewrite(page, records) == []  # nothing left to rewrite


def test_a_marker_without_its_figure_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("test top-1 <!-- quote: r.top1 -->about three quarters\n")
    with pytest.raises(SystemExit, match="no figure shaped like '75.4'"):
        quotes.rewrite(page, {"r": {"top1": 75.4}})
    with pytest.raises(KeyError, match="r.top1"):  # a key its record lacks
        quotes.quotes_in(page, {"r": {}})


def test_a_copy_without_its_marker_is_found_outside_code_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("test <!-- quote: r.top1 -->75.4%, again 75.4% and 175.4 and 75.45\n"
                    "```\ntop1 75.4\n```\n")
    found = quotes.quotes_in(page, {"r": {"top1": 75.42}})
    assert quotes.unmarked_copies([page], found) == [f"{page}:1: 75.4"]
