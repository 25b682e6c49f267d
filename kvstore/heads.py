"""Which KV heads a tensor-parallel rank holds, and which records cover the heads a reader needs.

Attention KV is cut by KV head across tensor-parallel ranks, as vLLM's ``QKVParallelLinear`` cuts
it: of a model's ``H`` KV heads, with ``T <= H`` ranks each rank ``r`` holds the ``H/T``
contiguous heads ``[r*H/T, (r+1)*H/T)``; with ``T > H`` each head is replicated on ``T/H``
consecutive ranks (rank ``r`` holds head ``r // (T/H)``). A record holds one chunk's KV of one
such range (``kvstore.keys.HeadRange``): a rank writes its own range, and a head that several
ranks replicate is written once, by the first of them (``rank_heads``).

A reader's rank needs its own range ``[a, b)`` and reads whatever covers it (``cover``): the
record of exactly that range, finer records it joins, or a coarser one it slices (reading the
heads it does not need too: ``amplification``). Which ranges may exist is known without asking
the store: those that writers of the TP sizes a deployment runs write (``candidate_ranges``,
``lookup_tp_sizes``). A chunk is a hit for an engine only if every head ``[0, H)`` is covered,
so every rank is served (``covered_count``).

Pure functions of small integers: no store, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvstore.errors import ConfigError
from kvstore.keys import MAX_HEADS, HeadRange

__all__ = ["rank_heads", "writes_heads", "writer_ranges", "candidate_ranges", "lookup_tp_sizes", "cover",
           "covered_count", "amplification"]


def _check(tp_size: int, total: int) -> None:
    if type(total) is not int or not 1 <= total <= MAX_HEADS:
        raise ConfigError(f"a model of {total!r} KV heads: expected 1 to {MAX_HEADS}")
    if type(tp_size) is not int or tp_size < 1 or (total % tp_size and tp_size % total):
        raise ConfigError(f"tensor_parallel_size={tp_size!r} cannot split {total} KV heads: one must divide "
                          f"the other")


def rank_heads(tp_rank: int, tp_size: int, total: int) -> HeadRange:
    """The KV heads TP rank ``tp_rank`` of ``tp_size`` holds, of ``total``."""
    _check(tp_size, total)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank={tp_rank!r} must be in [0, tp_size={tp_size})")
    if tp_size <= total:
        per = total // tp_size
        return HeadRange(tp_rank * per, (tp_rank + 1) * per, total)
    head = tp_rank // (tp_size // total)
    return HeadRange(head, head + 1, total)


def writes_heads(tp_rank: int, tp_size: int, total: int) -> bool:
    """Whether TP rank ``tp_rank`` writes its heads' records: every rank does, but of the ranks that
    replicate a head (``tp_size > total``) only the first."""
    _check(tp_size, total)
    return tp_size <= total or tp_rank % (tp_size // total) == 0


def writer_ranges(tp_size: int, total: int) -> list[HeadRange]:
    """The head ranges writers of ``tp_size`` ranks write, in head order (each once)."""
    _check(tp_size, total)
    return [rank_heads(r, tp_size, total) for r in range(tp_size) if writes_heads(r, tp_size, total)]


def lookup_tp_sizes(own: int, largest: int) -> tuple[int, ...]:
    """The TP sizes whose records an engine of ``own`` ranks looks for: its own and every power of
    two up to ``largest``, ascending."""
    sizes = {own}
    size = 1
    while size <= largest:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def candidate_ranges(total: int, tp_sizes: Iterable[int]) -> list[HeadRange]:
    """Every head range a writer of one of ``tp_sizes`` writes (sizes that cannot split ``total``
    heads, which vLLM refuses, are left out), coarsest first, each once."""
    out: set[HeadRange] = set()
    for size in tp_sizes:
        if type(size) is int and size >= 1 and not (total % size and size % total):
            out.update(writer_ranges(size, total))
    return sorted(out, key=lambda r: (-r.count, r.start))


def cover(need: HeadRange, available: Iterable[HeadRange]) -> list[HeadRange] | None:
    """The records to read for the heads ``need``, out of the ranges ``available`` (None: they do
    not cover it). The exact range if there; else finer ranges inside ``need`` that join to it (no
    byte read in vain; the fewest such records); else the smallest single range that holds all of
    ``need`` (sliced); else any mix, each head from the smallest range that holds it."""
    ranges = sorted({r for r in available if r.total == need.total and r.overlap(need) is not None},
                    key=lambda r: (r.start, -r.end))
    if need in ranges:
        return [need]
    inside = _greedy(need, [r for r in ranges if need.contains(r)], inside_only=True)
    if inside is not None:
        return inside
    holding = [r for r in ranges if r.contains(need)]
    if holding:
        return [min(holding, key=lambda r: (r.count, r.start))]
    return _greedy(need, ranges, inside_only=False)


def _greedy(need: HeadRange, ranges: Sequence[HeadRange], *, inside_only: bool) -> list[HeadRange] | None:
    out: list[HeadRange] = []
    at = need.start
    while at < need.end:
        holding = [r for r in ranges if r.start <= at < r.end]
        if not holding:
            return None
        inside = [r for r in holding if need.contains(r)]
        if inside:
            best = max(inside, key=lambda r: r.end)  # the longest step: the fewest records
        elif inside_only:
            return None
        else:
            best = min(holding, key=lambda r: (r.count, -r.end))  # the least read in vain
        out.append(best)
        at = best.end
    return out


def covered_count(counts: Mapping[HeadRange, int], total: int) -> int:
    """Leading chunks for which every head of ``total`` is covered, given how many leading chunks
    each range's records hold (``counts``): the least, over heads, of the most any range holding
    that head has."""
    best = [0] * total
    for heads, n in counts.items():
        if heads.total != total:
            continue
        for h in range(heads.start, heads.end):
            best[h] = max(best[h], n)
    return min(best, default=0)


def amplification(need: HeadRange, ranges: Sequence[HeadRange]) -> float:
    """Bytes read over bytes needed when ``ranges`` are read for ``need``: 1.0 for the exact
    range or finer ones joined, ``count / need.count`` for a coarser one sliced."""
    return sum(r.count for r in ranges) / need.count
