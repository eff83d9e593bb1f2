"""`yuebing serve` end to end with the real roles and the default model: a chat request
(streamed and not) through the Conductor, then SIGINT stops every process it started and
leaves no shared-memory segment of theirs; a role that fails at start stops everything with a
message naming it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from serve_util import (
    Serve,
    alive,
    chat,
    cmdline,
    descendants,
    log_dir_of,
    procs_mentioning,
    shm_files_of,
    stream,
)

from yuebing.cluster.cli import SMALL_HOST_CORES
from yuebing.core.cpus import usable_cpus

pytestmark = pytest.mark.slow


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_answers_and_sigint_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    # a generous heartbeat timeout: on a loaded machine a busy instance's reports can lag 2 s
    ready = tmp_path / "serve.ready.json"
    serve = Serve(["serve", "--port", str(port), "--log-dir", str(tmp_path),
                   "--store-dram", "64MiB", "--stop-grace-s", "20",
                   "--heartbeat-timeout-s", "30", "--ready-file", str(ready)])
    try:
        url_line = serve.wait_for("OpenAI API:")
        base = f"http://127.0.0.1:{port}"
        assert url_line.strip() == f"OpenAI API: {base}/v1"
        curl = serve.wait_for("curl ")
        assert f"curl {base}/v1/chat/completions" in curl and '"stream": true' in curl
        serve.wait_for("Ctrl-C stops every process.")
        assert json.loads(ready.read_text()) == {"url": base, "pid": serve.proc.pid,
                                                 "log_dir": str(tmp_path)}
        # the default topology: one coupled instance on a host of < 4 cores, else 1P1D
        small = len(usable_cpus()) < SMALL_HOST_CORES
        instances = {"coupled-0.log"} if small else {"prefill-0.log", "decode-0.log"}
        pids = descendants(serve.proc.pid)
        assert len(pids) >= 3 + len(instances)  # master, node, instances, conductor
        assert {p.name for p in tmp_path.glob("*.log")} >= {
            "store-master.log", "store-node.log", "conductor.log", *instances}
        reply = chat(base, "What is the capital of France?", max_tokens=8)
        text = reply["choices"][0]["message"]["content"]
        assert text and reply["usage"]["completion_tokens"] >= 1
        chunks = list(stream(base + "/v1/chat/completions",
                             {"model": "smollm2-135m-instruct", "max_tokens": 8,
                              "temperature": 0,
                              "messages": [{"role": "user",
                                            "content": "What is the capital of France?"}]}))
        streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in chunks if c.get("choices"))
        assert streamed == text
    except BaseException:
        serve.kill()
        raise
    assert serve.stop(signal.SIGINT, timeout_s=120) == 0, serve.output()
    assert "yuebing serve: stopped" in serve.output()
    assert not [p for p in pids if alive(p)]
    assert procs_mentioning(str(tmp_path)) == []
    assert shm_files_of(pids) == []


def test_role_failing_at_start_stops_everything(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    serve = Serve(["serve", "--port", str(free_port()), "--log-dir", str(tmp_path / "logs"),
                   "--store-dram", "16MiB", "--model", str(missing), "--prefill", "1",
                   "--decode", "1"])
    try:
        code = serve.proc.wait(300)
    finally:
        serve.kill()
    out = serve.output()
    assert code == 1, out
    assert "exited while starting" in out and "stopping every role" in out
    failed = out.split("yuebing serve: role ", 1)[1].split(" ", 1)[0]
    assert failed in ("prefill-0", "decode-0")
    assert str(log_dir_of(serve) / f"{failed}.log") in out
    assert str(missing) in out  # the role's own error, quoted from its log
    assert "OpenAI API" not in out
    assert procs_mentioning(str(tmp_path)) == []


def test_killed_instance_is_restarted_and_serves_again(tmp_path: Path) -> None:
    import os
    import time
    import urllib.error

    port = free_port()
    serve = Serve(["serve", "--port", str(port), "--log-dir", str(tmp_path),
                   "--store-dram", "16MiB", "--prefill", "1", "--decode", "1"])
    base = f"http://127.0.0.1:{port}"
    try:
        serve.wait_for("Ctrl-C stops every process.")
        decode = next(p for p in descendants(serve.proc.pid)
                      if "--instance-id decode-0 " in cmdline(p))
        os.kill(decode, signal.SIGKILL)
        died = serve.wait_for("died:")
        assert f"role decode-0 (pid {decode}) died: killed by SIGKILL" in died
        serve.wait_for("decode-0 will restart in 1s (restart 1 of at most 5 in 600s)")
        serve.wait_for("decode-0 is back")
        deadline = time.monotonic() + 60
        while True:  # the Conductor takes the new incarnation back when it answers
            try:
                reply = chat(base, "What is the capital of France?")
                break
            except urllib.error.HTTPError as e:  # until the view settles (load may delay it)
                assert time.monotonic() < deadline, (e.code, e.read())
                time.sleep(0.5)
        assert reply["usage"]["yuebing"]["decode_instance"] == "decode-0"
        assert (tmp_path / "decode-0.log").read_text().count("--- ") == 2  # appended, 2 starts
    except BaseException:
        serve.kill()
        raise
    assert serve.stop(signal.SIGINT, timeout_s=120) == 0, serve.output()
    assert procs_mentioning(str(tmp_path)) == []
