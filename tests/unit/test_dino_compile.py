"""DINO's student compiles as a CUDA run compiles it (torch.compile of the module the loop trains), with
iBOT's masked tokens chosen by positions made outside it: no graph break from a selection whose size the
data decide, one recompile at most as the masked count changes, and the same outputs as eager."""

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from vitcli.models.dino import masked_positions
from vitcli.recipe.resolve import resolve
from vitcli.run.network import network

TINY = ["objective=dino", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "dino.out_dim=64", "dino.hidden_dim=32",
        "dino.bottleneck_dim=16", "dino.local_crops=2", "dino.local_crop_size=16", "optim.clip_grad_norm=0",
        "data.batch_size=8", "run.precision=fp32", "schedule.steps=10", "schedule.warmup_steps=1",
        "dino.ibot_weight=1"]


def test_the_student_compiles_without_a_graph_break_and_matches_eager():
    torch.manual_seed(0)
    model, objective = network(resolve("pretrain", None, TINY, inputs=False), 0, torch.device("cpu"))
    globals_, locals_ = objective.example(4, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    for share in (0.2, 0.4, 0.6):  # the masked count changes from step to step
        masks = torch.rand(8, 16) < share
        index = masked_positions(masks)
        eager = model(globals_, locals_, masks, index)
        found = compiled(globals_, locals_, masks, index)
        for a, b in zip(eager, found, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert found[1].shape[0] == int(masks.sum())
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2  # the first, then one with the count dynamic


def test_masked_positions_select_what_a_boolean_mask_selects():
    masks = torch.rand(6, 9) < 0.5
    tokens = torch.randn(6, 10, 4)
    index = masked_positions(masks)
    assert torch.equal(tokens[:, 1:].flatten(0, 1).index_select(0, index), tokens[:, 1:][masks])
