"""The connector's arithmetic over token counts and block ids: pure functions, unit-tested
without an engine."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["lookup_limit", "external_tokens", "save_ends", "failed_blocks", "blocks_for", "window_start",
           "window_chunks", "window_ends", "servable_ends", "state_ends", "state_block"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (the last one possibly partly filled)."""
    return -(-num_tokens // block_size)


def lookup_limit(num_tokens: int, block_size: int) -> int:
    """Tokens a hit may cover: whole blocks, leaving at least one token for vLLM to compute."""
    return max(0, (num_tokens - 1) // block_size * block_size)


def external_tokens(hit_tokens: int, num_computed_tokens: int, min_load_tokens: int = 0) -> int:
    """Tokens to load beyond vLLM's local hit, or 0 when the store adds nothing worth loading."""
    extra = hit_tokens - num_computed_tokens
    return extra if extra > 0 and extra >= min_load_tokens else 0


def save_ends(num_prompt_tokens: int, computed_after_step: int, saved_upto: int, *,
              chunk_tokens: int, block_size: int, save_partial: bool, num_tokens: int | None = None) -> list[int]:
    """Prefix lengths to save after a step that leaves ``computed_after_step`` tokens computed.

    Whole chunks of the prompt as they complete; and, once the prompt's last whole block that
    a lookup may cover (``lookup_limit``) is computed, that prefix too (its final chunk is
    partial), so the same prompt hits up to there. With ``num_tokens`` (prompt and generated
    tokens known), whole chunks of generated tokens too, as their KV is computed: the next turn
    of a chat, whose prompt holds this one's answer, hits them. Only ends beyond ``saved_upto``.
    """
    computed = min(computed_after_step, num_prompt_tokens if num_tokens is None else num_tokens)
    ends = []
    full = computed // chunk_tokens * chunk_tokens
    if full > saved_upto:
        ends.append(full)
    limit = lookup_limit(num_prompt_tokens, block_size)
    if save_partial and limit % chunk_tokens and computed >= limit and limit > saved_upto:
        ends.append(limit)
    return sorted(ends)


def failed_blocks(block_ids: Sequence[int], block_size: int, present: int, end: int) -> list[int]:
    """Blocks vLLM counts as loaded (up to ``end``) that hold no verified KV (from ``present``)."""
    return list(block_ids[present // block_size:blocks_for(end, block_size)])


# -- sliding-window and chunked-local-attention groups ------------------------------------------------
# A sliding-window layer attends to the last ``window`` tokens only, and a chunked-local-attention
# layer (Llama 4) to the tokens of its own attention chunk of ``window`` tokens; vLLM frees the
# blocks before that (its block table holds the null block there). A hit ending at ``end``
# therefore needs such a group's KV only from ``window_start(end)``: the records of the chunks
# overlapping that tail. Writers store those tails at a few ends only (``window_ends``), so what
# such a group stores per prompt is bounded by its window, not by the prompt.


def window_start(end: int, window: int, block_size: int, *, local: bool = False) -> int:
    """First token (block-aligned) a sliding-window group needs for a hit ending at ``end``: the
    start of the block holding the oldest token the next one attends to (vLLM keeps that block).
    ``local``: a chunked-local-attention group, whose next token attends from the start of its
    attention chunk (``end`` itself when a new attention chunk begins there: nothing needed)."""
    if local:
        return end // window * window // block_size * block_size
    return max(0, end - window + 1) // block_size * block_size


def window_chunks(end: int, window: int, block_size: int, chunk_tokens: int, *, local: bool = False) -> range:
    """Indexes of the chunks a sliding-window (or ``local``) group needs for a hit ending at
    ``end`` (a chunk end)."""
    last = -(-end // chunk_tokens)
    return range(window_start(end, window, block_size, local=local) // chunk_tokens, last)


def window_ends(ends: Sequence[int], num_prompt_tokens: int, block_size: int, chunk_tokens: int,
                interval: int) -> list[int]:
    """Which of a save's ``ends`` (chunk ends) also store sliding-window tails: the prompt's last
    hittable end (``lookup_limit``: the same prompt, and the next turn of a chat, hit there) and
    the first chunk end at or after each multiple of ``interval`` tokens (0: none), where prompts
    sharing a long prefix meet."""
    limit = lookup_limit(num_prompt_tokens, block_size)
    return [e for e in ends if e == limit or (interval and e // interval > (e - chunk_tokens) // interval)]


def servable_ends(ends: Sequence[int], present: Sequence[bool], window: int, block_size: int,
                  chunk_tokens: int, *, local: bool = False) -> set[int]:
    """The chunk ends (``ends[i]``: end of chunk i) at which a sliding-window (or ``local``) group
    can serve a hit, given which of its chunk records are ``present``."""
    out = set()
    for end in ends:
        need = window_chunks(end, window, block_size, chunk_tokens, local=local)
        if need.stop <= len(present) and all(present[i] for i in need):
            out.add(end)
    return out


# -- recurrent-state groups ---------------------------------------------------------------------------
# A recurrent layer's state after token t depends on every token before it, so a hit ending at
# ``end`` needs the state after exactly ``end`` tokens. vLLM's ``mamba_cache_mode="align"`` keeps
# it in block ``end // block_size - 1`` of the request's state table (``state_block``), but only
# where a step ended (vLLM ends prefill steps at block boundaries there) or, for Mamba2's prefill
# checkpoints, at the prompt's last whole block inside the step that passes it. The state is
# gathered in that step (``state_ends``), at the same few ends as the sliding windows' tails
# (``window_ends``), so what a state group stores per prompt is bounded, never one state per block.


def state_block(block_ids: Sequence[int], end: int, block_size: int) -> int:
    """The block of a request's state table that holds the state after ``end`` tokens."""
    return int(block_ids[end // block_size - 1])


def state_ends(ends: Sequence[int], num_prompt_tokens: int, computed_before: int, computed_after: int, *,
               block_size: int, chunk_tokens: int, interval: int, checkpoints: bool) -> list[int]:
    """Which of a step's save ``ends`` also store the recurrent state: those of ``window_ends``
    (the prompt's last hittable end, the first chunk end at or after each multiple of
    ``interval``) whose state the step leaves in the state table: the step's own end
    (``computed_after``), or, with ``checkpoints``, the prompt's last hittable end inside the step."""
    limit = lookup_limit(num_prompt_tokens, block_size)
    return [e for e in window_ends(ends, num_prompt_tokens, block_size, chunk_tokens, interval)
            if e == computed_after or (checkpoints and e == limit and computed_before < e < computed_after)]
