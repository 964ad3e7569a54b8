"""The one training loop and what it is made of: schedule.py (lr), optim.py, objectives.py (what is
minimised), distill.py (a frozen teacher's logits beside the labels), interrupt.py (Ctrl-C and SIGTERM),
parallelize.py (DDP/FSDP2, activation checkpointing), throughput.py (time waiting for data: input-bound or
not), ema.py (the weight EMA), trial.py (a micro-batch's steps in a process of its own, and their peak
memory), micro_batch.py (data.micro_batch_size auto: the largest that fits, found by trials), loop.py;
cost.py (what a whole run will cost from a few of its steps: the arithmetic of `--preflight`)."""
