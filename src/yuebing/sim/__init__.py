"""yuebing.sim: a discrete-event simulator of Mooncake and of coupled vLLM-like baselines.

A run (`yuebing.sim.runner.simulate`) replays trace requests (`workload`) through one system
(`system.SYSTEMS`: ``mooncake`` in `mooncake`, the ``vllm*`` baselines in `vllm`) on one event
loop (`loop`), timing work with a cost model (`hardware`) and recording every request
(`metrics`). Mooncake routes with the shared Conductor policy (`yuebing.conductor.policy`);
`paper` reproduces the FAST'25 figures. Module map: docs/structure.md.
"""
