"""The files of a run directory, named once: the stages write them, resume, `vit plot` and the CLI
read them.

Torch-free and import-free, so anything (the CLI included) may ask what a workdir holds. Checkpoints
(`state-<step>.pt`, `state-<step>/`) are named in runtime.run_dir, with the rules of a run directory
(its newest step, whether its run is finished); the checkpoint layer writes, verifies and rotates
them.
"""

from __future__ import annotations

# Every training run (pretrain, finetune, each run of a sweep or of a VTAB task)
# the resolved recipe, as `--dry-run` prints it (dinov2: saved with the run)
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"  # one JSON row per logged step: `step` plus slash-named metrics
SUMMARY_FILE = "summary.json"  # the run's final numbers: what `vit pretrain --json` prints
MODEL_FILE = "model.safetensors"  # the final weights, recipe and model spec in the metadata
CURVES_FILE = "curves.png"  # drawn from metrics.jsonl at the end of the run
TENSORBOARD_DIR = "tensorboard"  # run.loggers=[tensorboard]: event files
WANDB_DIR = "wandb"  # run.loggers=[wandb]: W&B's own folder (offline runs sync from it)
WANDB_ID_FILE = "wandb_id"  # the W&B run id, so a resumed run appends to the same W&B run
# run.loggers=[mlflow] / [trackio]: the tracked run's id (MLflow) or name (trackio), so a resumed
# run continues the same one
MLFLOW_ID_FILE, TRACKIO_ID_FILE = "mlflow_id", "trackio_run"
# one line per rollback past a loss spike, the batches it skipped (train/rollback.py)
ROLLBACKS_FILE = "rollbacks.jsonl"

# What a training run writes at the top of its workdir besides its checkpoints; a replaced run's
# copies are moved aside together (tracker folders too, so a new run's curves start clean).
RUN_OUTPUTS = (RECIPE_FILE, METRICS_FILE, SUMMARY_FILE, MODEL_FILE, CURVES_FILE, TENSORBOARD_DIR, WANDB_DIR,
               WANDB_ID_FILE, ROLLBACKS_FILE, MLFLOW_ID_FILE, TRACKIO_ID_FILE)

# Results of the drivers that run several trainings, and of `vit eval-fewshot`
# `--sweep` and `--lr-sweep`: every point's swept values and final metrics (each point's run is in
# WORKDIR/<point>, named by recipe.grid.point_name)
SWEEP_FILE, SWEEP_CSV = "sweep.json", "sweep.csv"
# `--search`: the Optuna study's journal (optuna.storages.JournalStorage's file: every trial's values,
# reports and state, appended under a lock, so SLURM array tasks share it over NFS); each trial's run
# in WORKDIR/trial-<k>, its table in sweep.json and sweep.csv as a sweep's
SEARCH_JOURNAL = "search.journal"
VTAB_FILE = "vtab.json"  # `--task vtab...`: every task's lr and test top-1
FEWSHOT_FILE, FEWSHOT_CSV, FEWSHOT_PLOT = "results.json", "results.csv", "fewshot.png"
VTAB_FINAL_RUN = "final"  # a swept VTAB task retrains the chosen rate here, and tests it
# `vit evaluate`'s numbers and matrix
EVALUATE_FILE, CONFUSION_PLOT = "results.json", "confusion.png"
RELIABILITY_PLOT = "reliability.png"  # `vit evaluate`'s reliability diagram (softmax models)
# What an evaluation writes, set aside together by --overwrite; results.json first: it marks them
# finished
EVALUATE_OUTPUTS = (EVALUATE_FILE, RECIPE_FILE, CONFUSION_PLOT, RELIABILITY_PLOT)
FEWSHOT_OUTPUTS = (FEWSHOT_FILE, RECIPE_FILE, FEWSHOT_CSV, FEWSHOT_PLOT)
FEATURES_DIR = "features"  # eval-fewshot's feature cache, unless fewshot.cache_dir says where

# A run taken onto SLURM (`--slurm`, vitcli.cluster): in WORKDIR/slurm, the batch script, the recipe
# it runs (frozen when submitted: editing the recipe file later does not change a requeued job), a
# sweep's point directories one per line (array task i runs line i + 1), sbatch's logs, and one line
# per time the job ran
SLURM_DIR = "slurm"
JOB_SCRIPT = "job.sh"
POINTS_FILE = "points"
ATTEMPTS_FILE = "attempts.jsonl"
JOB_ID_FILE = "job_id"  # the last submitted job's id: a second --slurm while it is queued is refused
# sbatch's file patterns: job id; array job and task
SLURM_LOG, SLURM_ARRAY_LOG = "%j.out", "%A_%a.out"
