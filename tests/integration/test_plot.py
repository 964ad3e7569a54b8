"""`vit plot`: training curves of one or several workdirs in one PNG; bad workdirs are one-line
errors."""

import math
import re

import pytest
import yaml
from PIL import Image

from helpers import run_vit
from vitcli.figures import curves
from vitcli.runtime.metrics import MetricsLog


def workdir(path, steps=20, lr=1e-3, fewshot=False):
    """A workdir whose metrics.jsonl looks like the trainer's: train rows, periodic val, a final
    test."""
    path.mkdir(parents=True)
    log = MetricsLog(path / "metrics.jsonl")
    for step in range(1, steps + 1):
        log.write(step, {"train/loss": 2.0 * math.exp(-step / 10), "train/lr": lr * step / steps,
                         "train/grad_norm": 1.0, "train/img_per_s": 100.0})
        if step % 5 == 0:
            log.write(step, {"val/top1": step / steps, "val/loss": 1.0 / step,
                             **({"fewshot/cifar10/5shot": step / (2 * steps)} if fewshot else {})})
    log.write(steps, {"test/top1": 0.9, "test/loss": 0.1})
    return path


def png_size(path):
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_panels_take_the_trainers_keys():
    assert [curves.panel(k) for k in ("train/loss", "val/loss", "train/lr", "val/top1", "test/top1",
                                      "fewshot/cifar10/5shot", "train/img_per_s", "train/grad_norm")] == [
        "loss", "loss", "learning rate", "held-out accuracy", "held-out accuracy", "few-shot accuracy",
        None, None]


def test_two_runs_in_one_png_in_the_current_directory(tmp_path, monkeypatch, capsys):
    a, b = workdir(tmp_path / "a", lr=1e-3), workdir(tmp_path / "b", lr=3e-3, fewshot=True)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_vit(monkeypatch, capsys, "plot", a, b)
    assert code == 0, err
    assert "curves.png" in out and not (a / "curves.png").exists()
    width, height = png_size(tmp_path / "curves.png")
    assert width > 3 * height > 600, (width, height)  # four panels side by side


def test_empty_panels_are_left_out_and_every_run_is_labelled():
    runs = {"a": [{"step": 1, "train/loss": 1.0, "train/lr": 0.1},
                  {"step": 2, "train/loss": 0.5, "train/lr": 0.2}],
            "b": [{"step": 1, "train/loss": 2.0, "train/lr": 0.3}]}
    fig = curves.curves_figure(runs)
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["a: train/loss", "b: train/loss"]


def test_a_split_has_one_line_style_in_every_panel_and_the_legend_names_it(tmp_path):
    fig = curves.curves_figure({"run": curves.read_run(workdir(tmp_path / "run"))})
    styles = {line.get_label(): line.get_linestyle() for ax in fig.axes for line in ax.get_lines()}
    assert styles == {"train/loss": "-", "val/loss": "--", "test/loss": ":", "train/lr": "-",
                      "val/top1": "--", "test/top1": ":"}


def test_the_ema_weights_lines_keep_their_splits_style_with_hollow_squares(tmp_path):
    """val_ema/top1 is dashed as val/top1 is (not the next free style, as it was), and its markers
    tell the two apart in the plot and the legend."""
    rows = [{"step": s, "train/loss": 1.0 / s, "val/top1": 0.1 * s, "val_ema/top1": 0.09 * s,
             "test/top1": 0.5, "test_ema/top1": 0.52} for s in (1, 2, 3)]
    fig = curves.curves_figure({"run": rows})
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    assert [lines[k].get_linestyle() for k in ("val/top1", "val_ema/top1", "test/top1", "test_ema/top1")] == [
        "--", "--", ":", ":"]
    assert (lines["val/top1"].get_marker(), lines["val_ema/top1"].get_marker()) == ("o", "s")
    assert lines["val_ema/top1"].get_markerfacecolor() == "none" != lines["val/top1"].get_markerfacecolor()
    legend = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert legend == ["val/top1", "val_ema/top1", "test/top1", "test_ema/top1"]


@pytest.mark.parametrize("lrs, scale", [((0.002, 0.03), "log"), ((1e-3, 2e-3), "linear")])
def test_learning_rates_far_apart_share_a_log_axis(tmp_path, lrs, scale):
    runs = {f"r{i}": curves.read_run(workdir(tmp_path / f"r{i}", lr=lr)) for i, lr in enumerate(lrs)}
    ax = next(ax for ax in curves.curves_figure(runs).axes if ax.get_title().startswith("learning rate"))
    assert ax.get_yscale() == scale and ("log" in ax.get_title()) == (scale == "log")


def test_one_run_goes_into_its_workdir(tmp_path, monkeypatch, capsys):
    run = workdir(tmp_path / "run")
    code, _, err = run_vit(monkeypatch, capsys, "plot", run)
    assert code == 0, err
    assert png_size(run / "curves.png")[0] > 200


@pytest.mark.parametrize("name", ["curves.pdf", "curves"])
def test_an_out_that_is_not_a_png_is_refused_in_one_line(tmp_path, monkeypatch, capsys, name):
    """It writes PNG bytes: a .pdf (or no suffix) once got them under that name."""
    run = workdir(tmp_path / "run")
    code, out, err = run_vit(monkeypatch, capsys, "plot", run, "--out", tmp_path / name)
    assert code == 2 and out == "" and err.count("\n") == 1 and "name a .png file" in err
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("make, named", [
    (lambda p: p / "nowhere", "nowhere"),
    (lambda p: (p / "w").mkdir() or p / "w", "metrics.jsonl"),
    (lambda p: (p / "w").mkdir() or (p / "w" / "metrics.jsonl").write_text("") or p / "w", "metrics.jsonl"),
])
def test_a_missing_workdir_or_metrics_is_one_line(tmp_path, monkeypatch, capsys, make, named):
    code, out, err = run_vit(monkeypatch, capsys, "plot", make(tmp_path), "--out", tmp_path / "c.png")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and named in err
    assert not (tmp_path / "c.png").exists()


def test_a_sweeps_workdir_is_told_to_plot_its_points_and_that_advice_works(tmp_path, monkeypatch,
                                                                             capsys):
    for lr in ("optim.lr=0.001", "optim.lr=0.003"):
        workdir(tmp_path / "sweep" / lr)
    png = tmp_path / "c.png"
    code, out, err = run_vit(monkeypatch, capsys, "plot", tmp_path / "sweep", "--out", png)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    advice = " ".join(err.split()).split("plot them: vit plot ")[1]
    code, _, err = run_vit(monkeypatch, capsys, "plot", *advice.split(), "--out", png)
    assert code == 0 and png_size(png), err


def test_a_run_that_cannot_draw_its_curves_only_warns(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    curves.write_run_curves(tmp_path / "w")  # no metrics.jsonl: a warning, no exception
    assert "warning" in capsys.readouterr().err and not (tmp_path / "w" / "curves.png").exists()


def test_losses_share_a_panel_only_when_they_are_one_quantity(tmp_path):
    """train/loss and val/loss of a run come from one loss definition: one panel. Runs trained with
    different losses (softmax vs sigmoid cross-entropy, or label smoothing) get a loss panel each,
    titled by the loss."""
    runs = {}
    for name, optim in (("soft", {"loss": "softmax"}), ("sig", {"loss": "sigmoid"}),
                        ("sig2", {"loss": "sigmoid"}),
                        ("smooth", {"loss": "softmax", "label_smoothing": 0.1})):
        (workdir(tmp_path / name) / "recipe.yaml").write_text(yaml.safe_dump({"optim": optim}))
        runs[name] = curves.loss_name(tmp_path / name)
    assert runs == {"soft": "softmax xent", "sig": "sigmoid xent (per-class BCE)",
                    "sig2": "sigmoid xent (per-class BCE)", "smooth": "softmax xent, smoothing 0.1"}
    fig = curves.curves_figure({n: curves.read_run(tmp_path / n) for n in runs}, runs)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:3] == ["loss: softmax xent", "loss: sigmoid xent (per-class BCE)",
                          "loss: softmax xent, smoothing 0.1"]
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["sig: train/loss", "sig: val/loss", "sig: test/loss", "sig2: train/loss",
                      "sig2: val/loss", "sig2: test/loss"]
    assert curves.loss_name(tmp_path) == ""  # no recipe.yaml: a plain "loss" panel, as before


def lines_by_label(fig):
    return {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}


def test_the_legend_draws_each_line_as_it_is_drawn(tmp_path):
    """A user read val as solid: the legend's dashed handle was too short to show a gap beside its
    marker. Each handle has its line's colour, style and marker, and is long enough for a dash
    pattern."""
    a, b = workdir(tmp_path / "a"), workdir(tmp_path / "b", lr=3e-3, fewshot=True)
    for runs in ({"a": curves.read_run(a)}, {"a": curves.read_run(a), "b": curves.read_run(b)}):
        fig = curves.curves_figure(runs)
        for ax in fig.axes:
            legend = ax.get_legend()
            lines = {line.get_label(): line for line in ax.get_lines()}
            assert legend.handlelength >= 4
            for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
                line = lines[text.get_text()]
                assert (handle.get_linestyle(), handle.get_color(), handle.get_marker()) == (
                    line.get_linestyle(), line.get_color(), line.get_marker()), text.get_text()


def test_a_series_has_its_own_colour_the_same_in_every_panel(tmp_path):
    """All lines of a run were one colour: now every line in a panel has its own, and a split keeps
    its colour across panels (val/loss and val/top1 alike), its style telling train from val too."""
    fig = curves.curves_figure({"run": curves.read_run(workdir(tmp_path / "run"))})
    for ax in fig.axes:
        colours = [line.get_color() for line in ax.get_lines()]
        assert len(set(colours)) == len(colours), ax.get_title()
    lines = lines_by_label(fig)
    assert lines["val/loss"].get_color() == lines["val/top1"].get_color() != lines["train/loss"].get_color()
    assert lines["test/loss"].get_color() == lines["test/top1"].get_color()
    assert (lines["train/loss"].get_linestyle(), lines["val/loss"].get_linestyle()) == ("-", "--")


def test_several_runs_are_told_apart_by_a_marker_each_and_named_in_the_legend(tmp_path):
    """Across runs a key keeps its colour and style; each run has its own marker shape, on every
    line, dense ones included, and the legend says which run a line is."""
    runs = {n: curves.read_run(workdir(tmp_path / n, steps=60)) for n in ("a", "b", "c")}
    fig = curves.curves_figure(runs)
    lines = lines_by_label(fig)
    keys = ("train/loss", "val/loss", "train/lr", "val/top1")
    markers = {n: {lines[f"{n}: {k}"].get_marker() for k in keys} for n in runs}
    assert all(len(m) == 1 for m in markers.values()) and len(set.union(*markers.values())) == 3
    assert len({lines[f"{n}: train/loss"].get_color() for n in runs}) == 1
    assert len({lines[f"{n}: val/top1"].get_linestyle() for n in runs}) == 1
    dense = lines["b: train/loss"].get_markevery()
    assert 0 < dense[0] < dense[1] < 60  # a marker every few steps, offset from run a's so both show
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert all(f"{n}: train/loss" in legend for n in runs)


@pytest.mark.parametrize("recipe, title", [
    ({"optim": {"loss": "softmax"}}, "loss: softmax xent"),
    ({"optim": {"loss": "sigmoid", "label_smoothing": 0.1}},
     "loss: sigmoid xent (per-class BCE), smoothing 0.1"),
    ({"objective": "mpp", "mpp": {"target": "mean_color"}}, "loss: masked patches, mean_color xent"),
    ({"objective": "mpp", "mpp": {"target": "pixels_l2"}}, "loss: masked patches, pixels_l2 squared error"),
    ({"objective": "mae"}, "loss: removed patches, per-patch normalised pixel squared error"),
    ({"objective": "mae", "mae": {"norm_pix_loss": False}}, "loss: removed patches, pixel squared error"),
    ({"data": {"mixup_alpha": 0.8, "mix_prob": 0.0}}, "loss: softmax xent"),  # nothing is ever mixed
    ({"data": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}},
     "loss | train: softmax xent, on mixup / CutMix targets | val: softmax xent"),
    ({"data": {"cutmix_alpha": 1.0}, "optim": {"label_smoothing": 0.1}},
     "loss | train: softmax xent, smoothing 0.1, on CutMix targets | val: softmax xent, smoothing 0.1"),
    ({"distill": {"type": "hard", "alpha": 0.5, "teacher": "t"}},
     "loss | train: 0.5 x (softmax xent) + 0.5 x hard distillation | val: softmax xent"),
    ({"distill": {"type": "soft", "alpha": 0.3, "tau": 2.0, "teacher": "t"}, "data": {"mixup_alpha": 0.8}},
     ("loss | train: 0.7 x (softmax xent, on mixup targets) + 0.3 x soft distillation (tau 2)"
      " | val: softmax xent")),
])
def test_the_loss_panel_says_what_train_loss_is_under_the_recipe(tmp_path, recipe, title):
    """Under distillation train/loss is DeiT's weighted sum and under mixup / CutMix the loss on
    mixed targets, while val/loss is the plain loss on labels: the title says both, a line each ("|"
    below; long lines wrap), read from recipe.yaml."""
    run = workdir(tmp_path / "run")
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    fig = curves.curves_figure({"run": curves.read_run(run)}, {"run": curves.loss_name(run)})
    shown = fig.axes[0].get_title()
    assert " | ".join(" ".join(line.split()) for line in re.split(r"\n(?=train:|val:)", shown)) == title
