"""A built model as ONNX: `model.onnx` with a dynamic batch axis, input `pixel_values` (B, 3, S, S)
already preprocessed, output `logits` (B, K) (or `features` (B, D) for a headless model).

torch 2.14's `torch.onnx.export` defaults to the dynamo exporter (torch.export, then onnxscript),
which is the maintained path: the TorchScript one is deprecated. It runs offline and needs
`onnxscript` (and `onnx`), an optional extra imported only here. Opset 18 is the dynamo exporter's
default and what onnxruntime >= 1.16 runs. The weights are embedded in the one file up to ViT-L (1.2
GB); above protobuf's 2 GiB limit (ViT-H/14, 2.5 GB) they go to `model.onnx.data` beside it, which
onnxruntime finds by itself.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from vitcli.errors import CheckpointError

ONNX_FILE = "model.onnx"
OPSET = 18
INPUT = "pixel_values"
EXTRA = "pip install 'vitcli[export]'"
NEEDS = ("onnx", "onnxscript")  # optional extras, not runtime dependencies
EMBEDDED_BYTES = 2**31 - 2**27  # protobuf's 2 GiB per file, less room for the graph itself


def write_onnx(model: nn.Module, out: Path, img_size: int, headless: bool) -> str:
    """Export the eval-mode `model` into out/model.onnx; returns its output name."""
    check_installed()
    output = "features" if headless else "logits"
    # batch 2: a batch of 1 would be specialised away
    example = torch.zeros(2, 3, img_size, img_size)
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings(), _quiet_exporter():
        # the exporter's deprecation and tracing chatter is not the user's
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (example,), str(out / ONNX_FILE), input_names=[INPUT],
                          output_names=[output], dynamic_shapes=({0: batch},), opset_version=OPSET,
                          dynamo=True, external_data=_weight_bytes(model) > EMBEDDED_BYTES, verbose=False,
                          report=False)
    return output


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def check_installed() -> None:
    """A CheckpointError naming the install command when the exporter's optional packages are
    missing."""
    # torch.onnx imports them
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise CheckpointError(f"--format onnx needs the '{missing[0]}' package: {EXTRA}")


class _quiet_exporter:
    """The dynamo exporter logs its steps at INFO through `torch.onnx`; a CLI run keeps them off the
    console."""

    def __enter__(self):
        self.logger = logging.getLogger("torch.onnx")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
