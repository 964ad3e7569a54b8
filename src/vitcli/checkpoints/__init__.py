"""The checkpoint layer: every weights file vitcli reads or writes goes through here.

One concept per file, in the order a checkpoint travels:

- `files.py`: our own files (safetensors with the recipe in metadata, the resumable state) written atomically.
- `state.py`: the workdir's last `run.keep_checkpoints` training states and the latest good one, for resuming.
- `npz.py`: Google's Flax `.npz` (vit_jax and big_vision layouts) renamed to timm's names.
- `read.py`: `read_checkpoint`, any source (workdir, .safetensors, .npz, Hub name) into timm names; pickles
  are refused.
- `describe.py`: `describe`, the one place that says what network a checkpoint holds (`CheckpointSpec`).
- `fit.py`: `adapt_state_dict`, a checkpoint fitted to a model (head, pre-logits, position embedding).
- `resize.py`: `vit resize-posemb`, the position embedding of a file resized once, offline.

Callers import from the modules; nothing is re-exported here.
"""
