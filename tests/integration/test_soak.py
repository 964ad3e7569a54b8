"""The soak at the size `make test` affords (bench/soak.py --quick; `make soak` is the full one): one
run on two Gloo ranks under torchrun meets eleven injected faults of eleven kinds (ranks SIGKILLed,
hung, crashed, killed in the middle of a checkpoint write; a NaN; a full disk and a damaged newest
checkpoint; the object store failing mid-upload and restarted; a preemption's SIGTERM; a node lost
with its local disk) and ends with the weights of the run that met none, bit for bit, the NaN's
rollback given to that one as its recorded skip."""

import importlib.util
import json
import sys

import pytest

from helpers import REPO

pytest.importorskip("moto.server", reason="moto[server] (the dev extra) runs the soak's S3 store")
SPEC = importlib.util.spec_from_file_location("soak", REPO / "bench/soak.py")
soak = importlib.util.module_from_spec(SPEC)
sys.modules["soak"] = soak  # dataclasses look their module up by name
SPEC.loader.exec_module(soak)


def test_a_run_meets_every_fault_and_ends_with_the_weights_of_one_that_met_none(tmp_path):
    report = soak.soak(soak.QUICK, tmp_path)
    log = (tmp_path / "soak.log").read_text()
    said = "".join(log.split())  # the console wraps its lines anywhere (a long path)
    faults = report["faults"]
    assert len(faults) >= 10 and report["kinds"] >= 6
    missed = [f for f in faults if not f["fired"] or f["recovered_s"] is None]
    assert not missed, (missed, log[-5000:])
    assert report["bit_identical"], log[-5000:]

    faulted = tmp_path / "faulted"
    # every step logged once, in order, whatever was trained twice
    steps = [row["step"] for row in map(json.loads, (faulted / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in row]
    assert steps == list(range(1, soak.QUICK.steps + 1))
    # the hung rank said where it hung, and the one waiting for it where it waited
    assert "hang_forever" in said and "pastitsbound" in said
    # the rollback's skip, and the checkpoint that a full disk and a damaged file cost
    assert soak.recorded_skips(faulted)
    assert "rolledback" in said
    assert "Nospaceleftondevice" in said and "damaged,itssha256differs" in said, log[-5000:]
    # the node lost with its disk: resumed from the bucket
    assert "fetchedstate-" in said and f"froms3://{soak.BUCKET}/faulted" in said
