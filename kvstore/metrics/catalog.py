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
                            "vLLM with prefix caching off; multimodal: inputs the keys cannot name).", ("reason",))
DECODE_CHUNKS = REGISTRY.counter("kvstore_decode_chunks_saved_total",
                                 "Chunks of generated tokens an engine adapter planned to save (save_decode): "
                                 "what the next turn of a chat hits.")
PREFILL_RATE = REGISTRY.gauge("kvstore_prefill_tokens_per_second",
                              "The engine's measured prefill speed (EWMA), what a load is compared with.")

# -- operations: warming, the build ----------------------------------------------------------------
WARM_PROMPTS = REGISTRY.counter("kvstore_warm_prompts_total",
                                "Prompts processed by kvstore warm, by result (warmed, skipped, failed, invalid).",
                                ("result",))
INFO = REGISTRY.gauge("kvstore_info", "Always 1; labels carry the kvstore version and record format.",
                      ("version", "format_version"))
