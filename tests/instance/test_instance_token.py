"""An instance's control socket with a cluster token: clients without it or with a wrong one
get no answer (the handshake fails before any message), clients with it are served; a
non-loopback --host without a token is a start-up error."""

from __future__ import annotations

import asyncio

import pytest
from instance_procs import TINY, InstanceProc

from yuebing.core.errors import ConfigError
from yuebing.instance.client import InstanceClient, InstanceUnavailable
from yuebing.instance.config import InstanceConfig

TOKEN = "inst-token"


def test_non_loopback_control_bind_needs_a_token() -> None:
    with pytest.raises(ConfigError, match="--host binds '0.0.0.0'.*--cluster-token"):
        InstanceConfig(host="0.0.0.0", cluster_token="")
    assert TOKEN not in repr(InstanceConfig(host="0.0.0.0", cluster_token=TOKEN))


def test_control_socket_refuses_clients_without_the_token() -> None:
    p = InstanceProc("coupled", TINY, "--cluster-token", TOKEN, "--num-blocks", "64")

    async def main() -> None:
        for token in ("", "wrong"):
            c = InstanceClient(p.address, timeout_s=1.0, token=token)
            with pytest.raises(InstanceUnavailable):
                await c.ping()
            await c.close()
        c = InstanceClient(p.address, timeout_s=5.0, token=TOKEN)
        await c.ping()
        hello = await c.subscribe()
        assert hello.instance_id == p.hello["instance_id"]
        await c.close()

    try:
        asyncio.run(main())
        assert "wrong cluster token" in p.log()
    finally:
        p.stop()
