"""The reference engine's model runner: batches, paged-block bookkeeping, the V0 KV-transfer
protocol, greedy decoding.

Per step (``step``): build a ``ModelInput`` (prefill sequences first, then decode tokens), call
``agent.recv_kv_caches_and_hidden_states`` when the batch has prefills, run the model unless
told to bypass (on the ``model_input`` the agent returned: a partial hit computes only the
suffix), call ``agent.send_kv_caches_and_hidden_states`` after, then sample greedily from the
hidden state of each sequence's last scheduled token (found through ``query_start_loc``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from kvstore.reference.config import EngineConfig
from kvstore.reference.model import LlamaModel


@dataclass(frozen=True)
class AttnMetadata:
    """Attention metadata in vLLM V0's shape (the fields KV connectors read).

    Sequences are ordered prefills first. ``seq_lens[i]`` counts the tokens of sequence ``i``
    after this step (cached context + this step's query); ``context_lens_tensor[i]`` the
    tokens already in the cache before it; ``query_start_loc`` delimits each sequence's
    scheduled tokens in the flattened batch; ``block_tables[i]`` its block ids (padded with 0).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: list[int]
    seq_lens_tensor: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens_tensor: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int


@dataclass(frozen=True)
class ModelInput:
    """The flattened batch (vLLM V0's ``ModelInputForGPU`` subset)."""

    input_tokens: torch.Tensor
    input_positions: torch.Tensor
    attn_metadata: AttnMetadata
    seq_lens: list[int]
    query_lens: list[int]


@dataclass
class Sequence:
    """One request: its prompt, generated tokens, blocks, and how many tokens are in the cache."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    block_ids: list[int]
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    first_logits: torch.Tensor | None = None
    tokens_loaded: int = 0
    tokens_computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class StepStats:
    prefill_tokens: int = 0
    computed_tokens: int = 0
    bypassed: bool = False


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    first_logits: list[torch.Tensor]
    ttft_s: float
    tokens_loaded: int
    tokens_computed: int
    bypassed: bool


def build_model_input(seqs: Seq[Sequence], block_size: int, device: str = "cpu") -> ModelInput:
    """The V0 ``ModelInput`` for one step of ``seqs`` (prefill if nothing is cached yet, else decode)."""
    prefills = [s for s in seqs if s.num_computed == 0]
    decodes = [s for s in seqs if s.num_computed > 0]
    order = prefills + decodes
    pos: list[int]
    toks, pos, slots, qsl, seq_lens, ctx = [], [], [], [0], [], []
    for s in order:
        all_tokens = s.tokens
        start = s.num_computed
        if s in decodes and len(all_tokens) - start != 1:
            raise ValueError(f"sequence {s.seq_id} has {len(all_tokens) - start} pending tokens; decode takes 1")
        new = all_tokens[start:]
        toks.extend(new)
        pos.extend(range(start, len(all_tokens)))
        ids = torch.tensor(s.block_ids, dtype=torch.int64)
        slot = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[start:len(all_tokens)]
        slots.append(slot)
        qsl.append(qsl[-1] + len(new))
        seq_lens.append(len(all_tokens))
        ctx.append(start)
    width = max(len(s.block_ids) for s in order)
    tables = torch.zeros(len(order), width, dtype=torch.int64)
    for i, s in enumerate(order):
        tables[i, :len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int64)
    num_prefill_tokens = qsl[len(prefills)]
    md = AttnMetadata(
        num_prefills=len(prefills), num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=qsl[-1] - num_prefill_tokens, slot_mapping=torch.cat(slots).to(device),
        seq_lens=seq_lens, seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64),
        context_lens_tensor=torch.tensor(ctx, dtype=torch.int64), block_tables=tables,
        max_query_len=max(b - a for a, b in pairwise(qsl)),
    )
    return ModelInput(torch.tensor(toks, dtype=torch.int64, device=device),
                      torch.tensor(pos, dtype=torch.int64, device=device), md,
                      seq_lens, [b - a for a, b in pairwise(qsl)])


class ModelRunner:
    """Runs the reference model over a paged cache, with an optional KV-transfer agent."""

    def __init__(self, config: EngineConfig, agent: Any = None, model: LlamaModel | None = None) -> None:
        self.config = config
        self.model = model or LlamaModel(config)
        self.kv_caches = self.model.allocate_kv_caches()
        self.agent = agent
        self._free = list(range(config.num_blocks - 1, -1, -1))
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Seq[int], max_new_tokens: int) -> Sequence:
        bs = self.config.block_size
        need = -(-(len(prompt) + max_new_tokens) // bs)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        # Reversed: a sequence's blocks are not in ascending order, which catches code that assumes so.
        blocks = [self._free.pop() for _ in range(need)][::-1]
        seq = Sequence(self._next_id, list(prompt), max_new_tokens, blocks)
        self._next_id += 1
        return seq

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_ids)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: Seq[Sequence]) -> StepStats:
        """Schedule every sequence in ``seqs`` once; appends one greedy token to each."""
        mi = build_model_input(seqs, self.config.block_size, self.config.device)
        order = [s for s in seqs if s.num_computed == 0] + [s for s in seqs if s.num_computed > 0]
        stats = StepStats(prefill_tokens=mi.attn_metadata.num_prefill_tokens)
        hidden, bypass = None, False
        use_agent = self.agent is not None and mi.attn_metadata.num_prefills > 0
        if use_agent:
            hidden, bypass, mi = self.agent.recv_kv_caches_and_hidden_states(self.model, mi, self.kv_caches)
        if not bypass:
            hidden = self.model(mi.input_tokens, mi.input_positions, self.kv_caches, mi.attn_metadata)
        if use_agent:
            self.agent.send_kv_caches_and_hidden_states(self.model, mi, self.kv_caches, hidden)
        stats.bypassed = bypass
        stats.computed_tokens = 0 if bypass else int(mi.attn_metadata.num_prefill_tokens)
        last = mi.attn_metadata.query_start_loc[1:] - 1
        assert hidden is not None  # computed by the model, or rebuilt by the agent when it bypassed it
        logits = self.model.compute_logits(hidden[last])
        nxt = logits.argmax(-1).tolist()
        md = mi.attn_metadata
        qsl = md.query_start_loc.tolist()
        for i, s in enumerate(order):
            if s.num_computed == 0:
                s.first_logits = logits[i].clone()
                computed = 0 if bypass else qsl[i + 1] - qsl[i]
                s.tokens_computed += computed
                s.tokens_loaded += len(s.prompt) - computed
            s.num_computed = len(s.tokens)
            s.output.append(int(nxt[i]))
        return stats

    def generate(self, prompts: Seq[Seq[int]], max_new_tokens: int = 8) -> GenerationResult:
        """Prefill ``prompts`` as one batch, then decode greedily; frees the blocks after."""
        seqs = [self.add_request(p, max_new_tokens) for p in prompts]
        try:
            t0 = time.perf_counter()
            stats = self.step(seqs)
            ttft = time.perf_counter() - t0
            while not all(s.done for s in seqs):
                self.step([s for s in seqs if not s.done])
            first_logits = []
            for s in seqs:
                assert s.first_logits is not None  # set when the first step prefilled it
                first_logits.append(s.first_logits)
            return GenerationResult(
                tokens=[s.output for s in seqs], first_logits=first_logits, ttft_s=ttft,
                tokens_loaded=sum(s.tokens_loaded for s in seqs),
                tokens_computed=sum(s.tokens_computed for s in seqs), bypassed=stats.bypassed)
        finally:
            for s in seqs:
                self.free(s)
