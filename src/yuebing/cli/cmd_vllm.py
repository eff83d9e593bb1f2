"""``yuebing vllm instance``: a vLLM OpenAI server as a yuebing instance (coupled, prefill or
decode) under the Conductor (`yuebing.integrations.vllm.run`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from yuebing.cli.main import Command
from yuebing.core.config import add_config_args, config_from_args


def _add(p: argparse.ArgumentParser) -> None:
    from yuebing.integrations.vllm.instance import VllmInstanceConfig

    add_config_args(p, VllmInstanceConfig)
    p.add_argument("--log-dir", type=Path, default=None, help="where the vLLM log goes")
    p.add_argument("--ready-file", default="", help="write JSON here once serving")


def _run(ns: argparse.Namespace) -> int:
    from yuebing.integrations.vllm.instance import VllmInstanceConfig
    from yuebing.integrations.vllm.run import run_vllm_instance

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run_vllm_instance(config_from_args(VllmInstanceConfig, ns), ns.ready_file,
                             ns.log_dir)


COMMANDS = [Command(("vllm", "instance"),
                    "a vLLM server as an instance of the Conductor (vLLM in its own venv)",
                    _add, _run)]
