"""run.compile: the trainer steps a torch.compile'd model, but what it saves is the plain module's
state; a masked-patch-prediction step and an MAE step each compile to one graph, once, and read
nothing back on the host."""

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

from vitcli.checkpoints import manager
from vitcli.checkpoints.weights import load_weights
from vitcli.models import zoo
from vitcli.models.mae import MaeModel, mae_step
from vitcli.models.mpp import MppModel, mpp_step
from vitcli.recipe.choices import MPP_TARGETS
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import MaeConfig, ModelConfig, MppConfig
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

aten = torch.ops.aten
HOST_READS = frozenset({aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero,
                        aten.masked_select})
MASK_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_})

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


class HostReads(TorchDispatchMode):
    """The aten ops run inside it that read tensor values back on the host: a value (item, bool) or
    a shape that depends on values (nonzero, masked_select, indexing by a boolean mask). On a GPU
    each one waits for all queued work."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        by_mask = packet in MASK_INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if packet in HOST_READS or by_mask:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def tiny_mpp(target: str = "mean_color") -> MppModel:
    torch.manual_seed(0)
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    return MppModel(zoo.build_model(cfg, 0), MppConfig(target=target), cfg.patch_size)


def images(seed: int) -> torch.Tensor:
    return torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("target", MPP_TARGETS)
def test_an_mpp_step_reads_nothing_back_on_the_host(target):
    """Draws, forward, loss and backward of one step: no op waits for the device (the mode
    assignments by mask, the loss's empty-mask check and its boolean indexing did, at every
    micro-batch)."""
    model = tiny_mpp(target)
    with HostReads() as reads:
        loss, accuracy = mpp_step(model, images(0), 3, model.cfg, model.patch_size)
        loss.backward()
    assert reads.ops == []
    assert loss > 0 and 0 <= accuracy <= 1


def test_a_compiled_mpp_step_is_one_graph_compiled_once():
    """The corruption draws enter the compiled forward as tensors: no graph break, and steps with
    other draws (other seeds, so other masks) reuse the first step's graph. aot_eager: dynamo and
    AOTAutograd, as inductor sees them, without generating kernels (graph breaks and recompiles are
    decided before the backend)."""
    model = tiny_mpp()
    breaks, seen = compiled_steps(model, lambda compiled, step: mpp_step(
        compiled, images(step), step, model.cfg, model.patch_size)[0], 4)
    assert breaks == {}
    assert seen == [seen[0]] * 4 and seen[0][0] == 1, seen


def compiled_steps(model, loss, steps: int) -> tuple[dict, list]:
    """(graph breaks, (unique graphs, frames) after each step) of `steps` steps of loss(compiled
    model, step), each with its backward, under torch.compile(backend="aot_eager")."""
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    seen = []
    for step in range(steps):
        loss(compiled, step).backward()
        seen.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
    return dict(counters["graph_break"]), seen


def tiny_mae() -> MaeModel:
    torch.manual_seed(0)
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    decoder = MaeConfig(decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    return MaeModel(zoo.build_model(cfg, 0), decoder, cfg.patch_size)


def test_an_mae_step_reads_nothing_back_on_the_host_and_compiles_to_one_graph_once():
    """The masks' noise (a hash on the device), the argsort, the gathers and the loss over the
    removed patches: no op waits for the device; compiled (aot_eager, as above), steps of other
    images and other masks reuse the first step's one graph."""
    model = tiny_mae()
    with HostReads() as reads:
        mae_step(model, images(0), 0, 0, model.cfg, model.patch_size).backward()
    assert reads.ops == []
    breaks, seen = compiled_steps(model, lambda compiled, step: mae_step(
        compiled, images(step), 0, step * 4, model.cfg, model.patch_size), 3)
    assert breaks == {}
    assert seen == [seen[0]] * 3 and seen[0][0] == 1, seen
