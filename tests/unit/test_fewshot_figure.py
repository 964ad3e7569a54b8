"""fewshot.png cannot be misread: the weights are named (a checkpoint, or "random init" of its
network), each task's chance level is a line at 100/K that the legend names, and the axis is 0-100%
whatever the scores."""

import pytest
from matplotlib.colors import to_rgba

from vitcli.figures.fewshot import fewshot_figure, weights_label

SUMMARY = {("shapes", 1): (0.04, 0.003), ("shapes", 5): (0.05, 0.01),
           ("pets", 1): (0.2, 0.02), ("pets", 5): (0.4, 0.03)}


def chance_lines(ax):
    return {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("chance")}


def test_a_random_init_figure_says_so_and_names_the_network():
    title = fewshot_figure(SUMMARY, {"shapes": 30, "pets": 37},
                           weights_label("runs/pretrain", True, 3)).axes[0].get_title()
    assert "random init" in title and "seed 3" in title and "runs/pretrain" in title
    title = fewshot_figure(SUMMARY, {"shapes": 30, "pets": 37},
                           weights_label("runs/pretrain", False, 3)).axes[0].get_title()
    assert "runs/pretrain" in title and "random" not in title


def test_a_long_checkpoint_path_keeps_its_tail():
    label = weights_label("/very/long/" * 20 + "ViT-B_16.npz", False, 0)
    assert label.endswith("ViT-B_16.npz") and label.startswith("...") and len(label) < 70


@pytest.mark.parametrize("summary", [SUMMARY, {k: (v[0] / 10, v[1] / 10) for k, v in SUMMARY.items()}])
def test_the_axis_is_0_to_100_whatever_the_scores(summary):
    assert fewshot_figure(summary, {"shapes": 30, "pets": 37}, "x").axes[0].get_ylim() == (0, 100)


def test_chance_is_a_dotted_line_at_100_over_k_in_its_tasks_colour_told_in_the_legend():
    ax = fewshot_figure(SUMMARY, {"shapes": 30, "pets": 37}, "x").axes[0]
    lines = chance_lines(ax)
    assert {label: tuple(line.get_ydata()) for label, line in lines.items()} == {
        "chance shapes: 1/30": (100 / 30, 100 / 30), "chance pets: 1/37": (100 / 37, 100 / 37)}
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "shapes (chance 1/30 = 3.33%)", "pets (chance 1/37 = 2.7%)",
        "chance: 1/classes (dotted, in the task's colour)"]
    for handle, task in zip(legend.legend_handles, ("shapes", "pets")):
        line = lines[f"chance {task}: 1/{30 if task == 'shapes' else 37}"]
        assert line.get_linestyle() == ":" and to_rgba(line.get_color()) == to_rgba(handle.get_color()[0])
    assert legend.legend_handles[-1].get_linestyle() == ":"


def test_many_tasks_take_two_legend_columns_beside_the_axes():
    summary = {(f"task{i}", k): (0.5, 0.01) for i in range(19) for k in (1, 5)}
    fig = fewshot_figure(summary, {f"task{i}": 10 + i for i in range(19)}, "x")
    assert fig.axes[0].get_legend()._ncols == 2 and len(chance_lines(fig.axes[0])) == 19
