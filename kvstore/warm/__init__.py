"""Offline cache warming: run prompts through an engine so their KV lands in the store.

``warm(prompts, engine)`` streams prompts (never holding the whole file), asks the engine to
prefill each one (the engine's kvstore connector saves the KV as it would in serving), and
returns a ``WarmSummary``. Its promises:

* **Resumable.** Before running a prompt it asks the store whether every chunk the engine would
  save is already there, with the engine's own namespace and keys (one ``longest_prefix`` call);
  a fully stored prompt is skipped. Engines that cannot name their keys (a remote server whose
  namespace is unknown here) run every prompt; the server's connector then loads instead of
  recomputing, so a rerun is still cheap.
* **Bounded memory.** The prompt file is read line by line and at most ``2 x concurrency``
  prompts are in flight.
* **Nothing silent.** A line that is not a prompt is reported with its line number and counted
  (``invalid``); a prompt the engine fails on is reported and counted (``failed``). Neither stops
  the run, unless ``max_consecutive_failures`` prompts fail in a row (the engine is down).

Engines: ``ReferenceWarmEngine`` (the in-package reference engine through the agent connector),
``ServerWarmEngine`` (a running vLLM OpenAI-compatible server with the kvstore connector), and
``VLLMWarmEngine`` (vLLM in-process with the kvstore connector). ``kvstore.cli.warm`` builds
them from command-line options.

Modules: ``prompts`` (the input file), ``engine`` (the engine contract), ``run`` (``warm``),
one module per engine (``reference``, ``server``, ``vllm``; import them explicitly: they pull in
torch or vLLM).
"""

from kvstore.warm.engine import CountingStore, EngineUnavailableError, WarmEngine
from kvstore.warm.prompts import BadLine, Prompt, Tokenizer, iter_prompts, parse_line
from kvstore.warm.run import WarmSummary, warm
from kvstore.warm.server import ServerWarmEngine

__all__ = ["BadLine", "CountingStore", "EngineUnavailableError", "Prompt", "ServerWarmEngine", "Tokenizer",
           "WarmEngine", "WarmSummary", "iter_prompts", "parse_line", "warm"]
