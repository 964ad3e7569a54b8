"""run.compile: the trainer steps a torch.compile'd model, but what it saves is the plain module's state."""

import pytest
import torch._dynamo

from vitcli.checkpoints import manager
from vitcli.checkpoints.weights import load_weights
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.img_size=32", "data.batch_size=16", "data.num_workers=0", "schedule.steps=2",
        "schedule.warmup_steps=1", "data.val_split=", "data.test_split=", "run.precision=fp32"]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compiled_training_saves_and_exports_the_plain_keys(tmp_path):
    r = resolve("pretrain", None, [*TINY, "run.compile=true"])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    one_run(r, tmp_path)  # inductor compiles with the system C compiler: ~1 min once, then cached
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the model was not compiled"
    plain = set(zoo.build_model(r.model, 4).state_dict())  # the names timm gives, no `_orig_mod.` prefix
    exported, _ = load_weights(tmp_path / MODEL_FILE)
    assert set(exported) == plain
    assert set(manager.latest_good_state(tmp_path)[1]["model"]) == plain
