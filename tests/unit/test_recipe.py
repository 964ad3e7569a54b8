"""Recipes: precedence, coercion, strictness, cross-field checks, and every shipped recipe
resolving."""

import re

import pytest
from timm.data.auto_augment import rand_augment_transform

from helpers import REPO
from vitcli.checkpoints.complete import complete
from vitcli.data.rows import synthetic, tasks
from vitcli.errors import RecipeError, VitcliError
from vitcli.recipe.choices import LABEL_RULES, SYNTHETIC_MAX_CLASSES
from vitcli.recipe.data_checks import check_randaugment
from vitcli.recipe.layers import parse_overrides, read_yaml, to_dict, to_yaml
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import micro_batches


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_precedence_defaults_then_file_then_overrides(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 3.0e-3\n  weight_decay: 0.3\n"
                        "schedule:\n  steps: 100\n  warmup_steps: 5\n")
    r = resolve("pretrain", p, ["optim.lr=1e-4"])
    assert r.optim.lr == pytest.approx(1e-4)  # override beats file
    assert r.optim.weight_decay == pytest.approx(0.3)  # file beats default
    assert r.optim.beta2 == pytest.approx(0.999)  # default survives


def test_yaml_string_floats_are_coerced(tmp_path):
    # PyYAML reads 1e-3 (no dot) as the string "1e-3".
    p = write(tmp_path, "optim:\n  lr: 1e-3\nschedule:\n  steps: 1e4\n  warmup_steps: 10\n")
    r = resolve("pretrain", p)
    assert isinstance(r.optim.lr, float) and r.optim.lr == pytest.approx(1e-3)
    assert r.schedule.steps == 10000 and isinstance(r.schedule.steps, int)


def test_list_override_from_comma_string():
    r = resolve("pretrain", None, ["fewshot.shots=1,5,10", "schedule.steps=10", "schedule.warmup_steps=1"])
    assert r.fewshot.shots == [1, 5, 10]


def test_finetune_stage_defaults_are_the_paper_protocol():
    r = resolve("finetune", None, ["schedule.steps=1000"])
    assert ((r.optim.name, r.optim.momentum, r.optim.weight_decay, r.optim.clip_grad_norm)
            == ("sgd", 0.9, 0.0, 1.0))
    assert (r.data.batch_size, r.model.img_size, r.schedule.decay) == (512, 384, "cosine")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("optim:\n  lrr: 0.1\n", "unknown recipe key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("modle:\n  depth: 2\n", "unknown recipe key 'modle'; did you mean 'model'?"),
        ("data:\n  synthetic:\n    num_clases: 3\n",
         "'data.synthetic.num_clases'; did you mean 'data.synthetic.num_classes'"),
        ("data:\n  batch_size: lots\n", "data.batch_size: expected int, got 'lots'"),
        ("data:\n  hflip: maybe\n", "data.hflip: expected bool, got 'maybe'"),
        ("model:\n  pool: max\n", "model.pool: 'max' is not one of token, gap"),
        ("schedule:\n  steps: 10\n  warmup_steps: 10\n",
         "schedule.warmup_steps=10 must be smaller than schedule.steps=10"),
        ("model:\n  img_size: 30\n  patch_size: 4\n",
         "model.img_size=30 is not a multiple of 4 (the patch size of custom)"),
        ("data:\n  batch_size: 100\n  micro_batch_size: 32\n", "data.batch_size=100 is not divisible"),
    ],
)
def test_bad_recipes_name_the_key(tmp_path, text, fragment):
    p = write(tmp_path, text + ("schedule:\n  steps: 100\n  warmup_steps: 1\n"
                                if "schedule" not in text else ""))
    with pytest.raises(RecipeError) as e:
        resolve("pretrain", p)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_malformed_yaml_reports_line(tmp_path):
    p = write(tmp_path, "model:\n  depth: 2\n  heads: [1, 2\n")
    with pytest.raises(RecipeError, match=r"malformed YAML at line \d+"):
        resolve("pretrain", p)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        resolve("pretrain", tmp_path / "nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(RecipeError, match="not KEY=VALUE"):
        parse_overrides(["optim.lr"])


def test_accumulation_steps():
    r = resolve("pretrain", None, ["data.batch_size=4096", "data.micro_batch_size=64", "schedule.steps=10",
                           "schedule.warmup_steps=1"])
    assert micro_batches(r) == (64, 64)
    assert micro_batches(r, world_size=4) == (64, 16)
    r = resolve("pretrain", None, ["data.batch_size=4096", "schedule.steps=10", "schedule.warmup_steps=1"])
    assert micro_batches(r, world_size=4) == (1024, 1), "micro_batch_size 0: the batch split over processes"


def test_round_trip_through_dict_and_yaml():
    import yaml

    r = resolve("pretrain", None, ["optim.lr=0.02", "fewshot.tasks=vtab/dtd,synthetic", "schedule.steps=10",
                                   "schedule.warmup_steps=1"], complete=complete)
    assert yaml.safe_load(to_yaml(r)) == to_dict(r)
    flat_overrides = [f"{k}={v}" for k, v in flat(to_dict(r)).items() if k != "stage"]
    assert resolve("pretrain", None, flat_overrides, complete=complete) == r


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO) for p in (REPO / "recipes").rglob("*.yaml")),
                         ids=str)
def test_every_shipped_recipe_resolves(path):
    """Each shipped recipe resolves for the stage it says (checks passed, model named), nothing is
    built."""
    text = (REPO / path).read_text()
    stage = next((s for s in ("finetune", "pretrain") if f"stage: {s}" in text), "eval-fewshot")
    r = resolve(stage, REPO / path, complete=complete, inputs=False)  # eval-fewshot's --ckpt: the command's
    assert r.stage == stage
    assert text.lstrip().startswith("#"), (
        "a shipped recipe starts with a header: what, command, expected result")


@pytest.mark.parametrize("command, says", [("pretrain", "finetune"), ("eval-fewshot", "pretrain"),
                                            ("finetune", "pretrain"), ("inspect", "eval-fewshot"),
                                            ("export", "pretrain"), ("evaluate", "finetune")])
def test_a_recipe_for_another_stage_is_refused_naming_both(tmp_path, command, says):
    p = write(tmp_path, f"stage: {says}\nschedule:\n  steps: 10\n  warmup_steps: 1\n")
    with pytest.raises(RecipeError) as e:
        resolve(command, p)
    assert f"says stage: {says}" in str(e.value) and f"`vit {command}`" in str(e.value)


@pytest.mark.parametrize("says", ["pretrain", "finetune", "eval-fewshot"])
def test_prepare_data_takes_the_data_section_of_a_recipe_of_any_stage(tmp_path, says):
    """`vit prepare-data -r` reads a training recipe's data section; its other sections are not its
    to check (their keys and types aside), and the stage stays the command's."""
    p = write(tmp_path, f"stage: {says}\nmodel:\n  name: vit_tiny_patch16_224\n  img_size: 30\n"
                        "data:\n  image_column: img\n  batch_size: 7\n")
    r = resolve("prepare-data", p, ["data.label_column=fine_label"], {"data.source": "synthetic"})
    assert (r.stage, r.data.image_column, r.data.label_column, r.data.batch_size) == (
        "prepare-data", "img", "fine_label", 7)
    assert r.model.name == "custom" and r.model.img_size == 224  # not read: no timm, no size check


@pytest.mark.parametrize("text, overrides, fragment", [
    ("data:\n  image_colum: img\n", [], "did you mean 'data.image_column'"),
    ("model:\n  depht: 2\n", [], "unknown recipe key 'model.depht'"),  # a section it does not read
    ("stage: pretrian\n", [], "stage: 'pretrian' is not one of"),
    ("", ["model.depth=2"], "model.depth=2: `vit prepare-data` reads only the data.* keys"),
])
def test_prepare_data_refuses_unknown_keys_anywhere_and_overrides_of_other_sections(tmp_path, text,
                                                                                     overrides,
                                                                                     fragment):
    with pytest.raises(RecipeError, match=re.escape(fragment)):
        resolve("prepare-data", write(tmp_path, text), overrides, {"data.source": "synthetic"})


def test_a_stage_without_labels_to_read_takes_an_empty_label_column():
    """Few-shot, inspect, export and prepare-data read no split's labels (an unlabelled folder
    will do); training and evaluate do."""
    for stage in ("prepare-data", "inspect", "export"):
        resolve(stage, None, ["data.label_column="], inputs=False)
    with pytest.raises(RecipeError, match="data.label_column is empty"):
        resolve("evaluate", None, ["data.label_column="], inputs=False)


@pytest.mark.parametrize("stage", ["inspect", "export", "evaluate", "predict"])
def test_a_stage_that_runs_a_checkpoint_needs_one(stage):
    with pytest.raises(RecipeError, match=f"{stage} needs weights: pass --ckpt"):
        resolve(stage, None, [])


def test_the_command_decides_the_stage_and_its_defaults(tmp_path):
    p = write(tmp_path, "schedule:\n  steps: 10\n  warmup_steps: 1\n")  # no stage: line
    assert resolve("eval-fewshot", p, inputs=False).stage == "eval-fewshot"
    finetune = resolve("finetune", p)
    assert (finetune.stage, finetune.optim.name, finetune.model.img_size) == ("finetune", "sgd", 384)


def test_flags_are_the_top_layer_and_none_means_not_given():
    r = resolve("pretrain", None, ["model.img_size=64", "schedule.steps=10", "schedule.warmup_steps=1"],
                {"model.img_size": 96, "fewshot.seeds": None})
    assert r.model.img_size == 96 and r.fewshot.seeds == 3


@pytest.mark.parametrize("overrides, fragment", [
    (["model.img_size=36", "model.patch_size=8"],
     "model.img_size=36 is not a multiple of 8 (the patch size of custom)"),
    (["model.embed_dim=30", "model.num_heads=2", "model.pos_embed=sincos_2d"], "model.pos_embed=sincos_2d"),
    (["model.embed_dim=30", "model.num_heads=4"], "model.embed_dim=30 is not divisible by model.num_heads=4"),
    (["model.name=BiT-R50x1", "model.representation_size=8"], "representation_size"),
    (["model.name=T2T-ViT-14", "model.layer_norm_eps=1e-12"],
     "model.layer_norm_eps=1e-12 is only honoured by the paper's ViTs, the hybrid and custom"),
    (["model.layer_norm_eps=0"], "model.layer_norm_eps"),
    (["data.eval_crop_mode=border"], "data.eval_crop_mode: 'border' is not one of center, squash"),
    (["model.name=T2T-ViT-14", "model.img_size=200"],
     "model.img_size=200 is not a multiple of 16 (the patch size of T2T-ViT-14)"),
    (["model.pos_embed=sincos_1d"], "model.pos_embed: 'sincos_1d' is not one of"),
    (["init.posemb_method=nearest"], "init.posemb_method: 'nearest' is not one of bilinear, bicubic"),
    (["fewshot.l2_reg=-1"], "fewshot.l2_reg"),
    (["fewshot.resize=32"], "fewshot.resize=32 is below 224"),  # a size at 224 px, not in pixels of the model
    (["init.random=true"], "init.random applies to eval-fewshot only"),
    (["init.grid=5x"], "init.grid='5x': expected HxW"),
    (["optim.weight_decay_convention=optax"],
     "optim.weight_decay_convention: 'optax' is not one of torch, big_vision"),
    (["run.compile=atuo"], "run.compile: 'atuo' is not one of auto, true, false"),
    (["run.compile=1"], "run.compile: '1' is not one of auto, true, false"),
])
def test_impossible_architectures_and_values_are_refused_at_resolve_time(overrides, fragment):
    with pytest.raises(RecipeError, match=re.escape(fragment)):
        resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1", *overrides])


@pytest.mark.parametrize(("text", "expected"), [
    ("", "auto"), ("  compile: auto", "auto"), ("  compile: true", True), ("  compile: false", False),
    ("  compile: 'True'", True),
])
def test_run_compile_is_auto_true_or_false_from_a_file_or_an_override(tmp_path, text, expected):
    path = tmp_path / "r.yaml"
    path.write_text(f"run:\n{text}\n" if text else "")
    assert resolve("pretrain", path, inputs=False).run.compile == expected
    if text:  # the same value as an override, and back through the YAML a run saves
        override = resolve("pretrain", None, [f"run.compile={text.split(': ')[1]}"], inputs=False)
        assert override.run.compile == expected
        saved = tmp_path / "saved.yaml"
        saved.write_text(to_yaml(override))
        assert resolve("pretrain", saved, inputs=False).run.compile == expected


def flat(d: dict, prefix: str = "") -> dict:
    """Nested recipe dict -> {dotted key: value}, lists as comma strings (the override syntax)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = ",".join(map(str, v)) if isinstance(v, list) else v
    return out


# ---------------------------------------------------------------- the four bad inputs, checks
# needing no data


@pytest.mark.parametrize("text, line, key", [
    ("optim:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n", 4, "lr"),  # yaml.safe_load would keep 0.2
    ("optim:\n  lr: 0.1\nschedule:\n  steps: 10\noptim:\n  name: sgd\n", 5, "optim"),
])
def test_a_key_given_twice_in_a_recipe_file_names_the_file_line_and_key(tmp_path, text, line, key):
    p = write(tmp_path, text)
    with pytest.raises(RecipeError, match=re.escape(f"{p}: line {line}: '{key}' is given twice")):
        resolve("pretrain", p)


def test_a_recipe_is_read_as_safe_load_reads_it_python_tags_refused(tmp_path):
    text = "run:\n  seed: !!python/object/apply:os.system ['echo owned']\n"
    with pytest.raises(RecipeError, match="malformed YAML at line 2"):
        read_yaml(write(tmp_path, text))
    plain = "model: {name: ViT-B/16, dims: [1, 2.5, null, true]}\n"  # scalars are text, null aside
    assert read_yaml(write(tmp_path, plain)) == {"model": {"name": "ViT-B/16", "dims": ["1", "2.5", None,
                                                                                       "true"]}}


def test_yaml_merge_keys_are_not_keys_given_twice(tmp_path):
    text = "a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n"  # a merge that the mapping overrides
    assert read_yaml(write(tmp_path, text))["b"] == {"x": "3", "y": "2"}  # text, read by their keys


@pytest.mark.parametrize("overrides, fragment", [
    (["data.synthetic.train_size=-5"], "data.synthetic.train_size must be >= 0, got -5"),
    (["data.synthetic.val_size=-1"], "data.synthetic.val_size must be >= 0, got -1"),
    (["data.synthetic.test_size=0"],
     "data.synthetic.test_size=0 leaves split 'test' (data.test_split) empty"),
    (["data.synthetic.num_classes=31"], "data.synthetic.num_classes=31 must be between 2 and 30"),
    (["data.synthetic.img_size=4"], "data.synthetic.img_size=4 is too small"),
    (["data.val_split=dev"], "synthetic: no split 'dev'; available: train, validation, test"),
    (["data.source="], "data.source is empty"),
    (["data.synthetic.train_size=16", "data.batch_size=32"],
     "data.batch_size=32 is larger than the train split (16 images, data.synthetic.train_size)"),
    (["data.streaming=true", "data.train_split=train[:50%]"], "slices and '+' need random access"),
    (["data.streaming=true", "data.label_rule=clevr_count"], "needs the whole split"),
    (["data.shuffle_buffer=0"], "data.shuffle_buffer must be positive"),
    (["schedule.steps=0", "schedule.epochs=0"], "set schedule.steps or schedule.epochs (both are 0)"),
    (["schedule.steps=0", "schedule.epochs=1", "data.streaming=true"],
     "data.streaming=true needs schedule.steps"),
    (["fewshot.custom.name=mine"], "fewshot.custom.source is empty: say where task 'mine' reads its data"),
    (["data.label_rule=clevr_counts"], "data.label_rule 'clevr_counts' is not one of clevr_count"),
])
def test_data_and_length_are_refused_at_resolve_time(overrides, fragment):
    with pytest.raises(VitcliError, match=re.escape(fragment)):
        resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1", "data.batch_size=8",
                                   *overrides])


def test_a_tar_source_trains_as_a_stream_and_an_explicit_false_is_refused_naming_the_way_out(tmp_path):
    """WebDataset shards loaded whole would be copied into HF's cache first: a training stage
    streams them (the resolved recipe, saved with the run, says so); a user's data.streaming=false
    is one line; a stage that does not train (prepare-data) is left as it is."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train-0.tar").write_bytes(b"")
    base = ["schedule.steps=10", "schedule.warmup_steps=1", "data.val_split=", "data.test_split="]
    for source in (str(tmp_path / "shards"), str(tmp_path / "shards" / "train-{0..0}.tar"),
                   "/anywhere/train-*.tar"):
        assert resolve("pretrain", None, [*base, f"data.source={source}"]).data.streaming, source
    refused = r"data.streaming=false: .* is WebDataset tar shards, .*vit prepare-data"
    with pytest.raises(VitcliError, match=refused):
        resolve("pretrain", None, [*base, f"data.source={tmp_path / 'shards'}", "data.streaming=false"])
    with pytest.raises(VitcliError, match=re.escape("data.streaming=true (a tar-shard source streams) needs "
                                                    "schedule.steps")):
        resolve("pretrain", None, ["schedule.epochs=1", "schedule.warmup_steps=1", "data.source=/d/x.tar"])
    assert not resolve("prepare-data", None, [f"data.source={tmp_path / 'shards'}"]).data.streaming
    assert not resolve("pretrain", None, [*base, f"data.source={tmp_path}"]).data.streaming  # no tar in it


def test_a_sliced_train_split_of_the_built_in_data_is_counted_when_loaded():
    """train[:10%] of 64 images holds 6: known only once sliced, so run.build.build_job refuses it
    (before it writes anything); resolve lets it through."""
    r = resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1", "data.batch_size=8",
                                   "data.synthetic.train_size=64", "data.train_split=train[:10%]"])
    assert r.data.train_split == "train[:10%]"


def test_eval_fewshot_needs_a_checkpoint_and_tasks():
    with pytest.raises(RecipeError, match="eval-fewshot needs weights: pass --ckpt"):
        resolve("eval-fewshot", None, ["fewshot.tasks=synthetic"])
    with pytest.raises(RecipeError, match="no tasks: pass --tasks"):
        resolve("eval-fewshot", None, ["init.checkpoint=somewhere"])  # refused before the checkpoint is read
    assert resolve("eval-fewshot", None, [], inputs=False).stage == "eval-fewshot"


def test_a_recipe_that_needs_torch_to_complete_asks_for_the_step():
    with pytest.raises(TypeError, match="complete="):
        resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1",
                                   "model.name=vit_tiny_patch16_224"])


def test_the_values_checked_at_resolve_time_are_those_the_data_layer_knows():
    assert SYNTHETIC_MAX_CLASSES == len(synthetic.SHAPES) * len(synthetic.TEXTURES)
    assert LABEL_RULES == tuple(tasks.LABEL_RULES)


def augment_signature(spec: str) -> tuple:
    ra = rand_augment_transform(spec, {})
    ops = [(op.name, op.magnitude, op.magnitude_std, op.magnitude_max, op.prob) for op in ra.ops]
    return ra.num_layers, ops


@pytest.mark.parametrize("section", ["m9", "n3", "mstd0.5", "mmax20", "inc1", "p0.3"])
def test_each_randaugment_section_we_accept_is_one_timm_parses_and_uses(section):
    """Our grammar (vitcli.recipe.data_checks), held against timm's own parser: each section we
    accept changes the transform timm builds, so none is ignored."""
    check_randaugment(f"rand-{section}")
    assert augment_signature(f"rand-{section}") != augment_signature("rand")


@pytest.mark.parametrize("spec", ["rand-mag9", "rand-m9-mst0.5", "rand-w0", "rand-x3"])
def test_a_randaugment_section_timm_refuses_when_it_builds_is_refused_at_resolve_time(spec):
    with pytest.raises(AssertionError):
        rand_augment_transform(spec, {})  # timm: only when the run builds its transforms
    with pytest.raises(VitcliError, match=re.escape(f"data.randaugment: cannot parse '{spec}'")):
        check_randaugment(spec)


def test_a_randaugment_section_timm_would_skip_is_refused():
    assert augment_signature("rand-m") == augment_signature("rand")  # timm skips a section without a number
    with pytest.raises(VitcliError, match="section 'm'"):
        check_randaugment("rand-m")


@pytest.mark.parametrize("batch, micro, world",
                         [(63, 0, 2), (100, 32, 1), (64, 24, 2), (5, 0, 8), (96, 7, 4)])
def test_batch_advice_that_is_followed_resolves(batch, micro, world):
    """The refusal names values (`such as M`, `use ... (A or B)`); the recipe with the first one
    resolves."""
    base = ["schedule.steps=10", "schedule.warmup_steps=1", f"data.batch_size={batch}",
            f"data.micro_batch_size={micro}"]
    with pytest.raises(RecipeError) as e:
        resolve("pretrain", None, base, world_size=world)
    message = str(e.value)
    if "such as" in message:
        fix = f"data.micro_batch_size={message.rsplit('such as ', 1)[1]}"
    else:
        fix = f"data.batch_size={message.rsplit('(', 1)[1].split()[0].rstrip(')')}"
    resolve("pretrain", None, [*base, fix], world_size=world)  # the advice, followed


def test_a_size_the_model_name_fixes_is_refused_not_overridden(tmp_path):
    """`model.name: ViT-L/16` in a file and `model.embed_dim=32` on the command line trained ViT-L
    (606M parameters) silently; now the contradiction is refused, naming both, and `custom` sizes it."""
    path = tmp_path / "r.yaml"
    path.write_text("schedule:\n  steps: 2\n  warmup_steps: 1\nmodel:\n  name: ViT-L/16\n")
    with pytest.raises(RecipeError, match=r"model.embed_dim=32 contradicts model.name=ViT-L/16, whose "
                                          r"embed_dim is 1024.*model.name=custom"):
        resolve("pretrain", path, ["model.embed_dim=32"], complete=complete)
    assert resolve("pretrain", path, ["model.name=custom", "model.embed_dim=32", "model.num_heads=2"],
                   complete=complete).model.embed_dim == 32
    # a size equal to the name's is no contradiction; a file's custom sizes yield to a name given later
    assert resolve("pretrain", path, ["model.embed_dim=1024"], complete=complete).model.name == "ViT-L/16"
    path.write_text("schedule:\n  steps: 2\n  warmup_steps: 1\n"
                    "model:\n  name: custom\n  embed_dim: 32\n  depth: 1\n")
    assert resolve("pretrain", path, ["model.name=ViT-S/16"], complete=complete).model.embed_dim == 384
    with pytest.raises(RecipeError, match=r"model.depth=1 contradicts model.name=ViT-S/16"):
        resolve("pretrain", path, ["model.name=ViT-S/16", "model.depth=1"], complete=complete)


def test_a_size_a_timm_name_fixes_is_refused_too():
    """deit_tiny_patch16_224 with model.embed_dim=32 built DeiT-Ti (192 wide) as silently."""
    steps = ["schedule.steps=2", "schedule.warmup_steps=1"]
    with pytest.raises(RecipeError, match=r"model.embed_dim=32 contradicts model.name=deit_tiny_patch16_224, "
                                          r"whose embed_dim is 192"):
        resolve("pretrain", None, [*steps, "model.name=deit_tiny_patch16_224", "model.embed_dim=32"],
                complete=complete)
    assert resolve("pretrain", None, [*steps, "model.name=deit_tiny_patch16_224", "model.embed_dim=192"],
                   complete=complete).model.depth == 12
