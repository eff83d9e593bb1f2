"""`Calibration`: predictors from start-up profiles, and instances refused whose engine
configuration differs from the one the predictors hold for."""

from __future__ import annotations

import math

import pytest

from yuebing.conductor.calibration import Calibration, DecodeDurations, StepLedger, TbtTail
from yuebing.conductor.policy import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
)
from yuebing.conductor.policy.decode import duration_quantiles
from yuebing.conductor.policy.predictors import load_predictors, save_predictors
from yuebing.protocol.instance import EngineProfile, Hello, Role

CONF = {"model": "smollm2:abc", "dtype": "bfloat16", "threads": "1", "attention": "paged",
        "batch_invariant": "false", "machine": "cpu X | amx_bf16 | 2 cores"}


def linear(prefill_s_per_token: float = 1e-3, step_s: float = 0.03,
           configuration: dict[str, str] | None = None) -> Predictors:
    return Predictors(PrefillPredictor(BivariatePolynomial(((1, 0),), (prefill_s_per_token,))),
                      DecodePredictor(BivariatePolynomial(((0, 0),), (step_s,))),
                      TransferPredictor(), "test", configuration or {})


def profile(conf: dict[str, str], per_token: float = 2e-4, square: float = 1e-8,
            step: float = 0.02) -> EngineProfile:
    """A profile whose prefill time is per_token·n + square·n·(n + 2c)."""
    pre = [(n, c, per_token * n + square * n * (n + 2 * c))
           for c in (0, 1024) for n in (128, 512, 1536, 4096)]
    dec = [(b, ctx, step + 1e-3 * b + 1e-6 * ctx) for b in (1, 8, 32) for ctx in (512, 4096)]
    return EngineProfile(configuration=conf, prefill=pre, decode=dec)


def hello(name: str, role: Role, conf: dict[str, str] | None,
          prof: EngineProfile | None = None) -> Hello:
    return Hello(seq=0, instance_id=name, role=role, model="m", fingerprint="fp", host="h",
                 control_address=f"tcp://h:{len(name)}", kv_segment="", block_size=16,
                 store_block_tokens=256, num_blocks=100, max_model_len=8192, incarnation="i",
                 engine=conf or {}, profile=prof)


class Seen:
    def __init__(self) -> None:
        self.changes: list[Predictors] = []

    def __call__(self, p: Predictors) -> None:
        self.changes.append(p)


def test_profiles_set_each_part_and_pin_its_configuration() -> None:
    seen = Seen()
    cal = Calibration(linear(), "", seen)
    assert cal.admit(hello("p0", Role.PREFILL, CONF, profile(CONF))) == ""
    assert len(seen.changes) == 1
    p = seen.changes[-1]
    want = 2e-4 * 4000 + 1e-8 * 4000 * 4000
    assert p.prefill.predict(4000, 0) == pytest.approx(want, rel=0.02)
    assert p.decode.predict(8, 1000) == pytest.approx(0.03)  # decode part untouched
    assert cal.state()["decode"]["origin"] == "linear defaults"
    # a decode instance of another configuration sets the decode part
    other = {**CONF, "threads": "2"}
    assert cal.admit(hello("d0", Role.DECODE, other, profile(other, step=0.01))) == ""
    assert seen.changes[-1].decode.predict(8, 1000) == pytest.approx(0.01 + 8e-3 + 1e-3,
                                                                      rel=0.02)
    assert seen.changes[-1].prefill.predict(4000, 0) == pytest.approx(want, rel=0.02)
    # a second prefill instance of another configuration is refused, naming both
    problem = cal.admit(hello("p1", Role.PREFILL, other, profile(other)))
    assert "threads: 1 vs 2" in problem and "threads=2" in problem and "threads=1" in problem
    # the same configuration joins without changing anything
    assert cal.admit(hello("p2", Role.PREFILL, CONF, profile(CONF, per_token=1.0))) == ""
    assert len(seen.changes) == 2


def test_coupled_instance_sets_both_parts() -> None:
    seen = Seen()
    cal = Calibration(linear(), "", seen)
    assert cal.admit(hello("c0", Role.COUPLED, CONF, profile(CONF))) == ""
    assert len(seen.changes) == 1
    assert "c0" in seen.changes[0].source and seen.changes[0].configuration == CONF
    assert "threads" in cal.admit(hello("c1", Role.DECODE, {**CONF, "threads": "2"}))


def test_file_with_configuration_refuses_other_instances(tmp_path) -> None:
    path = tmp_path / "pred.json"
    save_predictors(linear(configuration=CONF), path)
    loaded = load_predictors(path)
    assert dict(loaded.configuration) == CONF
    seen = Seen()
    cal = Calibration(loaded, str(path), seen)
    assert cal.admit(hello("p0", Role.PREFILL, CONF, profile(CONF))) == ""
    assert seen.changes == []  # the file wins over profiles
    problem = cal.admit(hello("d0", Role.DECODE, {**CONF, "batch_invariant": "true"}))
    assert f"file {path}" in problem and "batch_invariant: false vs true" in problem


def test_file_without_configuration_warns_and_is_kept(caplog) -> None:
    seen = Seen()
    cal = Calibration(linear(), "old.json", seen)
    assert "records no engine configuration" in caplog.text
    assert cal.admit(hello("p0", Role.PREFILL, CONF, profile(CONF))) == ""
    assert seen.changes == []


def test_profile_too_small_to_fit_keeps_defaults(caplog) -> None:
    seen = Seen()
    cal = Calibration(linear(), "", seen)
    tiny = EngineProfile(configuration=CONF, prefill=[], decode=[])
    assert cal.admit(hello("c0", Role.COUPLED, CONF, tiny)) == ""
    assert seen.changes == [] and "cannot be fitted" in caplog.text


def test_online_scale_follows_live_prefills_and_survives_a_new_profile() -> None:
    seen = Seen()
    cal = Calibration(linear(prefill_s_per_token=1e-3), "", seen)
    cal.observe(10, 0, 5.0)  # too short to count
    cal.observe(1000, 0, 1.03)  # within the step: nothing changes
    assert seen.changes == [] and cal.scale == 1.0
    for _ in range(20):  # prefills take twice their estimate
        cal.observe(1000, 0, 2.0)
    assert cal.scale == pytest.approx(2.0, rel=0.06)
    assert seen.changes[-1].prefill.predict(1000, 0) == pytest.approx(1000 * 1e-3 * cal.scale)
    # a profile arriving later starts a new scale (the old one was learned on another fit)
    assert cal.admit(hello("p0", Role.PREFILL, CONF, profile(CONF))) == ""
    base = 2e-4 * 4000 + 1e-8 * 4000 * 4000
    assert cal.scale == 1.0
    assert seen.changes[-1].prefill.predict(4000, 0) == pytest.approx(base, rel=0.02)
    assert cal.state()["prefill_scale"] == 1.0
    for _ in range(50):  # absurd ratios are clamped
        cal.observe(4000, 0, 1e6)
    assert cal.scale == pytest.approx(4.0, rel=0.05)  # within the policy's rescale step
    for _ in range(6):  # and one outlier does not hold the scale: it comes back within a few
        cal.observe(4000, 0, base / 4)
    assert cal.scale < 1.5


def test_online_scale_weighs_prefills_by_their_seconds() -> None:
    """A first short prompt (fixed costs above the fit) barely moves the scale, where it once
    set it; a long one moves it most of the way."""
    cal = Calibration(linear(prefill_s_per_token=1e-3), "", Seen())
    cal.observe(64, 0, 0.064 * 1.5)  # 1.5x its 64 ms estimate
    assert cal.snapshot() == {"scale": pytest.approx((1.4 + 0.096) / (1.4 + 0.064))}
    assert cal.scale == 1.0  # within the rescale step
    cal.observe(4000, 0, 4.0 * 0.6)  # a 4 s prefill took 0.6x
    assert cal.scale == pytest.approx((0.7 * 1.496 + 2.4) / (0.7 * 1.464 + 4.0))
    assert cal.scale < 0.7


def test_online_scale_settles_on_the_ratio_without_overshoot() -> None:
    """Regression: the target was the scale now times measured / the estimate made at
    dispatch (under an older scale), so while the scale rose every target was inflated by the
    rise: a steady 2x overshot to 3.7x in a live run (est/measured TTFT median 0.74)."""
    seen = Seen()
    cal = Calibration(linear(prefill_s_per_token=1e-3), "", seen)
    scales = []
    for _ in range(30):
        cal.observe(1000, 0, 2.0)
        scales.append(cal.scale)
    assert max(scales) <= 2.0 + 1e-9 and scales[-1] == pytest.approx(2.0, rel=0.06)


def lent_profile(conf: dict[str, str], ratio: float, lent_threads: int = 2) -> EngineProfile:
    """`profile` with its cached-0 prompts of 512 tokens and more timed at ``ratio`` of their
    time on ``lent_threads``."""
    base = profile(conf)
    lent = [(n, c, ratio * s) for n, c, s in base.prefill if c == 0 and n >= 512]
    return EngineProfile(configuration=conf, prefill=base.prefill, decode=base.decode,
                         lent_threads=lent_threads, prefill_lent=lent)


def test_lent_points_give_the_prefill_speed_on_borrowed_cores() -> None:
    cal = Calibration(linear(), "", Seen())
    assert cal.prefill_factor(2) == 1.0  # nothing measured yet
    assert cal.admit(hello("p0", Role.PREFILL, CONF, lent_profile(CONF, 0.55))) == ""
    assert cal.lent == (1, 2, pytest.approx(0.55))
    assert cal.prefill_factor(0) == cal.prefill_factor(1) == 1.0  # its own threads only
    assert cal.prefill_factor(2) == pytest.approx(0.55)
    assert cal.prefill_factor(8) == pytest.approx(0.55)  # never past the threads measured
    assert cal.state()["prefill_lent"] == {"own_threads": 1, "lent_threads": 2,
                                           "factor": pytest.approx(0.55)}
    # between its own and the lent threads: linear in the threads borrowed
    four = Calibration(linear(), "", Seen())
    assert four.admit(hello("p0", Role.PREFILL, CONF, lent_profile(CONF, 0.4, 4))) == ""
    assert four.prefill_factor(2) == pytest.approx(0.8)
    assert four.prefill_factor(4) == pytest.approx(0.4)
    # the learned scale's key names the lent speed: another factor is another key
    assert cal.key() != four.key() and "lent 2 0.55" in cal.key()


def test_each_instance_is_predicted_with_its_own_lent_speed() -> None:
    """Hosts differ in cores: a prefill instance on a 4-core host gains more from lending than
    the 2-core one whose profile set the predictor, and one without lent points gains what
    the adopted profile says. A rejoining id without lent points loses its old ones."""
    cal = Calibration(linear(), "", Seen(), check="warn")
    assert cal.admit(hello("p0", Role.PREFILL, CONF, lent_profile(CONF, 0.55))) == ""
    assert cal.admit(hello("p1", Role.PREFILL, CONF, lent_profile(CONF, 0.3, 4))) == ""
    assert cal.prefill_factor(2, "p0") == pytest.approx(0.55)
    assert cal.prefill_factor(4, "p1") == pytest.approx(0.3)
    assert cal.prefill_factor(2, "p1") == pytest.approx(1 - 0.7 / 3)  # 1 of its 3 lent
    assert cal.prefill_factor(2, "elsewhere") == pytest.approx(0.55)  # the adopted one's
    assert cal.state()["prefill_lent_by_instance"]["p1"]["factor"] == pytest.approx(0.3)
    assert cal.admit(hello("p1", Role.PREFILL, CONF, profile(CONF))) == ""  # back, no points
    assert cal.prefill_factor(4, "p1") == 1.0
    assert cal.admit(hello("d0", Role.DECODE, CONF, lent_profile(CONF, 0.2))) == ""
    assert "d0" not in cal.state()["prefill_lent_by_instance"]  # a decode never lends to itself


@pytest.mark.parametrize("prof", [
    lent_profile(CONF, 1.7),  # slower on more threads: never predicted slower for them
    lent_profile({**CONF, "threads": "2"}, 0.5),  # no more threads than its own
    lent_profile({**CONF, "threads": "auto"}, 0.5),  # its own threads unknown
    EngineProfile(configuration=CONF, prefill=profile(CONF).prefill, lent_threads=2),
])
def test_lent_points_that_say_nothing_are_not_used(prof: EngineProfile) -> None:
    cal = Calibration(linear(), "", Seen())
    cal.admit(hello("p0", Role.PREFILL, prof.configuration, prof))
    assert cal.prefill_factor(2) == 1.0 and cal.state()["prefill_lent"] is None
    assert "lent" not in cal.key()  # nothing learned is voided for it


def test_online_scale_learns_against_the_lent_estimate() -> None:
    """A prefill estimated on lent cores (factor 0.5) that took that long moves nothing; one
    estimated on its own cores that took as long halves the scale."""
    seen = Seen()
    cal = Calibration(linear(prefill_s_per_token=1e-3), "", seen)
    for _ in range(20):
        cal.observe(1000, 0, 0.5, factor=0.5)
    assert cal.scale == 1.0 and seen.changes == []
    for _ in range(20):
        cal.observe(1000, 0, 0.5)
    assert cal.scale == pytest.approx(0.5, rel=0.06)


def test_online_scale_off() -> None:
    seen = Seen()
    cal = Calibration(linear(), "", seen, online=False)
    for _ in range(10):
        cal.observe(1000, 0, 3.0)
    assert cal.scale == 1.0 and seen.changes == []


def test_predictor_check_warn_admits_other_configurations(caplog) -> None:
    cal = Calibration(linear(), "", Seen(), check="warn")
    assert cal.admit(hello("p0", Role.PREFILL, CONF, profile(CONF))) == ""
    assert cal.admit(hello("p1", Role.PREFILL, {**CONF, "threads": "2"})) == ""
    assert "threads: 1 vs 2" in caplog.text


def test_duration_quantiles_are_equal_probability_midpoints() -> None:
    assert duration_quantiles(list(range(1, 101)), 4) == pytest.approx((13.375, 38.125, 62.875, 87.625))
    assert duration_quantiles([5.0], 3) == (5.0, 5.0, 5.0)
    assert duration_quantiles([0.0, 4.0], 2) == (1.0, 3.0)
    assert duration_quantiles([0.0, 0.0], 1) == (1e-3,)  # at least 1 ms
    with pytest.raises(ValueError):
        duration_quantiles([], 4)


def test_decode_durations_are_learned_from_finished_requests() -> None:
    got: list[tuple[float, ...]] = []
    d = DecodeDurations(got.append, window=8, every=4, k=2)
    for s in (1.0, 2.0, 3.0):
        d.observe(s)
    d.observe(math.nan)  # ignored, as are zero and negative times
    d.observe(0.0)
    assert got == [] and d.state()["in_use"] == "configured"
    d.observe(4.0)
    assert got == [(1.75, 3.25)]
    for s in (10.0,) * 8:  # the window keeps the latest 8
        d.observe(s)
    assert got[-1] == (10.0, 10.0) and d.state()["samples"] == 8
    off = DecodeDurations(got.append, learn=False, every=1)
    off.observe(1.0)
    assert len(got) == 3 and off.state()["samples"] == 0


def test_tbt_tail_is_a_quantile_of_recent_ratios_within_limits():
    got: list[float] = []
    tail = TbtTail(got.append, min_samples=4, every=2)  # the default quantile, 0.9
    for tbt in (0.06, 0.09, 0.12):  # ratios 2, 3, 4 over a 30 ms step: too few yet
        tail.observe(tbt, 0.03)
    assert got == [] and tail.current == 1.0
    tail.observe(0.3, 0.03)  # ratio 10, held at the limit 4
    assert got == [4.0] and tail.state() == {"learn": True, "tail": 4.0, "samples": 4}
    for bad in ((math.nan, 0.03), (0.1, 0.0), (0.1, 1e-4), (-1.0, 0.03), (0.1, math.inf)):
        tail.observe(*bad)
    assert len(tail.window) == 4


def test_step_ledger_means_the_step_over_a_decode():
    """The tail's denominator: the time-mean of the step an instance's reports predicted over a
    request's decode (30 ms for 10 s, then 50 ms for 10 s, then idle), not the step it joined
    at: a batch that grew under it counts as it grew."""
    ledger = StepLedger(keep_s=100.0)
    ledger.record("d0", 0.03, 10.0)
    ledger.record("d0", 0.03, 15.0)  # unchanged: nothing new to keep
    ledger.record("d0", 0.05, 20.0)
    ledger.record("d0", 0.0, 30.0)
    ledger.record("d0", 0.05, 29.0)  # out of order: ignored
    assert ledger.mean_step("d0", 10.0, 30.0) == pytest.approx(0.04)
    assert ledger.mean_step("d0", 15.0, 25.0) == pytest.approx(0.04)
    assert ledger.mean_step("d0", 25.0, 35.0) == pytest.approx(0.025)
    assert ledger.mean_step("d0", 12.0, 18.0) == pytest.approx(0.03)
    for unknown in (("d0", 5.0, 15.0), ("d0", 20.0, 20.0), ("d1", 10.0, 20.0)):
        assert ledger.mean_step(*unknown) is None  # before its first report, empty, no reports
    ledger.record("d0", 0.02, 200.0)  # steps older than keep_s go, the one in force stays
    assert ledger.mean_step("d0", 25.0, 35.0) is None
    assert ledger.mean_step("d0", 150.0, 210.0) == pytest.approx((50 * 0.0 + 10 * 0.02) / 60)


def test_tbt_tail_waits_until_one_outlier_cannot_be_the_quantile():
    from yuebing.conductor.policy.tail import outlier_free_samples
    assert outlier_free_samples(0.9, 32) == 10 and outlier_free_samples(0.5, 32) == 2
    assert outlier_free_samples(1.0, 32) == 32  # the maximum: wait for a full window
    got: list[float] = []
    tail = TbtTail(got.append, every=1)  # the defaults: quantile 0.9, so 10 samples
    for _ in range(8):
        tail.observe(0.06, 0.03)  # ratio 2
    tail.observe(0.3, 0.03)  # one outlier, held at 4: 9 samples, not yet
    assert got == []
    tail.observe(0.06, 0.03)  # the 10th: the 9th of ten sorted is 2, not the outlier
    assert got == [2.0]


def test_tbt_tail_median_quantile_and_clamped_ratios():
    got: list[float] = []
    tail = TbtTail(got.append, min_samples=4, every=2, quantile=0.5)
    for tbt in (0.06, 0.09, 0.12, 0.3):  # ratios 2, 3, 4, 10 -> 4
        tail.observe(tbt, 0.03)
    assert got == [3.0]  # nearest rank: the 2nd of 2, 3, 4, 4
    tail.observe(0.01, 0.03)  # ratio 1/3 counts as 1
    tail.observe(0.12, 0.03)  # 1, 2, 3, 4, 4, 4: the 3rd is 3 again, no change
    assert got == [3.0]
    with pytest.raises(ValueError, match="quantile must be in"):
        TbtTail(got.append, quantile=0.0)


def test_tbt_tail_not_learned_keeps_the_configured_one():
    got: list[float] = []
    tail = TbtTail(got.append, learn=False, initial=1.5, min_samples=1, every=1)
    tail.observe(0.3, 0.03)
    assert got == [] and tail.current == 1.5 and tail.state()["samples"] == 0


def test_step_ledger_forgets_an_instance():
    ledger = StepLedger(keep_s=100.0)
    for name in ("d0", "d1"):
        ledger.record(name, 0.03, 10.0)
    ledger.forget("d0")
    ledger.forget("d9")  # never seen: nothing to do
    assert ledger.mean_step("d0", 10.0, 20.0) is None
    assert ledger.mean_step("d1", 10.0, 20.0) == pytest.approx(0.03)


def _conductor():  # type: ignore[no-untyped-def]
    from yuebing.conductor.config import ConductorConfig
    from yuebing.conductor.model import load_model_info
    from yuebing.conductor.service import Conductor
    cfg = ConductorConfig(model="dummy:preset=tiny", access_log=False, persist_learned=False,
                          request_timeout_s=1000.0)
    return Conductor(cfg, load_model_info(cfg.model))


def test_the_conductor_keeps_steps_past_its_timeout_and_drops_a_dead_instances():
    from types import SimpleNamespace

    from yuebing.conductor.cluster import Member
    c = _conductor()
    assert c.steps.keep_s == 1500.0
    c.steps.record("d0", 0.03, 10.0)
    h = Hello(seq=0, instance_id="d0", role=Role.DECODE, model="m", fingerprint="fp", host="h",
              control_address="tcp://d0:1", kv_segment="s", block_size=16,
              store_block_tokens=256, num_blocks=64, max_model_len=4096, incarnation="i",
              num_layers=4)
    client = SimpleNamespace(fail_all=lambda reason: None)
    m = Member("tcp://d0:1", client, h)  # type: ignore[arg-type]
    c.cluster.members[m.id] = m
    c.cluster._mark_dead(m, "d0 died")
    assert c.steps.mean_step("d0", 10.0, 20.0) is None


def test_the_tail_is_taken_over_the_decode_from_the_second_token():
    """The first token is the prefill's (in 1P1D it comes before the KV transfer and before the
    decode's batch holds the request): the ledger is asked from the second token to the last."""
    from yuebing.conductor.server import _Routes
    from yuebing.conductor.stats import RequestStats

    asked: list[tuple[str, float, float]] = []

    class Spy(StepLedger):
        def mean_step(self, instance: str, start_s: float, end_s: float) -> float | None:
            asked.append((instance, start_s, end_s))
            return super().mean_step(instance, start_s, end_s)

    c = _conductor()
    c.steps = Spy()
    c.steps.record("d0", 0.01, 0.0)
    c.steps.record("d0", 0.02, 1.0)  # the decode's batch from t = 1: 20 ms a step
    times = [0.96 + 0.04 * k for k in range(11)]
    done = RequestStats("r1", arrival_s=0.0, completion_tokens=len(times), decode_id="d0",
                        first_token_s=times[0], token_times=times, end_s=times[-1],
                        prefill_busy=True)
    short = RequestStats("r2", arrival_s=0.0, completion_tokens=2, decode_id="d0",
                         first_token_s=1.0, token_times=[1.0, 1.04], end_s=1.04,
                         prefill_busy=True)
    _Routes(c)._done([done, short], 200)
    assert asked == [("d0", times[1], times[-1])]  # the two-token one: no decode to average
    assert list(c.tail.window) == [pytest.approx(done.tbt_s / 0.02)]
