"""yuebing.bench: the load generator behind ``yuebing bench serve`` (docs/bench.md).

Life cycle of a request here: `workload.build_workload` turns a trace request into a
`BenchRequest` (prompt token ids or text realizing the trace's prefix sharing, output length,
send time); `runner` sends it on schedule (or when a closed-loop slot frees) through
`client.send`, which streams the answer and timestamps each output event into a
`result.RequestResult`; `metrics.summarize` aggregates a run and `report` prints, plots and
writes it. May import `yuebing.trace` and `yuebing.core` only (DESIGN.md §2).
"""
