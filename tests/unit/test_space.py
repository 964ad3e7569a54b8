"""A search's space (`--search KEY=DIST`): each DIST form read into the distribution Optuna draws
from, its values of the key's declared type; every malformed one is one RecipeError naming it."""

import pytest

from vitcli.errors import RecipeError
from vitcli.recipe.space import Dist, corner_points, space


def test_each_dist_form_reads_as_its_distribution_with_the_keys_types():
    lr, wd, mixup, depth = space(["optim.lr=log:1e-4:3e-3", "optim.weight_decay=0.01:0.3",
                                  "data.mixup_alpha=0,0.2,0.8", "model.depth=2:8"])
    assert lr == Dist("optim.lr", 1e-4, 3e-3, log=True)
    assert type(lr.low) is float  # not the string PyYAML makes of 1e-4
    assert wd == Dist("optim.weight_decay", 0.01, 0.3)
    assert mixup == Dist("data.mixup_alpha", choices=(0.0, 0.2, 0.8))  # a float key: 0 is 0.0
    assert depth == Dist("model.depth", 2, 8) and type(depth.low) is int  # an int key draws ints
    assert space(["data.hflip=true,false"])[0].choices == (True, False)
    assert space(["optim.lr=1:2"])[0].low == 1.0 and type(space(["optim.lr=1:2"])[0].low) is float


def test_a_dist_written_back_reads_as_itself():
    """What a journal remembers of the space (Search.texts) is a DIST that parses to the same."""
    for spec in ["optim.lr=log:1e-4:3e-3", "optim.weight_decay=0.01:0.3", "data.mixup_alpha=0,0.2,0.8",
                 "model.depth=2:8", "data.hflip=true,false"]:
        (d,) = space([spec])
        assert space([f"{d.key}={d.text()}"]) == [d], d.text()


def test_the_corners_are_each_range_end_and_each_listed_value_the_others_at_their_first():
    dists = space(["optim.lr=log:1e-4:3e-3", "data.mixup_alpha=0,0.8"])
    assert corner_points(dists) == [
        {"optim.lr": 1e-4, "data.mixup_alpha": 0.0}, {"optim.lr": 3e-3, "data.mixup_alpha": 0.0},
        {"optim.lr": 1e-4, "data.mixup_alpha": 0.0}, {"optim.lr": 1e-4, "data.mixup_alpha": 0.8}]


class _Trial:
    """What Dist.suggest asks of an Optuna trial, recorded."""

    def __init__(self):
        self.asked = []

    def suggest_float(self, name, low, high, log):
        self.asked.append(("float", name, low, high, log))

    def suggest_int(self, name, low, high, log):
        self.asked.append(("int", name, low, high, log))

    def suggest_categorical(self, name, choices):
        self.asked.append(("categorical", name, choices))


def test_each_dist_asks_optuna_for_its_kind():
    trial = _Trial()
    for d in space(["optim.lr=log:1e-4:3e-3", "model.depth=2:8", "data.mixup_alpha=0,0.8"]):
        d.suggest(trial)
    assert trial.asked == [("float", "optim.lr", 1e-4, 3e-3, True), ("int", "model.depth", 2, 8, False),
                           ("categorical", "data.mixup_alpha", [0.0, 0.8])]


@pytest.mark.parametrize(("spec", "says"), [
    ("optim.lr", "is not KEY=DIST"),
    ("optim.lr=", "is not KEY=DIST"),
    ("optim.lr=1e-3", "not a DIST"),
    ("optim.lr=1:2:3", "not a DIST"),
    ("optim.lr=log:0:1e-3", "a log range must start above 0"),
    ("optim.lr=3e-3:1e-4", "LO must be below HI"),
    ("optim.lr=1e-3:1e-3", "LO must be below HI"),
    ("optim.lr=a,b", "optim.lr"),
    ("optim.lr=1e-3,", "an empty value"),
    ("optim.bogus=1:2", "unknown recipe key 'optim.bogus'"),
    ("model.depth=1.5:3", "model.depth"),
    ("data.source=a:b", "a range needs a number key"),
    ("fewshot.shots=1,5", "cannot be searched"),
    ("data.mixup_alpha=0,0.2,0", "given twice"),
    ("run.device=cpu,cuda", "cannot be searched"),
])
def test_a_bad_dist_is_one_line_naming_it(spec, says):
    with pytest.raises(RecipeError) as e:
        space([spec])
    message = str(e.value)
    assert message.startswith("--search ") and says in message and "\n" not in message, message
    assert spec.split("=")[0] in message


def test_a_key_given_twice_is_refused():
    with pytest.raises(RecipeError, match="given twice"):
        space(["optim.lr=log:1e-4:3e-3", "optim.lr=1e-4:1e-3"])
