"""The one training loop and what it is made of: schedule.py (lr), optim.py, losses.py (the
classification loss), distill.py (a frozen teacher's logits beside the labels), interrupt.py (Ctrl-C
and SIGTERM), parallelize.py (DDP/FSDP2, activation checkpointing), throughput.py (time waiting for
data: input-bound or not), ema.py (the weight EMA), watchdog.py (a step that hangs: stacks dumped,
exit 75 for a restart), rollback.py (a loss spike: back to the newest checkpoint, the batches since
skipped), loop.py; cost.py (what a whole run will cost from a few of its steps: the arithmetic of
`--preflight`)."""
