"""`yuebing serve --prefill 2 --cpp-group 2` end to end (dummy model, no store): the two
prefill instances are the stages of one pipeline group with a whole-model twin each; a long
prompt goes through the group, a short one to a twin (the group is idle), and SIGINT stops
everything."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest
from serve_util import Serve, post

MODEL = "dummy:preset=tiny,layers=4,ctx=4096"


@pytest.mark.slow  # four prefill instances start: ~90 s on a busy 2-core machine
def test_serve_sets_up_a_pipeline_group_on_one_host(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    serve = Serve(["serve", "--port", str(port), "--log-dir", str(tmp_path), "--no-store",
                   "--model", MODEL, "--prefill", "2", "--decode", "1", "--cpp-group", "2",
                   "--max-batch-tokens", "128", "--no-startup-profile",
                   "--heartbeat-timeout-s", "30"])
    try:
        ready = serve.wait_for("yuebing serve: ready")
        assert "prefill-0 0:2" in ready and "prefill-1 2:4" in ready, ready
        base = f"http://127.0.0.1:{port}"
        body = post(base + "/v1/completions", {"model": MODEL, "prompt": list(range(1, 400)),
                                                "max_tokens": 4, "ignore_eos": True})
        assert body["usage"]["completion_tokens"] == 4
        assert body["usage"]["yuebing"]["prefill_instance"] == "cpp-0"
        assert "whole-model twins twin-0, twin-1" in ready, ready
        short = post(base + "/v1/completions", {"model": MODEL, "prompt": list(range(1, 60)),
                                                 "max_tokens": 4, "ignore_eos": True})
        assert short["usage"]["completion_tokens"] == 4
        assert short["usage"]["yuebing"]["prefill_instance"] in ("twin-0", "twin-1"), short
    except BaseException:
        serve.kill()
        raise
    assert serve.stop(signal.SIGINT, timeout_s=120) == 0, serve.output()
