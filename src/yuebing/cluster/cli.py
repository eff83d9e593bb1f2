"""Flags of ``yuebing serve`` (no role) and their turning into a `ServeConfig`.

Called by ``yuebing.cli.cmd_serve``. The all-in-one offers its own flags (`ServeConfig`,
`SupervisorConfig`), the Conductor's (`conductor.cli`) and the instances' (`InstanceConfig`),
less those it sets itself for each child (``MANAGED``: addresses, ids, discovery, ready files,
the token). It builds the Conductor's and the instances' configs from them, so a bad value
fails before any process starts; `ServePlan` gives each child the flags of its config. With no
topology flag, `default_topology` chooses one coupled instance on a CPU host of fewer than
`SMALL_HOST_CORES` cores, else 1P1D.
"""

from __future__ import annotations

import argparse
import logging
from typing import cast

from yuebing.cluster.config import SupervisorConfig
from yuebing.cluster.serve import MANAGED, ServeConfig, run_serve
from yuebing.conductor.policy import PolicyConfig
from yuebing.core.config import add_config_args, config_flags, config_from_args
from yuebing.core.cpus import usable_cpus
from yuebing.core.errors import ConfigError
from yuebing.engine.config import EngineConfig

log = logging.getLogger(__name__)

SMALL_HOST_CORES = 4
"""Below this many usable cores, ``yuebing serve`` with no topology flags runs one coupled
instance on all of them (`default_topology`; docs/serving.md "Defaults, and why")."""

SERVE_FIELDS = ("prefill", "decode", "coupled", "cpp_group", "cpp_layers", "host", "port",
                "advertise_host", "etcd", "cluster", "store", "store_dram", "store_port",
                "cluster_token", "engine", "vllm_lend_cores", "ready_file")

def conductor_flags() -> list[str]:
    """The Conductor's fields offered by ``yuebing serve`` (the managed ones and the
    all-in-one's own left out)."""
    from yuebing.conductor.cli import conductor_fields

    return [n for n in conductor_fields() if n not in MANAGED["conductor"]
            and n not in SERVE_FIELDS]


def instance_flags() -> list[str]:
    """The instances' fields offered by ``yuebing serve``; those the Conductor also has
    (``--model``, ``--store-block-tokens``) are offered once and given to both."""
    from yuebing.instance.config import InstanceConfig

    shared = set(conductor_flags())
    return [n for n in config_flags(InstanceConfig) if n not in MANAGED["instance"]
            and n not in SERVE_FIELDS and n not in shared]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the all-in-one's flags to ``p`` (the ``serve`` command's parser)."""
    from yuebing.conductor.cli import add_conductor_args
    from yuebing.instance.config import InstanceConfig

    add_config_args(p, ServeConfig, only=SERVE_FIELDS)
    add_config_args(p, SupervisorConfig)
    group = p.add_argument_group("conductor flags (as `yuebing serve conductor`; --model and "
                                 "--store-block-tokens are also given to the instances)")
    add_conductor_args(cast(argparse.ArgumentParser, group),
                       skip=(*MANAGED["conductor"], *SERVE_FIELDS))
    group = p.add_argument_group("instance flags (given to every prefill, decode and coupled "
                                 "instance)")
    add_config_args(cast(argparse.ArgumentParser, group), InstanceConfig, only=instance_flags())


def _only(ns: argparse.Namespace, names: list[str]) -> argparse.Namespace:
    """The values of ``names`` in ``ns`` (others absent: they keep the config's default)."""
    return argparse.Namespace(**{n: getattr(ns, n, None) for n in names})


def default_topology(ns: argparse.Namespace, cores: int) -> bool:
    """Choose the topology where no flag does: on a CPU host of fewer than `SMALL_HOST_CORES`
    usable ``cores`` with our engine and no other hosts (no ``--etcd``), one coupled instance
    on every core (``--coupled 1 --threads cores``) instead of 1P1D. Splitting two cores
    leaves the prefill one: its TTFT doubles while the decode's core idles between tokens;
    sharing them interleaves prefill chunks with decode steps, which costs TPOT and the TBT
    tail (docs/benchmarks.md, issue 25). Sets ``ns`` and returns True when it chose coupled.
    """
    topology = (ns.prefill, ns.decode, ns.coupled, ns.cpp_group, ns.etcd)
    if any(v is not None for v in topology) or cores >= SMALL_HOST_CORES or \
            getattr(ns, "engine", None) not in (None, "yuebing") or not _cpu(ns):
        return False
    ns.coupled = 1
    if getattr(ns, "threads", None) is None:
        ns.threads = cores
    log.info("%d usable cores: one coupled instance on %d threads, prefill and decode sharing "
             "them (--prefill 1 --decode 1 disaggregates)", cores, ns.threads)
    return True


MIXED_STEP_SHARE = EngineConfig().mixed_step_s / PolicyConfig().tbt_slo_s
"""The share of the TBT SLO a mixed step may take (``--mixed-step-s``, where not given): the
engine's default over the default SLO's (0.9)."""


def mixed_step_from_slo(ns: argparse.Namespace) -> None:
    """A TBT SLO given (``--tbt-slo``) and no ``--mixed-step-s``: a prefill chunk beside running
    decodes is sized to `MIXED_STEP_SHARE` of that SLO (the engine's default is 90 % of the
    default 100 ms)."""
    slo = getattr(ns, "tbt_slo_s", None)
    if slo is not None and getattr(ns, "mixed_step_s", None) is None and slo > 0:
        ns.mixed_step_s = MIXED_STEP_SHARE * slo


def _cpu(ns: argparse.Namespace) -> bool:
    """Whether the instances' engines run on the CPU (``--device`` cpu, the default, or auto
    on a host where torch sees no CUDA device)."""
    device = getattr(ns, "device", None)
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device in (None, "cpu")


def serve_config_from_args(ns: argparse.Namespace) -> ServeConfig:
    """Build the `ServeConfig` from the parsed flags of ``yuebing serve``, the Conductor's
    and the instances' configs included (a bad value fails here, before any process starts)."""
    from yuebing.conductor.cli import conductor_config
    from yuebing.instance.config import InstanceConfig

    default_topology(ns, len(usable_cpus()))
    mixed_step_from_slo(ns)
    if ns.coupled and (ns.prefill is not None or ns.decode is not None):
        raise ConfigError("--coupled K replaces --prefill/--decode: give one or the other")
    role = "coupled" if ns.coupled else "prefill"
    shared = [n for n in conductor_flags() if n in config_flags(InstanceConfig)]
    return config_from_args(
        ServeConfig, ns, verbose=getattr(ns, "verbose", 0),
        supervisor=config_from_args(SupervisorConfig, ns),
        conductor=conductor_config(_only(ns, conductor_flags())),
        instance=config_from_args(InstanceConfig, _only(ns, instance_flags() + shared),
                                  role=role))


def run_serve_command(ns: argparse.Namespace) -> int:
    """``yuebing serve``: parse into a `ServeConfig` and run `run_serve`."""
    return run_serve(serve_config_from_args(ns))
