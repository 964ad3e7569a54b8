"""A folder transformers' ViT wrote is read into timm's names and rebuilt as the same network:
logits equal transformers' own on the same tensors (within 1e-5: float32 through another attention
implementation), its LayerNorm eps honoured, a ViTModel's pooler as timm's pre-logits, and what
timm's ViT cannot be refused in one line naming config.json and the key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.fit import with_grid
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.transfer import class_names, read_rows
from vitcli.errors import CheckpointError
from vitcli.models.zoo import build_model
from vitcli.recipe.schema import ModelConfig

transformers = pytest.importorskip("transformers")

NAMES = {0: "cat", 1: "rocket", 2: "coffee"}
SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
         "image_size": 32, "patch_size": 8}


def _folder(path, cls=None, **config):
    """A transformers ViT with random weights saved by save_pretrained; returns (folder, the
    model)."""
    torch.manual_seed(0)
    cls = cls or transformers.ViTForImageClassification
    labels = {"id2label": NAMES, "label2id": {v: k for k, v in NAMES.items()}}
    model = cls(transformers.ViTConfig(**SIZES, **labels, **config)).eval()
    model.save_pretrained(path)
    return path, model


def _ours(folder, num_classes=3, **changes):
    """The network vitcli builds from the folder, with its weights (what evaluate and predict
    load)."""
    loaded = read_checkpoint(str(folder))
    spec = describe(loaded)
    cfg = ModelConfig(img_size=spec.img_size, **{**spec.architecture(), **changes})
    model = build_model(cfg, num_classes)
    model.load_state_dict(loaded.state_dict)
    return model.eval()


def _tiny_variance(model):
    """Scale the embeddings so the first LayerNorm sees a variance ~1e-12: there 1e-6 and 1e-12 part
    ways."""
    emb = model.vit.embeddings if hasattr(model, "vit") else model.embeddings
    with torch.no_grad():
        for p in (emb.cls_token, emb.position_embeddings, *emb.patch_embeddings.parameters()):
            p.mul_(1e-5)
    return model


@pytest.mark.parametrize("eps", [1e-12, 1e-6])
def test_logits_equal_transformers_with_the_configs_layer_norm_eps(tmp_path, eps):
    _, theirs = _folder(tmp_path / "hf", layer_norm_eps=eps)
    _tiny_variance(theirs).save_pretrained(tmp_path / "hf")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = theirs(pixel_values=x).logits
        got = _ours(tmp_path / "hf")(x)
        other = _ours(tmp_path / "hf", layer_norm_eps=1e-6 if eps < 1e-6 else 1e-12)(x)
    assert (got - want).abs().max().item() < 1e-5
    assert (other - want).abs().max().item() > 1e-2  # the test would see a wrong eps
    assert describe(read_checkpoint(str(tmp_path / "hf"))).layer_norm_eps == eps


def test_class_names_come_from_id2label_and_placeholders_are_none(tmp_path):
    folder, _ = _folder(tmp_path / "named")
    assert class_names(read_checkpoint(str(folder)), 3) == ["cat", "rocket", "coffee"]
    torch.manual_seed(0)
    transformers.ViTForImageClassification(transformers.ViTConfig(**SIZES, num_labels=3)).save_pretrained(
        tmp_path / "placeholders")  # id2label LABEL_0, LABEL_1, LABEL_2
    assert class_names(read_checkpoint(str(tmp_path / "placeholders")), 3) is None


def test_a_vitmodels_pooler_is_timms_pre_logits(tmp_path):
    folder, theirs = _folder(tmp_path / "hf", cls=transformers.ViTModel)
    loaded = read_checkpoint(str(folder))
    spec = describe(loaded)
    assert (spec.num_classes, spec.representation_size, spec.num_heads) == (0, 32, 2)
    ours = _ours(folder, num_classes=0, representation_size=32)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = theirs(pixel_values=x).pooler_output
        got = ours.forward_head(ours.forward_features(x), pre_logits=True)
    assert (got - want).abs().max().item() < 1e-5
    assert ("pre-logits", "pooler.dense -> pre_logits.fc (32 wide, tanh)") in read_rows(loaded)


def test_a_pooler_beside_a_classifier_or_not_tanh_is_dropped_and_said(tmp_path):
    folder, _ = _folder(tmp_path / "relu", cls=transformers.ViTModel, pooler_act="relu")
    loaded = read_checkpoint(str(folder))
    assert describe(loaded).representation_size == 0
    said = ("dropped", "pooler.dense (pooler_act 'relu'; timm's pre-logits is Dense + tanh)")
    assert said in read_rows(loaded)
    pooler = {f"vit.{k}": v for k, v in load_file(folder / "model.safetensors").items() if "pooler" in k}
    both, _ = _folder(tmp_path / "both")
    save_file({**load_file(both / "model.safetensors"), **pooler}, both / "model.safetensors")
    rows = read_rows(read_checkpoint(str(both)))
    assert ("dropped", "pooler.dense (the classifier reads the class token, not the pooler)") in rows


def test_no_qkv_bias_is_zero_biases(tmp_path):
    folder, theirs = _folder(tmp_path / "hf", qkv_bias=False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (_ours(folder)(x) - theirs(pixel_values=x).logits).abs().max().item() < 1e-5
    assert ("filled", "qkv bias zeros (config.json qkv_bias: false; the same network)") in read_rows(
        read_checkpoint(str(folder)))


def test_a_pytorch_model_bin_is_read_weights_only(tmp_path):
    folder, theirs = _folder(tmp_path / "hf")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")  # transformers 4's file
    (folder / "model.safetensors").unlink()
    loaded = read_checkpoint(str(folder))
    assert loaded.kind == "hf" and loaded.path.endswith("pytorch_model.bin")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert (_ours(folder)(x) - theirs(pixel_values=x).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("change, named", [
    ({"hidden_act": "relu"}, 'config.json: hidden_act "relu": timm\'s ViT has exact GELU ("gelu") only'),
    ({"hidden_act": "gelu_new"}, 'hidden_act "gelu_new"'),
    ({"num_channels": 1}, "config.json: num_channels 1: vitcli feeds RGB images (3)"),
    ({"patch_size": [8, 4]}, "config.json: patch_size [8, 4]: only square patches"),
    ({"num_attention_heads": 3}, "num_attention_heads 3: the heads must divide hidden_size 32"),
    ({"architectures": ["ViTForMaskedImageModeling"]},
     'architectures ["ViTForMaskedImageModeling"]: vitcli reads ViTForImageClassification and ViTModel'),
])
def test_what_timms_vit_cannot_be_is_refused_naming_the_file_and_key(tmp_path, change, named):
    folder, _ = _folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match="config.json") as e:
        read_checkpoint(str(folder))
    assert named in str(e.value) and "\n" not in str(e.value)


def test_tensors_beyond_the_config_are_refused(tmp_path):
    folder, _ = _folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"ViT of 1 layers \(config.json\): encoder.layer.1"):
        read_checkpoint(str(folder))


DECLARES = "but transformers' ViTConfig declares"


@pytest.mark.parametrize("change, named", [
    ({"num_hidden_layers": "2"},
     f'num_hidden_layers holds the string "2", {DECLARES} a positive integer (unquoted)'),
    ({"hidden_size": 32.0}, f"hidden_size holds 32.0, {DECLARES} a positive integer"),
    ({"layer_norm_eps": "1e-12"},
     f'layer_norm_eps holds the string "1e-12", {DECLARES} a positive number (unquoted)'),
    ({"qkv_bias": "false"}, f'qkv_bias holds the string "false", {DECLARES} true or false'),
    ({"image_size": [32, "32"]}, f'image_size holds [32, "32"], {DECLARES} a positive integer or'),
    ({"hidden_act": None}, f"hidden_act holds null, {DECLARES} a string"),
    ({"num_attention_heads": True}, "num_attention_heads holds true"),
])
def test_a_config_value_of_the_wrong_type_is_named_with_what_it_should_be(tmp_path, change, named):
    """Once a TypeError traceback (range("2")), exit 1."""
    folder, _ = _folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(folder))
    assert str(e.value).startswith(f"{folder / 'config.json'}: ") and named in str(e.value)
    assert "\n" not in str(e.value)


def test_a_float_key_given_as_an_int_is_read(tmp_path):
    """JSON writers drop the point of 1.0: ViTConfig's float keys take an int."""
    folder, _ = _folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1}))
    assert describe(read_checkpoint(str(folder))).layer_norm_eps == 1.0


def test_a_sharded_folder_is_read_as_the_same_network(tmp_path):
    """save_pretrained(max_shard_size=...): model.safetensors.index.json and its shards."""
    _, theirs = _folder(tmp_path / "whole")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (_ours(tmp_path / "sharded")(x) - theirs(pixel_values=x).logits).abs().max() < 1e-5
    loaded = read_checkpoint(str(tmp_path / "sharded"))
    assert loaded.kind == "hf" and loaded.path.endswith("model.safetensors.index.json")
    assert class_names(loaded, 3) == ["cat", "rocket", "coffee"]


def test_a_sharded_pytorch_model_bin_is_read_weights_only(tmp_path):
    """transformers 4's sharded .bin: pytorch_model-0000i-of-0000n.bin and their index."""
    folder, theirs = _folder(tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, keys in halves.items():
        torch.save({k: tensors[k] for k in keys}, folder / shard)
    index = {"metadata": {}, "weight_map": {k: s for s, keys in halves.items() for k in keys}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert (_ours(folder)(x) - theirs(pixel_values=x).logits).abs().max().item() < 1e-5
    (folder / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match=r"weight_map names shard pytorch_model-00002-of-00002"
                                              r"\.bin, which is not in .*; copy the whole folder"):
        read_checkpoint(str(folder))


def test_the_configs_grid_may_not_be_contradicted_by_init_grid(tmp_path):
    """image_size 32 at patch 8 is a 4x4 grid; the same table read as 2x8 would be scrambled."""
    folder, _ = _folder(tmp_path / "hf")
    loaded = read_checkpoint(str(folder))
    spec = describe(loaded)
    assert spec.grid == (4, 4) and spec.grid_from == "config.json (image_size 32, patch_size 8)"
    assert with_grid(spec, loaded.state_dict, "4x4").grid == (4, 4)
    said = (r"init.grid=2x8 contradicts .*model.safetensors, whose config.json \(image_size 32, "
            r"patch_size 8\) gives the grid 4x4; leave init.grid unset")
    with pytest.raises(CheckpointError, match=said):
        with_grid(spec, loaded.state_dict, "2x8")
