"""Every metric kvstore publishes, in one place (names, help texts and label names).

Modules import the metric objects from here instead of declaring their own, so the set of
names a dashboard may query is this file. Label values are small fixed sets (tier names,
operations, reasons), never keys or request ids.
"""

from __future__ import annotations

from kvstore.metrics.registry import REGISTRY

__all__ = [
    "LOOKUPS",
    "SAVE_CHECKS",
    "LOOKUP_HIT_TOKENS",
    "LOOKUP_TOKENS",
    "LOOKUP_FAILURES",
    "HITS",
    "MISSES",
    "TOKENS_LOADED",
    "TOKENS_SAVED",
    "CORRUPT",
    "HEALS",
    "LATENCY",
    "LOAD_DECISIONS",
    "BYTES_READ",
    "BYTES_WRITTEN",
    "DEVICE_COPIES",
    "ERRORS",
    "TIER_STATE",
    "TIER_TRIPS",
    "QUEUE_ITEMS",
    "QUEUE_BYTES",
    "TIER_LATENCY",
    "TIER_BANDWIDTH",
    "EVICTIONS",
    "WRITE_DROPS",
    "SAVE_DROPS",
    "BYPASSED",
    "DECODE_CHUNKS",
    "PREFILL_RATE",
    "PD_VISIBLE",
    "PD_WAIT",
    "PD_LOADED_TOKENS",
    "PD_LOAD_FAILURES",
    "PD_PROMISES",
    "WARM_PROMPTS",
    "INFO",
]

# -- prefix cache: lookups, loads, saves ---------------------------------------------------------
LOOKUPS = REGISTRY.counter("kvstore_lookups_total", "Prefix lookups asked before a load (not saves' pre-checks).")
SAVE_CHECKS = REGISTRY.counter("kvstore_save_checks_total",
                               "Lookups a save made to skip chunks already stored (saves told where to start make none).")
KV_EVENTS = REGISTRY.counter("kvstore_kv_events_total",
                             "KV events published for routers (kvstore.events), by event (BlockStored, "
                             "BlockRemoved, AllBlocksCleared).", ("event",))
KV_EVENT_DROPS = REGISTRY.counter("kvstore_kv_events_dropped_total",
                                  "Announcements the KV-event publisher dropped: its queue was full (a router then "
                                  "misses those blocks until it resyncs).")
ROUTER_LOOKUPS = REGISTRY.counter("kvstore_router_lookups_total",
                                  "Router lookups answered (POST /v1/lookup), by HTTP status; not engine lookups.",
                                  ("status",))
LOOKUP_HIT_TOKENS = REGISTRY.counter("kvstore_lookup_hit_tokens_total", "Tokens found stored by lookups.")
LOOKUP_TOKENS = REGISTRY.counter("kvstore_lookup_tokens_total", "Tokens asked for by lookups.")
LOOKUP_FAILURES = REGISTRY.counter("kvstore_lookup_failures_total",
                                   "Lookups answered as misses without an answer from the store, by reason.",
                                   ("reason",))
LOOKUP_MISSES = REGISTRY.counter(
    "kvstore_lookup_misses_total", "vLLM lookups that found no stored chunk, by reason: the prompt's first chunk "
    "stored under another KV dtype, chunk_tokens, CPU ISA or record format (kv_dtype, chunk_tokens, cpu_isa, format), "
    "under none of them (absent), or not asked (unprobed).", ("reason",))
HITS = REGISTRY.counter("kvstore_hits_total", "Chunks loaded and verified.")
MISSES = REGISTRY.counter("kvstore_misses_total", "Chunks looked up but not loaded.")
TOKENS_LOADED = REGISTRY.counter("kvstore_tokens_loaded_total", "Tokens whose KV was loaded into an engine.")
TOKENS_SAVED = REGISTRY.counter("kvstore_tokens_saved_total", "Tokens whose KV was written to the store.")
CORRUPT = REGISTRY.counter("kvstore_corrupt_records_total", "Records rejected by validation, by reason.", ("reason",))
HEALS = REGISTRY.counter("kvstore_heals_total",
                         "Chunks rewritten because a load had rejected the record of that chunk or of an earlier "
                         "one of the same prefix (the rejected chunk and every later chunk of the save).")
LATENCY = REGISTRY.histogram("kvstore_op_seconds", "Latency of cache operations.", ("op",))

# -- tiers: bytes, errors, the circuit breaker, the write queues ----------------------------------
BYTES_READ = REGISTRY.counter("kvstore_bytes_read_total", "Record bytes read, by tier.", ("tier",))
BYTES_WRITTEN = REGISTRY.counter("kvstore_bytes_written_total", "Record bytes written, by tier.", ("tier",))
DEVICE_COPIES = REGISTRY.counter("kvstore_device_copies_total",
                                 "Records copied between host memory and an accelerator (kvstore.paged.device), by "
                                 "op (load, save) and the host memory's kind: pinned (one DMA), pageable (staged by "
                                 "the driver: unregistered memory), decoded (decompressed on the host first).",
                                 ("op", "memory"))
ERRORS = REGISTRY.counter("kvstore_errors_total", "Store errors by tier and kind.", ("tier", "kind"))
TIER_STATE = REGISTRY.gauge("kvstore_tier_state", "Circuit breaker state of a tier: 0 closed, 1 half-open, 2 open.",
                            ("tier",))
TIER_TRIPS = REGISTRY.counter("kvstore_tier_trips_total", "Times a tier's circuit breaker opened.", ("tier",))
QUEUE_ITEMS = REGISTRY.gauge("kvstore_write_queue_items", "Writes waiting for a shared tier.", ("tier",))
QUEUE_BYTES = REGISTRY.gauge("kvstore_write_queue_bytes", "Bytes waiting to be written to a shared tier.", ("tier",))
TIER_LATENCY = REGISTRY.gauge("kvstore_tier_latency_seconds", "Measured round-trip latency of a tier (EWMA).",
                              ("tier",))
TIER_BANDWIDTH = REGISTRY.gauge("kvstore_tier_read_bytes_per_second", "Measured read bandwidth of a tier (EWMA).",
                                ("tier",))
EVICTIONS = REGISTRY.counter("kvstore_evictions_total", "Values a bounded local store evicted to stay under "
                             "max_bytes, by store kind (memory, file).", ("store",))
WRITE_DROPS = REGISTRY.counter("kvstore_write_drops_total",
                               "Background writes dropped: queue_full, tier_unavailable, error or closed.",
                               ("tier", "reason"))

# -- load or recompute (kvstore.cost) ---------------------------------------------------------------
LOAD_DECISIONS = REGISTRY.counter("kvstore_load_decisions_total",
                                  "Load-or-recompute decisions by the tier a hit would load from: load or recompute.",
                                  ("tier", "decision"))
SAVE_DROPS = REGISTRY.counter("kvstore_save_drops_total",
                              "Saves an engine adapter dropped before gathering them (queue_full; shutdown: still "
                              "queued when flush_timeout ran out at exit).", ("reason",))
BYPASSED = REGISTRY.counter("kvstore_bypassed_requests_total",
                            "Requests an engine adapter neither loads nor saves, by reason (recurrent_state: "
                            "the model keeps recurrent state the engine does not keep at block boundaries, e.g. "
                            "vLLM with prefix caching off; mla_backend: MLA on vLLM CPU's reference backend, which cannot "
                            "compute over cached latents; multimodal: inputs the keys cannot name).", ("reason",))
DECODE_CHUNKS = REGISTRY.counter("kvstore_decode_chunks_saved_total",
                                 "Chunks of generated tokens an engine adapter planned to save (save_decode): "
                                 "what the next turn of a chat hits.")
PREFILL_RATE = REGISTRY.gauge("kvstore_prefill_tokens_per_second",
                              "The engine's measured prefill speed (EWMA), what a load is compared with.")

# -- disaggregated prefill (kvstore.connectors.vllm.disagg) ----------------------------------------
PD_PROMISES = REGISTRY.counter("kvstore_pd_promises_total",
                               "Prefill engine: P/D requests (do_remote_decode) answered with a promise of records in "
                               "the shared tier (promised), or without one (none: nothing stored, no shared tier, "
                               "the request did not finish).", ("result",))
PD_VISIBLE = REGISTRY.histogram("kvstore_pd_prefill_to_visible_seconds",
                                "Prefill engine: from the end of the forward that computed a P/D prompt's last saved "
                                "chunk to its records being in every shared tier (what a decode engine waits for).",
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
PD_WAIT = REGISTRY.histogram("kvstore_pd_wait_seconds",
                             "Decode engine: how long a P/D request (do_remote_prefill) waited for the promised records "
                             "to be visible before its load (or until its deadline).",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
PD_LOADED_TOKENS = REGISTRY.histogram("kvstore_pd_loaded_tokens",
                                      "Decode engine: prompt tokens a P/D request loaded from the store (0: none; recomputed, "
                                      "unless vLLM's own prefix cache held them).",
                                      buckets=(0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072))
PD_LOAD_FAILURES = REGISTRY.counter("kvstore_pd_load_failures_total",
                                    "Decode engine: P/D requests that did not load all their promised tokens, by "
                                    "reason (timeout: not visible by the deadline; load_error: a record missing, "
                                    "corrupt or forged at load time; params: malformed params; mismatch: promised "
                                    "by another deployment or for another prompt). vLLM recomputes what was not loaded.",
                                    ("reason",))

# -- operations: warming, the build ----------------------------------------------------------------
WARM_PROMPTS = REGISTRY.counter("kvstore_warm_prompts_total",
                                "Prompts processed by kvstore warm, by result (warmed, skipped, failed, invalid).",
                                ("result",))
INFO = REGISTRY.gauge("kvstore_info", "Always 1; labels carry the kvstore version and record format.",
                      ("version", "format_version"))
