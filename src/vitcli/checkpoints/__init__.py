"""The checkpoint layer: every weights file vitcli reads or writes goes through here.

One concept per file, in the order a checkpoint travels:

- `weights.py`: our own final weights (safetensors with the recipe in metadata).
- `state.py`: the layout of a workdir's training states (`state-<step>.pt`, `state-<step>/`): names,
  discovery, rotation, and the whole-file format; `sharded.py`: the sharded (DCP) format.
- `remote.py`: run.ckpt_dir, the checkpoints mirrored to object storage (any fsspec URI): uploaded
  data first and checksum last, kept as the workdir keeps them, fetched back for resume.
- `writer.py`: checkpoint writes one at a time, in a background thread (run.ckpt_async): the state
  staged into host memory the loop waits for, the I/O in the thread, a failure kept for the loop.
- `manager.py`: the one owner of resume: whether and from which checkpoint a run resumes, saving
(whole or
  sharded) with rotation, loading model, optimizer and the train stream's state back.
- `npz.py`: Google's Flax `.npz` (vit_jax and big_vision layouts) renamed to timm's names.
- `pth.py`: a torch.save file (MAE's checkpoints, timm's and DeiT's training files) read with
  weights_only=True, argparse.Namespace allowed by name; MAE's decoder and mask token dropped.
- `hf_vit.py`: transformers' ViT names both ways: the tables export uses, and a folder transformers wrote
  (`ViTForImageClassification`, `ViTModel`) read into timm's names (whole or sharded), its
  config.json checked by type and value.
- `timm_folder.py`: a folder timm's `save_for_hf` wrote: the network its config.json names with
  its model_args, as vit builds it (its own ViT, or the timm name), or one line naming the
  architecture; its label_names.
- `read.py`: `read_checkpoint`, any source (workdir, .safetensors, .npz, .pth, transformers or timm
  folder, Hub name) into timm names; bare pickles are refused.
- `describe.py`: `describe`, the one place that says what network a checkpoint holds
(`CheckpointSpec`).
- `preprocessing.py`: the pixels a checkpoint's weights expect (mean, std, interpolation, eval
crop), and
  where it says so.
- `complete.py`: the torch step of recipe resolution: the starting checkpoint's network fills the
model.
- `fit.py`: `adapt_state_dict`, a checkpoint fitted to a model (head, pre-logits, position
embedding).
- `resize.py`: a file's position embedding resized to a new grid (`vit resize-posemb`'s maths).
- `transfer.py`: starting weights into a built model: the transfer protocol, or the body for
evaluation.
- `export_hf.py`, `export_onnx.py`, `export_timm.py`: a built checkpoint written for another library
  (transformers' ViTForImageClassification, ONNX, timm's own folder), each refusing what it cannot
  hold.
- `card.py`: the model card (README.md) of an hf or timm export: the Hub's front matter with
  `model-index` (the run's summary.json, `vit evaluate`, `vit eval-fewshot`, VTAB), the recipe, the
  preprocessing.

Callers import from the modules; nothing is re-exported here.
"""
