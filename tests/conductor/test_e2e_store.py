"""End to end through the store (issue 13, Correctness): two requests sharing a 2,048-token
prefix, on the all-in-one ``yuebing serve`` (store master + node, 2 prefill + 1 decode, the
Conductor following the store's KV events). Under ``load_balance`` the second request lands on
the other prefill instance and loads the prefix from the store; under ``global_cache_aware``
it goes where the prefix is."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import request

pytestmark = pytest.mark.slow
MODEL = "dummy:preset=tiny,ctx=4096"


class Serve:
    """``yuebing serve`` as a child process; ``url`` from its banner."""

    def __init__(self, *args: str, timeout_s: float = 300.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yb-conductor-store-"))
        self.out = self.dir / "serve.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yuebing.cli.main", "serve", "--model", MODEL, "--port", "0",
             "--log-dir", str(self.dir / "logs"), *args], stdout=self.out.open("wb"),
            stderr=subprocess.STDOUT, env={**os.environ}, start_new_session=True)
        end = time.monotonic() + timeout_s
        while True:
            m = re.search(r"OpenAI API: (http://\S+)/v1", self.out.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"yuebing serve did not start:\n{self.out.read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _complete(url: str, prompt: list[int], out: list[Any] | None = None) -> dict[str, Any]:
    status, body = request(url, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout_s=120)
    assert status == 200, body
    usage = body["usage"]
    if out is not None:
        out.append(usage)
    return usage  # type: ignore[no-any-return]


def _wait_health(url: str, ok: Callable[[dict[str, Any]], bool], what: str,
                 timeout_s: float = 30.0) -> None:
    """Poll the Conductor's /health until ``ok(health)``; fail naming ``what`` after
    ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not ok(health := request(url, "GET", "/health")[1]):
        assert time.monotonic() < end, f"{what} not seen in {timeout_s:g} s: {health}"
        time.sleep(0.02)


def _prefills_idle(health: dict[str, Any]) -> bool:
    return all(x["running"] == x["queued_requests"] == x["queued_prefill_tokens"] == 0
               for x in (health["load"][i] for i in health["instances"]["prefill"]))


@pytest.fixture(scope="module", params=["load_balance", "global_cache_aware"])
def serve(request: pytest.FixtureRequest) -> Iterator[tuple[str, Serve]]:
    s = Serve("--prefill", "2", "--decode", "1", "--prefill-policy", request.param)
    yield request.param, s
    s.stop()


def test_shared_prefix_is_loaded_from_the_store_or_routed_to_its_holder(
        serve: tuple[str, Serve]) -> None:
    policy, s = serve
    rng = random.Random(5)
    prefix = [rng.randrange(1, 500) for _ in range(2048)]
    first = _complete(s.url, [*prefix, 7, 8, 9])
    holder = first["yuebing"]["prefill_instance"]
    _wait_health(s.url, lambda h: h["kv_index_store_blocks"] >= 8,
                 "the prefix's store blocks in the Conductor's index (store KV events)")
    if policy == "global_cache_aware":  # both idle: the prefix's holder is the fastest
        second = _complete(s.url, [*prefix, 10, 11, 12, 13])
        assert second["yuebing"]["prefill_instance"] == holder
        assert second["prompt_tokens_details"]["cached_tokens"] >= 1792
        return
    # load_balance: keep the holder busy with an unrelated long prompt, then the second
    # request goes to the other instance, which loads the prefix from the store. Ties go to
    # the first instance listed, the holder; wait until both report idle so that the blocker
    # meets a tie rather than the holder's stale report of the first request.
    _wait_health(s.url, _prefills_idle, "both prefill instances idle")
    blocker: list[Any] = []
    t = threading.Thread(target=_complete, args=(
        s.url, [rng.randrange(1, 500) for _ in range(3500)], blocker))
    t.start()
    _wait_health(s.url, lambda h: h["load"][holder]["running"]  # routed before the second
                 + h["load"][holder]["queued_requests"] >= 1, f"the blocker on {holder}")
    second = _complete(s.url, [*prefix, 10, 11, 12, 13])
    t.join(120)
    assert blocker[0]["yuebing"]["prefill_instance"] == holder
    assert second["yuebing"]["prefill_instance"] != holder
    assert second["yuebing"]["prefix_source"] == "store"
    assert second["prompt_tokens_details"]["cached_tokens"] >= 1792
