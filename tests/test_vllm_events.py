"""KV events from a real vLLM CPU engine: with ``kv_events_endpoint`` its worker announces every
chunk it saves, in the engine's own block size, with the tokens a router keys them by; a router
that joins late gets them through the replay socket (vLLM's own decoder reads them)."""

from __future__ import annotations

import pytest
import vllm_model
from oracles import gen
from vllm_engines import run_engine

pytestmark = pytest.mark.vllm


def _replay(endpoint: str) -> list:
    """Every buffered batch's events, from sequence 0, as vLLM's decoder reads them."""
    import zmq
    from test_events import replayed

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        return [event for _, batch in replayed(sock, 0) for event in batch.events]
    finally:
        sock.close(linger=0)


def test_an_engine_announces_its_saves_to_routers(tmp_path_factory):
    model = str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama-events")))
    sockets = tmp_path_factory.mktemp("events")
    prompt = vllm_model.prompt(61, 300)
    connector = {"store": ["memory://"], "chunk_tokens": 64, "kv_events_endpoint": f"ipc://{sockets}/pub.sock",
                 "kv_events_replay_endpoint": f"ipc://{sockets}/replay.sock", "save_mode": "sync"}
    seen: list = []
    out = run_engine({"model": model, "connector": connector,
                      "actions": [gen([prompt], max_tokens=4), {"wait": "events"}]},
                     stdin_hook=lambda _: seen.extend(_replay(f"ipc://{sockets}/replay.sock")))
    stored = [e for e in seen if type(e).__name__ == "BlockStored"]
    assert stored, out["log"][-3000:]
    # The prompt's whole chunks (4 of 64 tokens below the 288 a hit can reach), as the engine's blocks.
    assert [t for e in stored for t in e.token_ids] == prompt[:256]
    assert all(e.block_size == vllm_model.BLOCK_SIZE and e.medium == "CPU" for e in stored)
    assert sum(len(e.block_hashes) for e in stored) == 256 // vllm_model.BLOCK_SIZE
    assert stored[0].parent_block_hash is None
