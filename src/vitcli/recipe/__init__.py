"""Recipes, from the command line to the checked experiment, without torch: choices.py (the closed
sets of values, each a Literal) < schema.py (the typed dataclasses, every key's default) < layers.py
(YAML files and overrides read as typed, merged and coerced onto them, written back) < names.py
(model names -> sizes) < data_checks.py (the data keys, checked without data), holdout_checks.py
(data.holdout and its split), fewshot_checks.py (the fewshot section's), objective_checks.py (the
objectives' keys), cluster_checks.py (the slurm section's), rollback_checks.py (a rollback past
a loss spike: its keys, data.skip_steps read into windows) < checks.py (every value check, one
RecipeError naming the key) < resolve.py (defaults < file < overrides < flags, then checked) <
grid.py (a sweep's `--sweep KEY=V1,V2` options -> its named points) < space.py (a search's
`--search KEY=DIST` options -> the distributions its trials draw from)."""
