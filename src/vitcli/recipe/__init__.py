"""Recipes, from the command line to the checked experiment: schema.py (typed dataclasses, YAML, overrides) <
checks.py (every value check, one RecipeError naming the key) < resolve.py (defaults < file < overrides <
flags, then checked)."""
