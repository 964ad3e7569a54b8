"""`vit export`: a checkpoint into another library's folder, `hf` (transformers), `onnx` or `timm`.

The recipe the command resolved (stage `export`) holds the checkpoint's own architecture at its
native resolution; the network is built with its own head, so whatever vit reads can be exported.
What a format cannot hold is refused before anything is built or written. The folder is filled under
a temporary name and renamed into place; a non-empty --out is replaced only with --overwrite, and
then set aside first as `<out>.previous-<time>` beside it (not inside: a model folder is uploaded or
loaded as a whole). --out is never --ckpt's folder, inside it, or around it
(runtime.workdir.check_apart).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple

from rich.markup import escape
from safetensors.torch import save_file

from vitcli.checkpoints import card, export_hf, export_onnx, export_timm
from vitcli.checkpoints.describe import CheckpointSpec, describe
from vitcli.checkpoints.read import Loaded, read_checkpoint
from vitcli.checkpoints.transfer import architecture_row, class_names, load_for_eval, preprocessing_row
from vitcli.errors import RecipeError
from vitcli.models import zoo
from vitcli.recipe.choices import EXPORT_FORMATS
from vitcli.recipe.schema import Recipe
from vitcli.runtime.files import MANIFEST
from vitcli.runtime.metrics import console, pairs_table, stdout
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.runtime.workdir import check_apart, check_out_dir, published_dir

PREPROCESSING_FILE = "preprocessing.json"
CARD_FILE = "README.md"  # the model card (checkpoints.card), hf and timm
FILES = {"hf": ["config.json", MODEL_FILE, "preprocessor_config.json", CARD_FILE, MANIFEST],
         "onnx": [export_onnx.ONNX_FILE, PREPROCESSING_FILE, MANIFEST],
         "timm": ["config.json", MODEL_FILE, CARD_FILE, MANIFEST]}


class Card(NamedTuple):
    """What the writers put in the model card besides the checkpoint: model-index's name (the --out
    folder's) and the results gathered."""

    name: str
    results: list[card.Result]


def export(recipe: Recipe, fmt: str, out: Path, *, overwrite: bool = False,
           dry_run: bool = False, results: list[Path] | None = None) -> dict:
    """Write the checkpoint `recipe` names as `fmt` into `out` (or with dry_run only check and say
    what would be written); `results`: folders of evaluations of it, for the model card. Returns
    the report that --json prints."""
    if fmt not in EXPORT_FORMATS:
        raise RecipeError(f"--format {fmt!r}: one of {', '.join(EXPORT_FORMATS)}")
    ckpt = recipe.init.checkpoint
    check_apart(ckpt, out)
    check_out_dir(out, overwrite)
    loaded = read_checkpoint(ckpt)
    spec = describe(loaded, recipe.model.num_heads)
    mae = fmt == "hf" and export_hf.is_mae_encoder(loaded, spec.num_classes)  # to ViTMAEModel
    _refuse(fmt, recipe, spec.num_classes, ckpt, mae)
    if results and fmt == "onnx":
        raise RecipeError("--results: results for a model card; --format onnx writes no card "
                          "(hf and timm do)")
    # where transformers' processors cannot give our pixels: one line, before writing
    mismatch = export_hf.processor_mismatch(preprocessing(recipe)) if fmt == "hf" else ""
    if mismatch:
        console.log(f"[yellow]warning: {escape(mismatch)}")
    # the card's numbers, read (and a bad --results refused) before anything is written
    trained = loaded.meta.get("recipe") or {}
    scored = [] if fmt == "onnx" else card.gather(loaded.path, trained, results or [])
    report = {"checkpoint": ckpt, "format": fmt, "out": str(out), "network": _network(recipe, spec),
              "img_size": recipe.model.img_size, "num_classes": spec.num_classes,
              "class_names": ("the checkpoint's" if class_names(loaded, spec.num_classes)
                              else "indices (the checkpoint names none)"),
              "preprocessing": preprocessing_row(recipe)[1], "files": FILES[fmt], "dry_run": dry_run,
              "set_aside": None, "card_results": [dataclasses.asdict(r) for r in scored],
              "processor_mismatch": mismatch}
    if not dry_run:
        # the whole network, head and pre-logits layer
        model = load_for_eval(recipe, spec.num_classes)
        with published_dir(out.absolute()) as into:
            _WRITERS[fmt](model, recipe, loaded, spec, into.tmp, Card(out.absolute().name, scored))
        report["set_aside"] = str(into.aside) if into.aside else None
        # model.onnx.data, say
        extra = sorted(p.name for p in out.iterdir() if p.name not in FILES[fmt])
        report["files"] = [*FILES[fmt], *extra]
    _print(report)
    return report


def _refuse(fmt: str, recipe: Recipe, num_classes: int, ckpt: str, mae: bool) -> None:
    """The format's one-line refusal of what it cannot hold (onnx holds any network we build, once
    its optional packages are installed); `mae`: hf's target is ViTMAEModel."""
    if fmt == "onnx":
        export_onnx.check_installed()
    elif fmt == "hf":
        export_hf.check_hf(recipe.model, num_classes, ckpt, mae)
    elif fmt == "timm":
        export_timm.check_timm(recipe.model, ckpt)


def _network(recipe: Recipe, spec: CheckpointSpec) -> str:
    """`ViT-Ti/16 (DeiT-Ti / AugReg Ti), grid 2x2` or the model name for what is not a plain ViT."""
    return architecture_row(spec) if spec.name else recipe.model.name


def _class_names(loaded: Loaded, num_classes: int) -> list[str]:
    """The class names, or the indices as names when the checkpoint has none (or a different
    count)."""
    return class_names(loaded, num_classes) or [str(i) for i in range(num_classes)]


def preprocessing(recipe: Recipe) -> dict:
    """The eval preprocessing of the resolved recipe (what the checkpoint says, vitcli.checkpoints.
    preprocessing, under the user's keys), as data.transforms.build_transform runs it: shorter side
    to floor(size / crop_pct) (crop_mode squash: both sides) with data.interpolation, centre crop,
    (x / 255 - mean) / std."""
    d, size = recipe.data, recipe.model.img_size
    return {"size": size, "crop_pct": d.eval_crop_pct, "crop_mode": d.eval_crop_mode,
            "resize_shorter_side": math.floor(size / d.eval_crop_pct), "interpolation": d.interpolation,
            "rescale_factor": 1 / 255, "mean": list(d.mean), "std": list(d.std)}


# ---------------------------------------------------------------- the three formats


def _write_hf(model, recipe: Recipe, loaded: Loaded, spec: CheckpointSpec, out: Path,
              scored: Card) -> None:
    names = _class_names(loaded, spec.num_classes)  # [] for a headless MAE encoder: ViTMAEModel
    prep = preprocessing(recipe)
    weights = export_hf.hf_state_dict(model.state_dict(), recipe.model.depth)
    save_file(weights, str(out / MODEL_FILE), metadata={"format": "pt"})
    config = export_hf.hf_config(recipe.model, names) if names else export_hf.hf_mae_config(recipe.model)
    processor = export_hf.hf_processor_config(prep)
    _write_json(out / "config.json", {**config, **export_hf.hf_processor_in_config(processor)})
    _write_json(out / "preprocessor_config.json", processor)
    target = "ViTForImageClassification" if names else "ViTMAEModel"
    kind = processor["image_processor_type"]
    timm_note = (" (timm's eval transform: `pip install timm`)" if kind == export_hf.PROCESSOR
                 else "")
    usage = [(f"A Vision Transformer exported by `vit export --format hf` (vitcli) for "
              f"transformers' `{target}`: `{target}.from_pretrained(DIR)`; its image processor, "
              f"`AutoImageProcessor.from_pretrained(DIR)`, is transformers' `{kind}`{timm_note}."),
             *([] if names else ["", export_hf.MAE_USE])]
    if mismatch := export_hf.processor_mismatch(prep):
        usage += ["", f"Its pixels are not vitcli's everywhere: {mismatch}."]
    _write_card(out, "transformers", model, recipe, loaded, spec, names, usage, scored)


def _write_onnx(model, recipe: Recipe, loaded: Loaded, spec: CheckpointSpec, out: Path,
                scored: Card) -> None:
    output = export_onnx.write_onnx(model, out, recipe.model.img_size, headless=spec.num_classes == 0)
    about = {"input": export_onnx.INPUT, "input_shape": ["batch", 3, recipe.model.img_size,
                                                         recipe.model.img_size],
             "output": output, **preprocessing(recipe),
             "class_names": _class_names(loaded, spec.num_classes)}
    _write_json(out / PREPROCESSING_FILE, about)


def _write_timm(model, recipe: Recipe, loaded: Loaded, spec: CheckpointSpec, out: Path,
                scored: Card) -> None:
    net = export_timm.timm_model(recipe.model, spec.num_classes)
    names = class_names(loaded, spec.num_classes)  # timm: no names, no labels
    export_timm.write_timm(net, model.state_dict(), out, names, preprocessing(recipe))
    usage = [("A Vision Transformer exported by `vit export --format timm` (vitcli) for timm: "
              "`timm.create_model(\"local-dir:DIR\", pretrained=True)`, or "
              "`\"hf-hub:USER/NAME\"` once uploaded; `timm.data.resolve_data_config({}, "
              "model=model)` gives its preprocessing.")]
    _write_card(out, "timm", model, recipe, loaded, spec, names or [], usage, scored)


def _write_card(out: Path, library: str, model, recipe: Recipe, loaded: Loaded,
                spec: CheckpointSpec, names: list[str], usage: list[str], scored: Card) -> None:
    """README.md, the model card (checkpoints.card)."""
    about = card.About(library, scored.name, _network(recipe, spec), zoo.count_params(model), names,
                       preprocessing(recipe), loaded.meta.get("recipe") or {}, usage,
                       str(loaded.pretrained_cfg.get("license") or ""))
    (out / CARD_FILE).write_text(card.model_card(about, scored.results))


_WRITERS = {"hf": _write_hf, "onnx": _write_onnx, "timm": _write_timm}


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def _print(report: dict) -> None:
    classes = f"{report['num_classes']}, named by {report['class_names']}"
    rows = [("checkpoint", report["checkpoint"]), ("network", report["network"]),
            ("image size", f"{report['img_size']} px"), ("classes", classes),
            ("preprocessing", report["preprocessing"])]
    if report["format"] != "onnx":
        rows.append(("model card", _card_row(report["card_results"])))
    verb = "would write" if report["dry_run"] else "wrote"
    rows.append((verb, ", ".join(f"{report['out']}/{f}" for f in report["files"])))
    stdout.print(pairs_table(f"vit export --format {report['format']}", rows))


def _card_row(results: list[dict]) -> str:
    """`4 results (model-index) from runs/x/summary.json, ...`, or that there are none."""
    if not results:
        return "no results recorded (summary.json) or given (--results): no model-index"
    sources = sorted({r["source"] for r in results})
    return f"{len(results)} results (model-index) from {', '.join(sources)}"
