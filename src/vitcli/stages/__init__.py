"""Stage drivers, one per command: each joins the process group once and hands its Dist down.

run.py (one training run, `vit pretrain`: run.build builds it, as it builds every stage's) <
preflight.py (`--preflight`: run.measure's few real steps of that run in a throwaway folder,
run.estimate's whole-run figures, reported) < sweep.py (a run per point of `--sweep`, or per
learning rate of `--lr-sweep`; one table) < search.py (`--search`: an Optuna study whose
trials are runs, the weak ones pruned; the sweep's table) < vtab.py (the VTAB-1k protocol, per
task) < finetune.py
(`vit finetune`: which of them); fewshot.py (`vit eval-fewshot`); inspect.py (`vit inspect`);
plot.py (`vit plot`); resize.py (`vit resize-posemb`); prepare.py (`vit prepare-data`); export.py
(`vit export`); evaluate_extra.py (evaluate's calibration, temperature scaling and test-time
augmentation); evaluate.py (`vit evaluate`: a checkpoint's head on a split)
< predict.py (`vit predict`: on image files); suite.py (`vit evaluate --suite`: every ImageNet set
under a folder); env.py (`vit env`: the machine, for a bug report). Each returns what it reports
(its results file's content, or the file it wrote): the command line prints that and never names a
results file.
"""
