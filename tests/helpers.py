"""What several test modules share: the repository root, the `vit` entry point run in-process, the
2-process rank scripts run under torchrun, a run SIGKILLed at a checkpoint, tiny models and their
Google `.npz` and MAE `.pth` files, a run stopped as Ctrl-C stops it, damaged files, warnings read
off the console. Fixtures live in conftest.py."""

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from vitcli import cli
from vitcli.stages.run import one_run
from vitcli.train import loop

REPO = Path(__file__).resolve().parents[1]


def snapshot(root: Path) -> dict:
    """Every path under `root` with its mtime and size: what a refused command must leave as it was."""
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def refused(monkeypatch, capsys, root: Path, *args) -> str:
    """Run `vit ARGS...` in `root` (where a default output would land) and check it refuses as bad
    input must: exit 2, one line, no traceback, nothing under `root` created or changed; its line."""
    monkeypatch.chdir(root)
    before = snapshot(root)
    code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert snapshot(root) == before, "a refused command created or changed a file"
    return err


def run_vit(monkeypatch, capsys, *args):
    """Run `vit ARGS...` through cli.main(); return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["vit", *map(str, args)])
    monkeypatch.delenv("VITCLI_DEBUG", raising=False)
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


# the last line of a traceback, as torchrun prints a rank's
RAISED = re.compile(r"(\[rank\d+\]: )?[\w.]+(Error|Exception): ")


def run_ranks(script: Path, out: Path) -> None:
    """`script OUT` on 2 processes under torchrun (Gloo on the CPU, one intra-op thread each, the
    script's folder importable for its helpers). If a process fails: the first exception line any
    rank printed (the end of stderr may be torchrun's report or a long message) and the end of
    stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(script.parent)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    raised = [line for line in proc.stderr.splitlines() if RAISED.match(line)]
    assert proc.returncode == 0, "\n".join([*raised[:1], proc.stderr[-3000:]])


def kill_when(env: dict, cmd: list[str], path: Path) -> None:
    """Start `cmd` in its own process group and SIGKILL every process it started (torchrun and its
    ranks, loader workers) as soon as `path` exists, as a pre-empted node dies: no signal handler,
    no final checkpoint."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_tree(proc.pid)
    proc.wait()
    assert path.exists(), "the run ended before its checkpoint appeared"
    assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed"


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, read from /proc. torchrun starts each rank in a session of
    its own, so a signal to torchrun's process group reaches none of them."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        for children in Path(f"/proc/{found[-1]}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # a process that has just exited
                todo += [int(child) for child in children.read_text().split()]
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and that of every process below it (a rank's loader workers are
    in its group), then wait until none is left running: a rank of a killed torchrun would otherwise
    train on, still writing into the run directory that the test resumes next."""
    tree, groups = process_tree(pid), set()
    for p in tree:
        with contextlib.suppress(ProcessLookupError):  # one that has exited since
            groups.add(os.getpgid(p))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_running(p) for p in tree[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(pid: int) -> bool:
    """Whether `pid` is still there and not a zombie (one exited, waiting for its parent to reap
    it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


D, HEADS, MLP, PATCH = 32, 2, 64, 8


def save_photographs(folder: Path, names) -> list[Path]:
    """scikit-image's sample photographs `names` (astronaut, coffee, ...) as PNGs in folder, sorted: real
    pictures for the preprocessing and folder tests (scikit-image is in the test extra)."""
    from PIL import Image
    from skimage import data

    for name in names:
        Image.fromarray(getattr(data, name)()).save(folder / f"{name}.png")
    return sorted(folder.iterdir())


def tiny_vit(img_size=32, num_classes=5, seed=0, **kw) -> VisionTransformer:
    """A 2-block ViT with every parameter random (timm zero-inits some, which would hide
    mix-ups)."""
    torch.manual_seed(seed)
    kw = {"embed_dim": D, "depth": 2, "num_heads": HEADS, "mlp_ratio": MLP / D, **kw}
    model = VisionTransformer(img_size=img_size, patch_size=PATCH, num_classes=num_classes, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def mae_sincos_reference(embed_dim: int, grid_size: int) -> np.ndarray:
    """MAE's util/pos_embed.py get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=True),
    restated in numpy as it is written there: its h/w naming is swapped, so the first half encodes
    the column."""
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])

    def one_d(dim, pos):
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)


# main_pretrain.py's argparse defaults and what init_distributed_mode adds, as a run's checkpoint
# pickles them
MAE_ARGS = {"batch_size": 64, "epochs": 800, "accum_iter": 1, "model": "mae_vit_base_patch16",
            "input_size": 32, "mask_ratio": 0.75, "norm_pix_loss": True, "weight_decay": 0.05, "lr": None,
            "blr": 1.5e-4, "min_lr": 0.0, "warmup_epochs": 40, "data_path": "/datasets01/imagenet_full_size/",
            "output_dir": "./output_dir", "log_dir": "./output_dir", "device": "cuda", "seed": 0,
            "resume": "", "start_epoch": 0, "num_workers": 10, "pin_mem": True, "world_size": 64,
            "local_rank": -1, "dist_on_itp": False, "dist_url": "env://", "distributed": True}


def mae_encoder(seed=0) -> VisionTransformer:
    """A tiny headless ViT as MAE's encoder: every weight random, the position table MAE's fixed
    one."""
    model = tiny_vit(num_classes=0, seed=seed)
    with torch.no_grad():
        grid = model.patch_embed.grid_size[0]
        model.pos_embed.copy_(torch.from_numpy(mae_sincos_reference(D, grid)).float()[None])
    return model


def mae_pth(path, encoder, layout="pretrain", extra=None):
    """`encoder` saved as facebookresearch/mae saves: util/misc.py save_model's dict for a run's
    checkpoint-N.pth (`run`: model with decoder and mask_token, optimizer, epoch, scaler, args: a
    pickled argparse.Namespace), {'model': encoder + decoder} (`full`, as
    mae_pretrain_vit_base_full.pth) or {'model': encoder} (`pretrain`, as the released
    mae_pretrain_vit_base.pth); `extra` joins the dict."""
    sd = dict(encoder.state_dict())
    if layout in ("run", "full"):
        dd, patch_dim = 16, PATCH * PATCH * 3  # decoder width; patch_dim: MAE's decoder_pred out_features
        decoder = nn.ModuleDict({"decoder_embed": nn.Linear(D, dd), "decoder_blocks": nn.ModuleList(
            [Block(dd, 2, qkv_bias=True) for _ in range(2)]), "decoder_norm": nn.LayerNorm(dd),
            "decoder_pred": nn.Linear(dd, patch_dim)})
        sd |= decoder.state_dict()
        rows = sd["pos_embed"].shape[1]  # (1, 1 + N, D)
        sd |= {"mask_token": torch.randn(1, 1, dd), "decoder_pos_embed": torch.zeros(1, rows, dd)}
    content = {"model": sd}
    if layout == "run":
        params = list(decoder.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
        sum(p.sum() for p in params).backward()
        opt.step()
        content |= {"optimizer": opt.state_dict(), "epoch": 799, "args": argparse.Namespace(**MAE_ARGS),
                    "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                               "growth_interval": 2000, "_growth_tracker": 0}}
    torch.save({**content, **(extra or {})}, path)
    return path


def export_npz(model, path, layout="vit_jax", prefix="", scan=False, extra=None):
    """Write `model` as flattened Flax params, the inverse of timm's _load_weights mapping."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = {
        "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # OIHW -> HWIO
        "embedding/bias": sd["patch_embed.proj.bias"],
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
        "head/kernel": sd["head.weight"].T,
        "head/bias": sd["head.bias"],
    }
    pos = sd["pos_embed"]
    if layout == "vit_jax":
        w["Transformer/posembed_input/pos_embedding"] = pos
        if "cls_token" in sd:
            w["cls"] = sd["cls_token"]
    else:  # big_vision adds posemb to the patches only: fold the class row into the class token
        if "cls_token" in sd:
            w["cls"], pos = sd["cls_token"] + pos[:, :1], pos[:, 1:]
        w["pos_embedding"] = pos
    attn, ln2, mlp = (1, 2, 3) if layout == "vit_jax" else (0, 1, 0)
    blocks = []
    for i in range(len(model.blocks)):
        b = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        a = f"MultiHeadDotProductAttention_{attn}/"
        q, k, v = np.split(b["attn.qkv.weight"], 3)  # each (D_out, D_in)
        qb, kb, vb = np.split(b["attn.qkv.bias"], 3)
        blk = {
            "LayerNorm_0/scale": b["norm1.weight"],
            "LayerNorm_0/bias": b["norm1.bias"],
            f"LayerNorm_{ln2}/scale": b["norm2.weight"],
            f"LayerNorm_{ln2}/bias": b["norm2.bias"],
            a + "out/kernel": b["attn.proj.weight"].T.reshape(HEADS, D // HEADS, D),
            a + "out/bias": b["attn.proj.bias"],
        }
        for name, kern, bias in (("query", q, qb), ("key", k, kb), ("value", v, vb)):
            blk[f"{a}{name}/kernel"] = kern.T.reshape(D, HEADS, D // HEADS)
            blk[f"{a}{name}/bias"] = bias.reshape(HEADS, D // HEADS)
        for j in range(2):
            blk[f"MlpBlock_{mlp}/Dense_{j}/kernel"] = b[f"mlp.fc{j + 1}.weight"].T
            blk[f"MlpBlock_{mlp}/Dense_{j}/bias"] = b[f"mlp.fc{j + 1}.bias"]
        blocks.append(blk)
    for key in blocks[0]:
        if scan:
            w[f"Transformer/encoderblock/{key}"] = np.stack([blk[key] for blk in blocks])
        else:
            w.update({f"Transformer/encoderblock_{i}/{key}": blk[key] for i, blk in enumerate(blocks)})
    w.update(extra or {})
    np.savez(path, **{prefix + k: v for k, v in w.items()})
    return path


def stopped_at_call(monkeypatch, r, workdir, n: int) -> None:
    """Run `r` in `workdir` as Ctrl-C would stop it: KeyboardInterrupt in the n-th call of the
    gradient step (`loop._accumulate_grads`, once per optimiser step); the real step is back in
    place afterwards."""
    real, calls = loop._accumulate_grads, {"n": 0}

    def interrupt_at_n(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "_accumulate_grads", interrupt_at_n)
        with pytest.raises(KeyboardInterrupt):
            one_run(r, workdir)


def warnings(messages, but=("input-bound", "the cores are shared")):
    """The console's warnings, less those that name any of `but`: a tiny test run's model often
    waits for its data (the loop then says so, once), and a test machine is often shared
    (runtime.threads then advises fewer threads), which are no test's subject but
    test_throughput_runs' and test_threads'."""
    return [m for m in messages if m.startswith("[yellow]warning:") and not any(b in m for b in but)]


def flipped_bytes(path):
    """Bit rot: still a loadable file, but no longer the one the checksum was taken of."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def machine(native: bool):
    """A stand-in for detect_bf16: this machine runs bf16 natively, or emulates it."""
    return lambda device: (native, "CPU has AVX-512 bf16" if native
                           else "CPU has only AVX2: bf16 would be emulated")


def log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


def bv_sigmoid_xent(logits: np.ndarray, labels: np.ndarray) -> float:
    """big_vision.utils.sigmoid_xent: -sum over classes of the per-class log-likelihood,
    mean over the batch."""
    nll = -np.sum(labels * log_sigmoid(logits) + (1 - labels) * log_sigmoid(-logits), axis=-1)
    return float(np.mean(nll))


def bv_softmax_xent(logits: np.ndarray, labels: np.ndarray) -> float:
    """big_vision.utils.softmax_xent, mean over the batch."""
    log_p = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return float(np.mean(-np.sum(labels * log_p, axis=-1)))
