"""Prefix loading: a task's `PrefixPlan` brought into the engine's prefix cache, from the store
(the KV connector) or from another instance (Algorithm 1's transfer from the holder, which also
replicates hot blocks), and the holder's half of that transfer.

Called by `coupled.CoupledRole` (also inside `prefill.PrefillRole`) on the loop: `load_prefix`
before a task joins the engine, `serve_fetch` for a peer's `FetchPrefix`; the role holds the
`PeerClients`. From a peer: the holder WRITEs the KV of its longest cached run of the prompt's
blocks into this instance's staging memory, then it is installed in the prefix cache
(`fetch_from_peer`). A fingerprint mismatch or a cold holder is a miss, never wrong KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import torch

from yuebing.core.errors import ConfigError
from yuebing.engine.config import parse_group_layers
from yuebing.engine.engine import LLMEngine
from yuebing.engine.kv_transfer import import_prefix
from yuebing.instance.base import Refused
from yuebing.instance.client import InstanceClient
from yuebing.instance.connector import Loaded
from yuebing.protocol.instance import ErrorCode, Fetched, FetchPrefix, PrefixPlan
from yuebing.transfer.types import OpCode, TransferRequest

if TYPE_CHECKING:
    from yuebing.instance.base import Instance, Task

log = logging.getLogger(__name__)

LATE_WRITE_S = 2.0
"""Beyond the transfer timeout, how long a failed fetch's staging range stays out of use."""


async def load_prefix(inst: Instance, peers: PeerClients, task: Task,
                      plan: PrefixPlan | None) -> int:
    """Bring the planned prefix into the engine's prefix cache (store or peer); returns
    tokens loaded into it (0 for a local plan or a miss: the engine finds what it has)."""
    if plan is None or plan.tokens <= 0 or plan.source == "local":
        return 0
    t0 = time.time()
    try:
        if plan.source == "store":
            ranges = _ranges(inst, plan)
            loaded: Loaded = await asyncio.wrap_future(
                inst.connector.submit_fetch(task.token_ids, plan.tokens, ranges))
            ids = task.token_ids
            return await inst.driver.run(lambda e: inst.connector.install(e, ids, loaded))
        if plan.source == "peer":
            return await fetch_from_peer(inst, peers, task, plan)
        raise Refused(ErrorCode.BAD_REQUEST, f"prefix source must be local, store or peer, "
                      f"got {plan.source!r}")
    finally:
        task.breakdown.prefix_load_s = time.time() - t0


def _ranges(inst: Instance, plan: PrefixPlan) -> list[tuple[int, int]]:
    """The plan's pipeline-group layer ranges (checked to tile the model; a stage loads its
    own range's objects only, so none)."""
    if not plan.layer_ranges or inst.engine.staged:
        return []
    try:
        return parse_group_layers(plan.layer_ranges, inst.engine.model_config.num_layers)
    except ConfigError as e:
        raise Refused(ErrorCode.BAD_REQUEST, f"prefix plan: {e}") from e


def _cached_run(engine: LLMEngine, ids: list[int], max_blocks: int) -> list[int]:
    bs, alloc = engine.block_size, engine.allocator
    blocks = []
    for i, key in enumerate(engine.block_keys(ids[:max_blocks * bs])):
        b = alloc.lookup(key, ids[i * bs:(i + 1) * bs])
        if b is None:
            break
        blocks.append(b)
    return blocks


async def serve_fetch(inst: Instance, msg: FetchPrefix) -> Fetched:
    """Holder side: copy the cached run out (driver thread), WRITE it to the requester."""
    engine = inst.engine
    if msg.fingerprint != engine.fingerprint or msg.max_tokens <= 0:
        return Fetched(seq=msg.seq, blocks=0)
    max_blocks = min(msg.max_tokens // engine.block_size,
                     msg.capacity_bytes // engine.pool.block_nbytes)
    ids = list(msg.token_ids)

    def export(e: LLMEngine) -> torch.Tensor | None:
        run = _cached_run(e, ids, max_blocks)
        return e.pool.export_blocks(run) if run else None

    data = await inst.driver.run(export)
    left = msg.deadline_s - time.time() if msg.deadline_s else inst.cfg.transfer_timeout_s
    if data is None or left <= 0:
        return Fetched(seq=msg.seq, blocks=0)  # nothing cached, or the asker gave up
    raw = data.view(torch.uint8).reshape(-1).numpy()
    req = TransferRequest(OpCode.WRITE, raw, msg.segment, msg.offset, raw.nbytes)
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: inst.transfer.transfer([req], left))
    return Fetched(seq=msg.seq, blocks=int(data.shape[0]))


async def fetch_from_peer(inst: Instance, peers: PeerClients, task: Task,
                          plan: PrefixPlan) -> int:
    """Requester side: returns the tokens now in this engine's prefix cache from the peer."""
    if not plan.peer_address:
        log.warning("%s: a peer prefix plan without peer_address; computing it",
                    task.request_id)
        return 0
    engine = inst.engine
    nblocks = min(plan.tokens, len(task.token_ids)) // engine.block_size
    taken = inst.connector.staging.take(nblocks * engine.pool.block_nbytes) if nblocks else None
    if taken is None:
        return 0
    lease, buf = taken
    give_now = True
    deadline = time.time() + inst.cfg.transfer_timeout_s
    try:
        client = peers.get(plan.peer_address)
        n = await client.fetch_prefix(FetchPrefix(
            seq=0, token_ids=task.token_ids, max_tokens=nblocks * engine.block_size,
            segment=inst.transfer.segment_name("staging"), offset=lease - 1,
            capacity_bytes=buf.numel(), fingerprint=engine.fingerprint, deadline_s=deadline),
            timeout_s=inst.cfg.transfer_timeout_s)
        if n <= 0:
            return 0
        data = buf[:n * engine.pool.block_nbytes].view(engine.pool.dtype).view(
            n, *engine.pool.block_shape)
        ids = task.token_ids
        await inst.driver.run(lambda e: import_prefix(e, ids, data, e.fingerprint))
        return n * engine.block_size
    except Exception as e:
        log.warning("%s: prefix from peer %s failed, computing it: %s", task.request_id,
                    plan.peer or plan.peer_address, e)
        # the holder may still be writing into the range: keep it out of use until any write
        # it started has hit its own deadline
        give_now = False
        asyncio.get_running_loop().call_later(max(0.0, deadline - time.time()) + LATE_WRITE_S,
                                              inst.connector.staging.give, lease)
        return 0
    finally:
        if give_now:
            inst.connector.staging.give(lease)


class PeerClients:
    """The clients of other instances' control servers, one per address (kept open, made anew
    once closed); closed with the role (`CoupledRole.close`)."""

    def __init__(self) -> None:
        self._clients: dict[str, InstanceClient] = {}

    def get(self, address: str) -> InstanceClient:
        client = self._clients.get(address)
        if client is None or client.closed:
            client = self._clients[address] = InstanceClient(address)
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
