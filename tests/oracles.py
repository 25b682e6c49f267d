"""What "identical output" means in the real-vLLM tests, on any host.

vLLM CPU's arithmetic depends on the batch and on the host. The shape of a step (how many tokens
each request computes, whether its prefix comes from the cache, which requests share the step)
changes which kernel paths run and in what order they add, and the kernels themselves are chosen
by the CPU (AMX tiles on Intel Sapphire Rapids and newer, AVX-512 or AVX2 elsewhere). In bfloat16
that moves logits by about a hundredth, and a greedy near tie between two tokens then flips. So a
token oracle that compares runs of different shapes passes on one CPU and fails on another. Two
rules hold on every host by construction:

1. **Same arithmetic: exact tokens.** A reader that loads a stored prefix computes what vLLM
   computes after its own prefix-cache hit of the same length, in the same batch. ``Reference``
   runs vLLM alone (no connector) on each prompt twice, one prompt per ``generate`` call: the
   first run (``cold``) computes everything, as a writer does, and the second (``warm``) hits
   vLLM's own prefix cache for every whole block but the last token, as a reader's load does.
   A writer's records hold the KV that the cold run computed (same kernels, same shapes, same
   bits), so a correct load gives exactly the warm run's tokens, and a miss exactly the cold
   run's, on every host. One prompt per call keeps the schedule fixed: with several prompts in a
   call, a lookup answered a step late or a background load that ends a step earlier for one of
   them changes which requests share a step; alone, a request that waits a step is computed
   exactly as it would have been.
2. **Different arithmetic: float32, and ties allowed.** Where the schedule cannot be matched
   (preemption and resume, chunked prefill beside background loads, concurrent requests to
   servers), the checkpoint is float32, whose rounding moves logits by about 1e-6, and
   ``assert_continuation`` compares the tokens up to the first place where the reference's best
   two tokens are within ``TIE`` of each other (a place where any rounding may choose either);
   before it, the chosen tokens' logprobs agree within ``LOGPROB_TOL``. A wrong or missing load
   moves logprobs by far more than that at the first token.

Either way, separate checks prove that the loaded KV is used: validly encoded noise in the
records changes the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_engines import run_engine

#: A near tie: the reference's best two logprobs closer than this (nats). float32 rounding moves
#: logprobs by about 1e-6 between batch shapes; bfloat16's by about 1e-2.
TIE = {"float32": 1e-3, "bfloat16": 0.1}
#: Before the first near tie, the chosen tokens' logprobs agree within this (nats).
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 0.1}


def gen(prompts: list, max_tokens: int = 16, **kw) -> dict:
    """A ``generate`` action of ``tests/vllm_worker.py`` (``logprobs=2`` adds the top two)."""
    return {"generate": prompts, "max_tokens": max_tokens, **kw}


@dataclass
class Reference:
    """vLLM alone on each prompt, twice: ``cold`` (nothing cached) and ``warm`` (vLLM's own prefix
    hit), tokens, cached counts and top-two logprobs per prompt."""

    cold: list[list[int]]
    warm: list[list[int]]
    warm_cached: list[int]
    cold_logprobs: list[list] = field(default_factory=list)
    warm_logprobs: list[list] = field(default_factory=list)
    #: ``(prompt index, hit)`` -> tokens after a local hit of ``hit`` tokens (``partial_hits``).
    partial: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @classmethod
    def run(cls, model: str, prompts: list, *, max_tokens: int = 16, engine: dict | None = None,
            partial_hits: tuple[tuple[int, int], ...] = (), env: dict | None = None, multiprocess: bool = False,
            timeout: float = 240) -> Reference:
        """One engine: each prompt cold then warm; then, for each ``(i, hit)`` of ``partial_hits``,
        with vLLM's prefix cache emptied, a primer of ``hit + 1`` tokens of prompt ``i`` (it caches
        ``hit`` tokens, a multiple of the block size) and prompt ``i``, which hits exactly those: what a
        reader computes when the load of prompt ``i`` failed after ``hit`` tokens."""
        actions = []
        for p in prompts:
            actions += [gen([p], max_tokens, logprobs=2), gen([p], max_tokens, logprobs=2)]
        for i, hit in partial_hits:
            actions += [{"reset_prefix_cache": True}, gen([prompts[i][:hit + 1]], 1), gen([prompts[i]], max_tokens)]
        out = run_engine({"model": model, "connector": None, "engine": {**(engine or {}), "enable_prefix_caching": True},
                          "actions": actions}, env=env, multiprocess=multiprocess, timeout=timeout)
        results = [r for r in out["results"] if r]  # reset_prefix_cache gives no result
        pairs = results[:2 * len(prompts)]
        cold, warm = pairs[0::2], pairs[1::2]
        partial = {}
        for (i, hit), (_, after) in zip(partial_hits, zip(*[iter(results[2 * len(prompts):])] * 2)):
            assert after["cached"][0] == hit, (i, hit, after["cached"])
            partial[(i, hit)] = after["tokens"][0]
        return cls(cold=[r["tokens"][0] for r in cold], warm=[r["tokens"][0] for r in warm],
                   warm_cached=[r["cached"][0] for r in warm], cold_logprobs=[r["logprobs"][0] for r in cold],
                   warm_logprobs=[r["logprobs"][0] for r in warm], partial=partial)


def first_tie(logprobs: list, tie: float) -> int:
    """The first generated position whose best two candidates are within ``tie`` nats (or the
    length: none)."""
    for i, top in enumerate(logprobs):
        if len(top) > 1 and top[0][1] - top[1][1] < tie:
            return i
    return len(logprobs)


def assert_continuation(got: list[int], ref: list[int], ref_logprobs: list, *, dtype: str = "float32",
                        got_logprobs: list | None = None, what: str = "") -> None:
    """``got`` is ``ref``'s greedy continuation under other rounding: equal up to the reference's
    first near tie (``TIE[dtype]``), where either token may be chosen and the rest is not compared;
    before it, ``got_logprobs`` (when given) within ``LOGPROB_TOL[dtype]`` of the reference's."""
    assert len(got) == len(ref), (what, got, ref)
    upto = first_tie(ref_logprobs, TIE[dtype])
    assert got[:upto] == ref[:upto], (f"{what}: tokens differ before the reference's first near tie "
                                      f"(position {upto})", got, ref)
    if upto < len(ref) and got[upto] != ref[upto]:
        top = [t for t, _ in ref_logprobs[upto][:2]]
        assert got[upto] in top, (f"{what}: at the near tie (position {upto}) neither of the reference's "
                                  f"best two {top}", got, ref)
    if got_logprobs is not None:
        for i in range(min(upto, len(got_logprobs))):
            mine = dict((int(t), lp) for t, lp in got_logprobs[i])[got[i]]
            theirs = dict((int(t), lp) for t, lp in ref_logprobs[i])[ref[i]]
            assert abs(mine - theirs) <= LOGPROB_TOL[dtype], (what, i, mine, theirs)
