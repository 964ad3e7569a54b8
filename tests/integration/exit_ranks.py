"""What test_job_exits.py runs under torchrun in place of `vit`: cli.main() with the arguments after
OUT, then how this rank left, in OUT/rank<r>.json: its exit code and whether its process group was
gone. With NCCL a group still there at exit prints torch's "destroy_process_group() was not called"
(and may hang); Gloo, which a CPU test has, says nothing, so the test reads this instead:
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integration/exit_ranks.py \
OUT pretrain ...`."""

import json
import os
import sys
from pathlib import Path

import torch.distributed

from vitcli import cli

if __name__ == "__main__":
    out = Path(sys.argv[1])
    sys.argv = ["vit", *sys.argv[2:]]
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    left = not torch.distributed.is_initialized()
    report = {"code": code, "left_group": left}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
    sys.exit(code)
