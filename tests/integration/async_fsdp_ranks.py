"""What tests/integration/test_async_checkpoints.py runs on 2 processes (torchrun, Gloo, CPU), in one
launch: `python -m torch.distributed.run --standalone --nproc_per_node 2
tests/integration/async_fsdp_ranks.py OUTDIR`. The same tiny FSDP run three times, each in its
workdir under OUTDIR: with DCP's async_save (`async`), with the synchronous writer (`sync`), and
with async_save and a full disk at step 2's checkpoint (`enospc`)."""

import os
import sys
from pathlib import Path

from vitcli.recipe.resolve import resolve
from vitcli.runtime.faults import ENV as FAULTS
from vitcli.stages.run import one_run

# the tiny run of the test module too: 4 steps, a checkpoint at each, all kept
STEPS = 4
TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
    "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.num_classes=4",
    "data.synthetic.train_size=128", "data.synthetic.val_size=64", "data.synthetic.test_size=64",
    "data.synthetic.img_size=32", "data.batch_size=32", "data.num_workers=0", "optim.lr=3e-3",
    "schedule.warmup_steps=1", "run.log_every=1", "data.val_split=", "data.test_split=",
    "model.dropout=0", "model.drop_path=0", "ema.decay=0.9", f"schedule.steps={STEPS}",
    "run.ckpt_every=1", "run.keep_checkpoints=5",
]


def main(out: Path) -> None:
    for name, extra, faults in (("async", [], ""), ("sync", ["run.ckpt_async=false"], ""),
                                ("enospc", [], "enospc@2")):
        os.environ[FAULTS] = faults
        one_run(resolve("pretrain", None, [*TINY, "run.strategy=fsdp", *extra]), out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
