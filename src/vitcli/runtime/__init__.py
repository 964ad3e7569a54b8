"""What every stage runs on: allocator.py (glibc told to reuse what a process frees), run_files.py
(the files of a run directory, named once), run_dir.py (its rules: checkpoints by name, finished,
the keys that do not change a result), precision.py (and run.compile's auto), peak.py (a device's
peak FLOP/s, for MFU), memory.py (peak resident memory of a run and of its loader workers), files.py
(atomic writes, checksums), metrics.py (metrics.jsonl, the console, the progress bar, tables),
trackers.py (TensorBoard, W&B, trackio), trackers_mlflow.py (MLflow), launcher.py (torchrun's rank
and world sizes, read once), dist.py
(processes and devices), threads.py (CPU threads on a shared machine), workdir.py (output locations
checked before anything is written), finished.py (a finished evaluation read, not run again),
faults.py (faults injected on purpose by VITCLI_FAULTS, for the fault tests and the soak),
environment.py (what `vit env` reports of the machine, secrets redacted; the cache directory's
rule)."""
