"""Generated tokens are saved (``save_decode``): the next turn of a chat, whose prompt holds this
turn's answer, loads the answer's KV instead of recomputing it, on any replica."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm_model
from oracles import gen
from test_vllm_unit import BS, ask, facts, make_connector, paged, run_worker, step
from vllm_engines import run_engine

from kvstore.connectors.vllm.plan import lookup_limit, save_ends
from kvstore.metrics.catalog import DECODE_CHUNKS
from kvstore.stores.memory import MemoryStore


def test_save_ends_follow_the_generated_tokens():
    kw = {"chunk_tokens": 64, "block_size": BS, "save_partial": True}
    assert save_ends(100, 100, 0, **kw) == [64, 96]  # the prompt: a whole chunk and its hittable end
    assert save_ends(100, 101, 96, **kw, num_tokens=101) == []
    assert save_ends(100, 128, 96, **kw, num_tokens=128) == [128]  # a chunk of generated tokens filled
    assert save_ends(100, 128, 96, **kw, num_tokens=120) == []  # never past the tokens known
    assert save_ends(100, 128, 96, **kw) == []  # without num_tokens: the prompt only


class GrowingRequest(SimpleNamespace):
    """A request whose ``all_token_ids`` grows by one sampled token per decode step."""


def test_decode_steps_save_each_chunk_of_generated_tokens_once():
    store = MemoryStore()
    sched, work = make_connector("scheduler", store, facts()), make_connector("worker", store, facts())
    work.register_kv_caches(paged("cpu"))
    prompt = list(range(2000, 2100))
    req = GrowingRequest(request_id="c", prompt_token_ids=prompt, all_token_ids=list(prompt), cache_salt=None)
    assert ask(sched, req, 0) == (0, False)
    blocks = list(range(1, 9))
    sched._kv_cache_manager.blocks["c"] = blocks
    sched.update_state_after_alloc(req, None, 0)
    before = DECODE_CHUNKS.total()
    meta = step(sched, req, blocks, computed=0, scheduled=100, new=True)
    assert [s.ends for s in meta.saves] == [[64, 96]]
    run_worker(work, meta)
    planned = []
    for computed in range(100, 140):  # decode: each step feeds the last sampled token
        req.all_token_ids.append(5000 + computed)
        meta = step(sched, req, blocks, computed=computed, scheduled=1, new=False)
        planned += [(computed, s.ends, s.start, len(s.tokens)) for s in meta.saves]
        run_worker(work, meta)
    assert planned == [(127, [128], 96, 128)]  # the step that computes token 127 fills chunk [64, 128)
    assert DECODE_CHUNKS.total() == before + 1
    # A reader whose prompt is this turn's prompt and answer (and more) hits the generated chunk.
    reader = make_connector("scheduler", store, facts())
    turn2 = SimpleNamespace(request_id="t2", prompt_token_ids=req.all_token_ids + list(range(7000, 7030)),
                            cache_salt=None)
    assert ask(reader, turn2, 0) == (128, True)


@pytest.mark.vllm
def test_the_next_turn_of_a_chat_loads_the_previous_answer(tmp_path_factory):
    model = str(vllm_model.write_model(tmp_path_factory.mktemp("tiny-llama-decode")))
    turn1 = vllm_model.prompt(51, 300)
    url = f"file://{tmp_path_factory.mktemp('decode-kv')}"
    connector = {"store": [url], "chunk_tokens": 64}
    info = {"engine_info": True}
    # One replica serves turn 1; turn 2 (turn 1, its answer, a new message) goes to another.
    writer = run_engine({"model": model, "connector": connector, "actions": [gen([turn1], max_tokens=100), info]})
    answer = writer["results"][0]["tokens"][0]
    turn2 = turn1 + answer + vllm_model.prompt(52, 40)
    # vLLM alone, both turns in one engine: its own prefix cache keeps the answer's blocks (the
    # numerics of KV computed while decoding), which is what a load gives the other replica.
    alone = run_engine({"model": model, "connector": None,
                        "actions": [gen([turn1], max_tokens=100), gen([turn2]), info]})
    reader = run_engine({"model": model, "connector": connector, "actions": [gen([turn2]), info]})
    assert alone["results"][0]["tokens"][0] == answer
    # Turn 1's prompt and answer hold 399 computed tokens: whole chunks up to 384 are stored.
    stored = (len(turn1) + len(answer) - 1) // 64 * 64
    assert stored == 384 and lookup_limit(len(turn2), vllm_model.BLOCK_SIZE) > stored
    assert reader["results"][1]["kvstore"]["tokens_loaded"] == stored
    assert reader["results"][0]["cached"] == [stored] == alone["results"][1]["cached"]
    assert reader["results"][0]["tokens"] == alone["results"][1]["tokens"]
