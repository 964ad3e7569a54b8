"""A training run taken onto a SLURM cluster, torch-free (so `--slurm --dry-run` is instant):
slurm.py (the batch script: sbatch's lines from the recipe's slurm section, one task per node
running torchrun with c10d rendezvous on the first node, SLURM's warning forwarded), requeue.py
(what the job does when its step ends: finished, requeued to resume, or failed; one line per
attempt; a hang or a SIGKILL requeued a few times, a user's scancel never), submit.py (the script
and the frozen recipe written into the workdir, then sbatch), launch.py (the job's torchrun, whose
exit code tells a hung or killed rank from a crash; it alone imports torch, on the compute node)."""
