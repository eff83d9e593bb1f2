"""Predictors live: instances' start-up profiles reach the Conductor, and a predictor file
profiled for another engine configuration keeps the instances out (processes on 127.0.0.1)."""

from __future__ import annotations

import pytest
from procs import Cluster

from yuebing.conductor.policy import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
)
from yuebing.conductor.policy.predictors import save_predictors

MODEL = "dummy:preset=tiny,ctx=4096"


@pytest.mark.timeout(300)
def test_startup_profiles_set_the_predictors_and_a_mismatched_file_is_refused(tmp_path) -> None:
    c = Cluster(["prefill", "decode"], model=MODEL, instance_args=("--startup-profile",))
    try:
        pred = c.health()["predictors"]
    finally:
        c.stop()
    assert pred["prefill"]["origin"] == "start-up profile of prefill-0"
    assert pred["decode"]["origin"] == "start-up profile of decode-1"
    conf = pred["prefill"]["configuration"]
    assert conf["batch_invariant"] == "false" and conf["threads"] == "1"
    path = tmp_path / "other.json"
    save_predictors(Predictors(PrefillPredictor(BivariatePolynomial(((1, 0),), (1e-3,))),
                               DecodePredictor(BivariatePolynomial(((0, 0),), (0.02,))),
                               TransferPredictor(), "test", {**conf, "threads": "7"}), path)
    with pytest.raises(RuntimeError, match="differ in threads: 7 vs 1"):
        Cluster(["prefill", "decode"], model=MODEL, conductor_args=("--predictors", str(path)),
                timeout_s=15)
