"""vLLM V0 batches as the agent sees them: the prefill sequences of a flattened batch, and the
batch rebuilt to compute only what was not loaded.

Inputs are duck-typed like V0's GPU model runner: ``model_input.input_tokens`` and
``input_positions`` (flattened, prefills first), ``model_input.attn_metadata`` with
``num_prefills``, ``num_prefill_tokens``, ``num_decode_tokens``, ``seq_lens``, ``slot_mapping``
and, when present, ``query_start_loc`` and ``context_lens_tensor``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrefillSeq", "prefill_sequences", "rebuild_model_input"]


@dataclass
class PrefillSeq:
    """One prefill sequence of a batch, as the agent sees it."""

    index: int            # position among the batch's sequences
    q_start: int          # its scheduled tokens in the flattened batch: [q_start, q_end)
    q_end: int
    context: int          # tokens already in the cache before this step
    tokens: Any = None    # the whole prompt (context 0 only), torch int64
    slots: Any = None     # one slot per prompt token


def prefill_sequences(model_input: Any) -> list[PrefillSeq]:
    """The prefill sequences of a V0 batch, in batch order (tokens and slots for context-0 ones)."""
    md = model_input.attn_metadata
    n = int(md.num_prefills)
    seq_lens = [int(x) for x in md.seq_lens]
    qsl = getattr(md, "query_start_loc", None)
    if qsl is not None:
        qsl = [int(x) for x in qsl.tolist()]
    else:  # V0 without prefix caching: a prefill schedules its whole sequence
        qsl = [0]
        for L in seq_lens[:n]:
            qsl.append(qsl[-1] + L)
    ctx = getattr(md, "context_lens_tensor", None)
    ctx = [int(x) for x in ctx.tolist()] if ctx is not None else [0] * n
    slot_mapping = md.slot_mapping.flatten()
    out = []
    for i in range(n):
        s = PrefillSeq(i, qsl[i], qsl[i + 1], ctx[i])
        if s.context == 0:
            s.tokens = model_input.input_tokens[s.q_start:s.q_end].to("cpu", torch.int64)
            s.slots = slot_mapping[s.q_start:s.q_end].to(torch.int64)
        out.append(s)
    return out


def _replace(obj: Any, **changes: Any) -> Any:
    """``obj`` with ``changes`` applied to the fields it has (a copy; dataclasses via ``replace``)."""
    changes = {k: v for k, v in changes.items() if hasattr(obj, k)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = {f.name for f in dataclasses.fields(obj) if f.init}
        new = dataclasses.replace(obj, **{k: v for k, v in changes.items() if k in names})
        for k, v in changes.items():
            if k not in names:
                object.__setattr__(new, k, v)
        return new
    new = copy.copy(obj)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def rebuild_model_input(model_input: Any, seqs: Sequence[PrefillSeq], skip: Sequence[int]) -> Any:
    """``model_input`` with the first ``skip[i]`` scheduled tokens of prefill sequence ``i``
    removed (they are in the cache now): tokens, positions, slot mapping, ``query_start_loc``,
    context lengths, token counts and query lengths follow; decode tokens are unchanged."""
    md = model_input.attn_metadata
    total = int(model_input.input_tokens.shape[0])
    device = model_input.input_tokens.device
    keep = [torch.arange(s.q_start + k, s.q_end, device=device) for s, k in zip(seqs, skip)]
    num_prefill_tokens = int(md.num_prefill_tokens)
    keep.append(torch.arange(num_prefill_tokens, total, device=device))
    idx = torch.cat(keep)
    old_qsl = getattr(md, "query_start_loc", None)
    lens = [s.q_end - s.q_start - k for s, k in zip(seqs, skip)]
    if old_qsl is not None:
        old = old_qsl.tolist()
        lens += [b - a for a, b in zip(old[len(seqs):], old[len(seqs) + 1:])]
    qsl = [0]
    for L in lens:
        qsl.append(qsl[-1] + L)
    changes: dict[str, Any] = {
        "slot_mapping": md.slot_mapping.flatten()[idx.to(md.slot_mapping.device)],
        "num_prefill_tokens": sum(lens[:len(seqs)]),
        "max_query_len": max(lens) if lens else 0,
        "max_prefill_query_len": max(lens[:len(seqs)]) if seqs else 0,
    }
    if old_qsl is not None:
        changes["query_start_loc"] = torch.tensor(qsl, dtype=old_qsl.dtype, device=old_qsl.device)
    ctx = getattr(md, "context_lens_tensor", None)
    if ctx is not None:
        new_ctx = ctx.clone()
        for i, (s, k) in enumerate(zip(seqs, skip)):
            new_ctx[i] = s.context + k
        changes["context_lens_tensor"] = new_ctx
    new_md = _replace(md, **changes)
    mi_changes: dict[str, Any] = {
        "input_tokens": model_input.input_tokens[idx],
        "input_positions": model_input.input_positions[idx],
        "attn_metadata": new_md,
    }
    if getattr(model_input, "query_lens", None) is not None:
        mi_changes["query_lens"] = lens
    return _replace(model_input, **mi_changes)
