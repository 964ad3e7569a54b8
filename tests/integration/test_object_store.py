"""Checkpoints on object storage (run.ckpt_dir), against a real S3 API server: moto's, started on a
free localhost port as s3fs's own tests start it, and read back with s3fs. A run mirrors its
checkpoints (checksum objects last, retention as the workdir's), resumes from the bucket alone when
the workdir lost them, skips incomplete and damaged remote ones, refuses an unreachable store in one
line before training, and survives the store going away mid-upload."""

import hashlib
import importlib.util
import json
import shutil
import urllib.request

import pytest
import torch

from helpers import refused, run_vit, stopped_at_call, warnings
from vitcli.checkpoints import manager, remote
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import RecipeError
from vitcli.recipe.checks import check_ckpt_dir
from vitcli.recipe.resolve import resolve
from vitcli.runtime.dist import setup
from vitcli.stages.run import one_run
from vitcli.stages.sweep import lr_sweep

MISSING = "is not installed: pip install -e '.[dev]'"
moto_server = pytest.importorskip("moto.server", reason=f"moto {MISSING}")
s3fs = pytest.importorskip("s3fs", reason=f"s3fs {MISSING}")

BUCKET = "vitcli-test"
URI = f"s3://{BUCKET}/run"
TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.num_classes=4",
        "data.synthetic.train_size=64",
        "data.synthetic.img_size=32", "data.batch_size=16", "data.num_workers=0", "optim.lr=3e-3",
        "schedule.warmup_steps=1", "run.log_every=1", "run.precision=fp32", "data.val_split=",
        "data.test_split=", "schedule.steps=8", "run.ckpt_every=2", "run.keep_checkpoints=2"]


def recipe(*extra):
    return resolve("pretrain", None, TINY + list(extra))


class Store:
    """moto's S3 server in a thread of this process, on one port for its life: stopped, it refuses
    connections as a store that went away; started again, it answers with what it held (moto keeps
    its buckets in the process) unless `reset` empties it, as a store restarted without its data."""

    def __init__(self):
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.url = f"http://{self.host}:{self.port}"

    def stop(self):
        self.server.stop()

    def start(self):
        self.server = moto_server.ThreadedMotoServer(ip_address=self.host, port=self.port,
                                                     verbose=False)
        self.server.start()

    def reset(self):
        """Every bucket gone (moto's reset), then ours made again, empty."""
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/reset", method="POST"))
        self.fs().mkdir(BUCKET)

    def fs(self):
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.invalidate_cache()
        return fs

    def names(self) -> set[str]:
        """The objects under the run's prefix, relative to it."""
        return {p.removeprefix(f"{BUCKET}/run/") for p in self.fs().find(f"{BUCKET}/run")}

    def verified(self) -> dict[str, bytes]:
        """Every remote whole-file checkpoint of the run (not those set aside), its bytes checked
        against its checksum object."""
        fs, found = self.fs(), {}
        for name in sorted(n for n in self.names() if n.endswith(".pt") and "/" not in n):
            data = fs.cat_file(f"{BUCKET}/run/{name}")
            recorded = fs.cat_file(f"{BUCKET}/run/{name}.sha256").decode().split()[0]
            assert hashlib.sha256(data).hexdigest() == recorded, name
            found[name] = data
        return found


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # one try per call: vit's own retries (checkpoints.remote.ATTEMPTS) are what is tested
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    s = Store()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s.url)
    s.reset()  # moto's buckets live in the process: an earlier test's would still be there
    yield s
    s.stop()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The weights of the run never interrupted, nor mirrored."""
    workdir = tmp_path_factory.mktemp("straight")
    one_run(recipe(), workdir)
    return load_weights(workdir / "model.safetensors")[0]


def same_weights(workdir, reference):
    weights = load_weights(workdir / "model.safetensors")[0]
    return weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k])
                                                      for k in weights)


def drop_local_checkpoints(workdir):
    """A node's local disk lost: the workdir keeps none of its checkpoints."""
    for path in workdir.glob("state-*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_a_run_mirrors_its_newest_checkpoints_checksums_last_and_a_fresh_one_sets_them_aside(
        store, tmp_path, monkeypatch, logged):
    # the store drops the connection between step 2's data and its checksum object: retried, caught
    monkeypatch.setenv("VITCLI_FAULTS", "store@2")
    one_run(recipe(f"run.ckpt_dir={URI}", "schedule.steps=6"), tmp_path)
    assert store.names() == {"state-4.pt", "state-4.pt.sha256", "state-6.pt", "state-6.pt.sha256"}
    for name, data in store.verified().items():
        assert data == (tmp_path / name).read_bytes(), name
    lines = (tmp_path / "faults-fired.jsonl").read_text().splitlines()
    fired = [json.loads(line)["fault"] for line in lines]
    assert fired == ["store@2:rank=0"]
    assert warnings(logged) == []  # the second try went through

    # --no-resume in another workdir, the same bucket: the first run's checkpoints are set aside
    one_run(recipe(f"run.ckpt_dir={URI}", "schedule.steps=2"), tmp_path / "again", resume=False)
    aside = sorted(n for n in store.names() if n.startswith("previous-"))
    assert [n.split("/", 1)[1] for n in aside] == ["state-4.pt", "state-4.pt.sha256", "state-6.pt",
                                                   "state-6.pt.sha256"]
    assert sorted(store.verified()) == ["state-2.pt"]  # the new run's own


def test_the_store_goes_away_mid_upload_the_run_goes_on_and_resumes_from_the_bucket_alone(
        store, tmp_path, monkeypatch, logged, straight):
    """Step 4's data object is up when the server stops, before its checksum object: three tries,
    a warning, training goes on. The server is back, empty (restarted without its data), before step
    6's upload, which uploads 4 too. The run is stopped after step 7, its workdir loses every
    checkpoint, and the same command resumes from the bucket: the weights of the run never
    interrupted."""
    put, upload, seen = remote.Mirror._put, remote.Mirror.upload, {}

    def put_then_go_away(self, file, name):
        if name == "state-4.pt.sha256" and "stopped" not in seen:
            seen["stopped"] = store.names()
            store.stop()
        return put(self, file, name)

    def come_back_before_6(self, path):
        if path.name == "state-6.pt":
            store.start()
            store.reset()
        return upload(self, path)

    monkeypatch.setattr(remote.Mirror, "_put", put_then_go_away)
    monkeypatch.setattr(remote.Mirror, "upload", come_back_before_6)
    r = recipe(f"run.ckpt_dir={URI}")
    stopped_at_call(monkeypatch, r, tmp_path, 8)
    assert {"state-4.pt", "state-2.pt.sha256"} <= seen["stopped"]
    assert "state-4.pt.sha256" not in seen["stopped"]
    assert [w for w in warnings(logged) if "could not upload state-4.pt" in w and URI in w]
    assert sorted(store.verified()) == ["state-4.pt", "state-6.pt"]  # caught up after the restart

    drop_local_checkpoints(tmp_path)
    one_run(r, tmp_path)
    assert any("resuming from" in m and "state-6.pt" in m for m in logged)
    assert same_weights(tmp_path, straight)
    assert sorted(store.verified()) == ["state-6.pt", "state-8.pt"]

    # the whole workdir lost after the run finished: the bucket's last checkpoint gives it back
    shutil.rmtree(tmp_path)
    one_run(r, tmp_path)
    assert any("resuming from" in m and "state-8.pt" in m for m in logged)
    assert same_weights(tmp_path, straight) and (tmp_path / "summary.json").is_file()


def test_incomplete_and_damaged_remote_checkpoints_are_skipped_by_name(store, tmp_path, logged):
    r = recipe(f"run.ckpt_dir={URI}", "schedule.steps=4")
    one_run(r, tmp_path / "first")
    fs, good = store.fs(), (tmp_path / "first" / "state-4.pt").read_bytes()
    fs.pipe_file(f"{BUCKET}/run/state-6.pt", good)  # its upload never reached the checksum object
    fs.pipe_file(f"{BUCKET}/run/state-5.pt", good[:-1] + bytes([good[-1] ^ 1]))  # bit rot
    fs.put_file(str(tmp_path / "first" / "state-4.pt.sha256"), f"{BUCKET}/run/state-5.pt.sha256")
    path, saved = manager.resume_point(r, tmp_path / "new", setup("cpu"))
    assert (path.name, saved["step"]) == ("state-4.pt", 4)
    said = warnings(logged)
    assert any(f"{URI}/state-6.pt: incomplete" in w for w in said), said
    assert any(f"{URI}/state-5.pt: damaged" in w for w in said), said
    got = sorted(p.name for p in (tmp_path / "new").iterdir())
    assert got == ["state-4.pt", "state-4.pt.sha256"]


def test_sharded_checkpoints_are_mirrored_as_directories_and_fetched_back(store, tmp_path):
    r = recipe(f"run.ckpt_dir={URI}", "schedule.steps=4", "run.strategy=fsdp")
    one_run(r, tmp_path / "first")
    names = store.names()
    assert {"state-2/SHA256SUMS", "state-4/SHA256SUMS", "state-4/.metadata"} <= names
    local = {f"state-4/{p.name}" for p in (tmp_path / "first" / "state-4").iterdir()}
    assert {n for n in names if n.startswith("state-4/")} == local
    path, saved = manager.resume_point(r, tmp_path / "new", setup("cpu"))
    assert (path.name, saved["step"]) == ("state-4", 4)
    for name in local:
        got, sent = tmp_path / "new" / name, tmp_path / "first" / name
        assert got.read_bytes() == sent.read_bytes(), name


def test_each_point_of_a_sweep_mirrors_into_a_place_of_its_own(store, tmp_path):
    r = recipe(f"run.ckpt_dir={URI}", "schedule.steps=2", "data.val_split=validation",
               "data.synthetic.val_size=16")
    lr_sweep(r, tmp_path, [0.1, 0.3], setup("cpu"))
    points = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(points) == 2
    assert store.names() == {f"{p}/state-2.pt{end}" for p in points for end in ("", ".sha256")}


def test_a_plain_path_is_a_store_too_but_not_the_workdir_itself(tmp_path, monkeypatch, capsys):
    r = recipe(f"run.ckpt_dir={tmp_path / 'disk2' / 'run'}", "schedule.steps=4")
    one_run(r, tmp_path / "w")
    mirrored = sorted(p.name for p in (tmp_path / "disk2" / "run").iterdir())
    assert mirrored == ["state-2.pt", "state-2.pt.sha256", "state-4.pt", "state-4.pt.sha256"]
    for name in ("state-2.pt", "state-4.pt"):
        sent, kept = tmp_path / "w" / name, tmp_path / "disk2" / "run" / name
        assert kept.read_bytes() == sent.read_bytes()
    one_run(recipe(f"run.ckpt_dir={tmp_path / 'disk2' / 'run'}", "schedule.steps=2"), tmp_path / "w2",
            resume=False)
    aside = list((tmp_path / "disk2" / "run").glob("previous-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == mirrored
    capsys.readouterr()  # the runs' own output
    err = refused(monkeypatch, capsys, tmp_path, "pretrain", "--workdir", tmp_path / "w", *TINY,
                  f"run.ckpt_dir=file://{tmp_path / 'w'}")
    assert "is the workdir itself" in err, err


def test_an_upload_with_no_complete_checkpoint_here_removes_nothing_there(tmp_path):
    there, here = tmp_path / "there", tmp_path / "here"
    there.mkdir(), here.mkdir()
    (there / "state-4.pt").write_bytes(b"weights")
    (there / "state-4.pt.sha256").write_text(f"{hashlib.sha256(b'weights').hexdigest()}  state-4.pt\n")
    (here / "state-6.pt").write_bytes(b"cut short")  # no checksum: its write was interrupted
    assert remote.Mirror(str(there), keep=2).upload(here / "state-6.pt")
    assert sorted(p.name for p in there.iterdir()) == ["state-4.pt", "state-4.pt.sha256"]


@pytest.mark.parametrize("where, says", [("no such bucket", "bucket does not exist"),
                                         ("no credentials", "NoCredentialsError"),
                                         ("server down", "Could not connect")])
def test_an_unreachable_store_is_one_line_before_training(where, says, store, tmp_path, monkeypatch,
                                                          capsys):
    uri = "s3://no-such-bucket/run" if where == "no such bucket" else URI
    if where == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
            monkeypatch.setenv(name, str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    if where == "server down":
        store.stop()
    (tmp_path / "w").mkdir()
    err = refused(monkeypatch, capsys, tmp_path, "pretrain", "--workdir", tmp_path / "w", *TINY,
                  f"run.ckpt_dir={uri}")
    assert f"run.ckpt_dir={uri}: cannot write there" in err and says in err, err
    if where == "server down":
        store.start()  # for the fixture's stop


@pytest.mark.parametrize("uri, fragment", [("s4://bucket/x", "not a path nor a URI"),
                                           ("s3://", "not a path nor a URI")])
def test_a_ckpt_dir_fsspec_cannot_open_is_refused_at_resolve_time(uri, fragment, monkeypatch,
                                                                  capsys):
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", *TINY,
                           f"run.ckpt_dir={uri}")
    assert code == 2 and "run.ckpt_dir" in err and fragment in err, err


@pytest.mark.parametrize("uri, fragment", [("s3://b/x\nrm -rf /", "control character"),
                                           (" s3://b/x", "surrounding spaces")])
def test_a_ckpt_dir_that_could_not_be_one_is_refused(uri, fragment):
    with pytest.raises(RecipeError, match=fragment):
        check_ckpt_dir(uri)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_store_whose_library_is_missing_is_named_with_its_install_line():
    with pytest.raises(RecipeError, match="run.ckpt_dir: gs://b/x: .*install gcsfs"):
        check_ckpt_dir("gs://b/x")
