"""Predictor fits recover known functions; predictor files round-trip and bad files fail loudly."""

from __future__ import annotations

import json

import pytest
from policy_factories import PREDICTORS

from yuebing.conductor.policy import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
    load_predictors,
    save_predictors,
)
from yuebing.conductor.policy.predictors import poly_exponents
from yuebing.core.errors import ConfigError, InputError


def prefill_truth(n: float, c: float) -> float:
    # LLaMA3-70B-like: 80·(4·n·(n+c)·8192 + 22·n·8192²) FLOPs at 1 PFLOP/s, plus 20 ms
    return 0.02 + 80 * (4 * n * (n + c) * 8192 + 22 * n * 8192**2) / 1e15


def test_poly_exponents_order():
    assert poly_exponents(2) == ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2))
    with pytest.raises(ConfigError, match="degree must be in 0..4"):
        poly_exponents(5)


def test_prefill_fit_recovers_known_polynomial():
    samples = [(n, c, prefill_truth(n, c)) for n in (1, 64, 512, 4096, 16384, 65536)
               for c in (0, 1000, 20000, 100000)]
    fitted = PrefillPredictor.fit(samples)
    want = {(0, 0): 0.02, (1, 0): 80 * 22 * 8192**2 / 1e15, (2, 0): 80 * 4 * 8192 / 1e15,
            (1, 1): 80 * 4 * 8192 / 1e15, (0, 1): 0.0, (0, 2): 0.0}
    got = dict(zip(fitted.poly.exponents, fitted.poly.coefficients, strict=True))
    for term, value in want.items():
        assert got[term] == pytest.approx(value, rel=1e-6, abs=1e-15), term
    for n, c in ((3000, 7000), (100000, 0), (10, 90000)):
        assert fitted.predict(n, c) == pytest.approx(prefill_truth(n, c), rel=1e-9)


def test_prefill_from_function_and_clamping():
    fitted = PrefillPredictor.from_function(prefill_truth, max_new_tokens=65536,
                                            max_cached_tokens=65536, steps=8)
    assert fitted.predict(5000, 3000) == pytest.approx(prefill_truth(5000, 3000), rel=1e-9)
    negative = PrefillPredictor(BivariatePolynomial(((0, 0), (1, 0)), (-1.0, 0.001)))
    assert negative.predict(10, 0) == 0.0 and negative.predict(2000, 0) == 1.0


def test_decode_fit_recovers_linear_and_quadratic_models():
    def truth(b: float, t: float) -> float:
        return 0.015 + 2e-4 * b + 5e-8 * t

    samples = [(b, t, truth(b, t)) for b in (1, 8, 32, 128) for t in (512, 8192, 65536, 500000)]
    fitted = DecodePredictor.fit(samples)
    assert fitted.poly.exponents == ((0, 0), (1, 0), (0, 1))
    assert fitted.poly.coefficients == pytest.approx((0.015, 2e-4, 5e-8), rel=1e-9)
    quad = [(b, t, truth(b, t) + 1e-6 * b * b) for b, t, _ in samples]
    assert DecodePredictor.fit(quad, degree=2).predict(64, 100000) == pytest.approx(
        truth(64, 100000) + 1e-6 * 64 * 64, rel=1e-9)
    roofline = DecodePredictor.from_function(truth, max_batch=64, max_context_tokens=10**6)
    assert roofline.predict(17, 123456) == pytest.approx(truth(17, 123456), rel=1e-9)


def test_transfer_fit_and_predict():
    true = TransferPredictor(overhead_s=0.002, efficiency=0.8)
    samples = [(b, bw, lat, true.predict(b, bw, lat)) for b in (1e6, 1e8, 1e9)
               for bw, lat in ((25e9, 1e-5), (100e9, 0.0))]
    fitted = TransferPredictor.fit(samples)
    assert fitted.overhead_s == pytest.approx(0.002, rel=1e-9)
    assert fitted.efficiency == pytest.approx(0.8, rel=1e-9)
    assert true.predict(0, 1e9) == 0.0
    assert true.predict(8e8, 1e9, 0.5) == pytest.approx(0.002 + 0.5 + 1.0)


@pytest.mark.parametrize(("samples", "message"), [
    ([], "no samples"),
    ([(1, 2)], "every sample must have 3 numbers"),
    ([(1, 0, 0.1), (2, 0, 0.2)], "do not determine 6 coefficients"),
    ([(1, 0, float("nan"))] * 10, "finite and non-negative"),
    ([(-1, 0, 1.0)] * 10, "finite and non-negative"),
])
def test_fit_rejects_bad_samples(samples, message):
    with pytest.raises(InputError, match=message):
        PrefillPredictor.fit(samples)


def test_transfer_fit_rejects_degenerate_samples():
    with pytest.raises(InputError, match="at least two distinct sizes"):
        TransferPredictor.fit([(1e6, 1e9, 0.0, 0.001)] * 3)
    with pytest.raises(InputError, match="does not grow with size"):
        TransferPredictor.fit([(1e6, 1e9, 0.0, 0.01), (1e9, 1e9, 0.0, 0.005)])


def test_json_round_trip(tmp_path):
    fitted = Predictors(PrefillPredictor.from_function(prefill_truth, 8192, 8192, 6),
                        PREDICTORS.decode, TransferPredictor(0.001, 0.9), source="roofline")
    assert Predictors.from_json(fitted.to_json()) == fitted
    path = tmp_path / "predictors.json"
    save_predictors(fitted, path)
    assert load_predictors(path) == fitted
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["source"]) == ("yuebing-predictors", 1, "roofline")


def _doc(**changes):
    doc = json.loads(PREDICTORS.to_json())
    for dotted, value in changes.items():
        target = doc
        *parents, leaf = dotted.split("__")
        for key in parents:
            target = target[key]
        target[leaf] = value
    return json.dumps(doc)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "p.json: not valid JSON"),
    (_doc(format="other"), r"Invalid enum value 'other' - at `\$.format`"),
    (_doc(version=2), "version 2 is not supported"),
    (_doc(prefill__coefficients=["x"]), r"Expected `float`, got `str` - at `\$.prefill.coefficients\[0\]`"),
    (_doc(decode__coefficients=[1.0]), "3 exponents but 1 coefficients"),
    (_doc(prefill__exponents=[[0, 0], [0, 0]], prefill__coefficients=[1, 2]), "duplicate"),
    (_doc(prefill__exponents=[[7, 0]]), r"exponent pair \(7, 0\)"),
    (_doc(transfer__efficiency=0), "efficiency must be in"),
    (_doc(extra=1), "Object contains unknown field `extra`"),
    ('{"format": "yuebing-predictors"}', "missing required field `version`"),
])
def test_bad_predictor_files(text, message):
    with pytest.raises(InputError, match=message):
        Predictors.from_json(text, origin="p.json")


def test_missing_predictor_file(tmp_path):
    with pytest.raises(InputError, match="cannot read predictor file"):
        load_predictors(tmp_path / "absent.json")
