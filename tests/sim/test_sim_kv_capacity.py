"""A request whose KV can never fit a decode instance (issue 15 item 18): every system rejects it
at arrival with reason ``kv_capacity`` (no ValueError traceback) and runs the rest."""

from __future__ import annotations

import json

import pytest

from yuebing.cli.main import main


@pytest.mark.parametrize("system", ["mooncake", "vllm", "vllm_prefix_caching",
                                    "vllm_chunked_prefill"])
def test_request_bigger_than_decode_kv_is_rejected_at_arrival(tmp_path, capsys, system):
    p = tmp_path / "big.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 100, "input_length": 100000000, "output_length": 5, '
                 '"hash_ids": [1]}\n')
    assert main(["sim", "run", str(p), "--system", system, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert (s["requests"], s["completed"], s["rejected"]) == (2, 1, 1)
    assert s["rejected_by_reason"] == {"kv_capacity": 1}
