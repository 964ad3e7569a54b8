"""What test_corrupt_data.py runs on 2 processes (torchrun, Gloo, CPU): held-out evaluation and
feature extraction of a split whose rows on rank 1 (the odd ones) all fail to decode, then of a
split where every row
fails:
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integration/eval_ranks.py DS
OUT`. Each rank writes OUT/rank{r}.json: what it computed, or the error line it raised."""

import json
import sys
from pathlib import Path

import torch

from vitcli.data.rows import sources
from vitcli.errors import DataError
from vitcli.evaluators.heldout import ClassificationEvaluator
from vitcli.fewshot import features
from vitcli.models.zoo import build_model
from vitcli.recipe.schema import DataConfig, ModelConfig, OptimConfig
from vitcli.runtime.dist import setup
from vitcli.train.losses import loss_fn

CFG = DataConfig(num_workers=0, eval_batch_size=4)


def attempt(fn) -> object:
    """fn()'s result, or the one line of the DataError it raised."""
    try:
        return fn()
    except DataError as e:
        return f"DataError: {e}"


if __name__ == "__main__":
    source, out = sys.argv[1], Path(sys.argv[2])
    dist = setup("cpu")
    torch.manual_seed(0)
    tiny = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    model = build_model(tiny, 32)
    report = {}
    for split in ("odd_broken", "broken"):
        ds = sources.load_source(source, split)
        evaluator = ClassificationEvaluator(split, ds, CFG, 32, dist, "fp32", loss=loss_fn(OptimConfig()))
        report[f"{split}/heldout"] = attempt(lambda ev=evaluator: dict(ev.run(model)))
        extracted = attempt(lambda ds=ds: features.extract(model, ds, CFG, 32, 0, dist, "fp32"))
        report[f"{split}/features"] = extracted if isinstance(extracted, str) else extracted[1].tolist()
    (out / f"rank{dist.rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
