"""Exposure rules at start-up: every role binds 127.0.0.1 by default; a bind beyond loopback
needs the cluster token (RPC and control ports) or an API key (the HTTP API), else the command
fails before anything starts, with an error naming the flag. The token never reaches a child's
command line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from yuebing.cli.main import main
from yuebing.cluster.serve import MANAGED, ServeConfig, ServePlan
from yuebing.conductor.config import ConductorConfig
from yuebing.core.auth import CLUSTER_TOKEN_ENV, is_loopback
from yuebing.core.errors import ConfigError
from yuebing.instance.config import InstanceConfig
from yuebing.store.config import MasterConfig, NodeConfig
from yuebing.transfer import TransferConfig

TOKEN = "serve-token"


def test_every_default_bind_is_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    assert MasterConfig().rpc_address.startswith("tcp://127.0.0.1:")
    assert MasterConfig().admin_host == NodeConfig().admin_host == "127.0.0.1"
    assert InstanceConfig().host == InstanceConfig().admin_host == "127.0.0.1"
    assert TransferConfig().host == "127.0.0.1"
    assert ConductorConfig().host == "127.0.0.1"
    s = ServeConfig()
    assert s.host == s.advertise_host == "127.0.0.1" and s.cluster_token == ""
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("myhost")


def test_conductor_http_beyond_loopback_needs_an_api_key() -> None:
    with pytest.raises(ConfigError, match="--host '0.0.0.0' exposes the HTTP API.*--api-key"):
        ConductorConfig(host="0.0.0.0")
    cfg = ConductorConfig(host="0.0.0.0", api_key="k3y", cluster_token=TOKEN)
    assert "k3y" not in repr(cfg) and TOKEN not in repr(cfg)


def test_serve_beyond_loopback_needs_token_and_api_key(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="--advertise-host binds '10.0.0.1'.*--cluster-token"):
        ServeConfig(advertise_host="10.0.0.1")
    ServeConfig(advertise_host="10.0.0.1", cluster_token=TOKEN)
    with pytest.raises(ConfigError, match="--host '0.0.0.0' exposes the HTTP API"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", conductor=ConductorConfig(api_key="k"))
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, TOKEN)  # the variable counts as the flag
    assert ServeConfig(advertise_host="10.0.0.1").cluster_token == TOKEN


def test_token_is_never_forwarded_on_a_command_line(tmp_path: Path) -> None:
    assert {"cluster_token"} <= set(MANAGED["conductor"]) & set(MANAGED["instance"])
    cfg = ServeConfig(cluster_token=TOKEN, conductor=ConductorConfig(cluster_token=TOKEN),
                      instance=InstanceConfig(cluster_token=TOKEN))
    for stage in ServePlan(cfg, tmp_path).stages():
        for spec, _ in stage:
            assert TOKEN not in spec.argv and "--cluster-token" not in spec.argv, spec.argv


def test_cli_refuses_to_start_exposed_without_a_token(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    assert main(["store", "master", "--rpc-address", "tcp://0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert "--rpc-address binds '0.0.0.0', beyond this host: set a cluster token" in err
    (token,) = [f for f in dataclasses.fields(MasterConfig) if f.name == "cluster_token"]
    help_text = token.metadata["help"]
    assert "YUEBING_CLUSTER_TOKEN" in help_text
