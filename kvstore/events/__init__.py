"""KV events for routers: what kvstore's store holds, in vLLM's own wire format.

``KVEventPublisher`` (``publisher``) sends ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` batches over ZMQ PUB with vLLM's replay socket; ``wire`` encodes them (both
the map form of vLLM 0.26 and later and the positional form of earlier versions);
``redis_watch`` turns Redis's evicted and expired keys into removals. Optional: needs ``pyzmq``
(and ``redis`` for the watcher), imported only when a publisher or watcher starts.
docs/routing.md describes the events, topics and mediums and how llm-d and Dynamo consume them.
"""

from kvstore.events.publisher import END_SEQ, MEDIUMS, EventsConfig, EventSink, KVEventPublisher, medium_of, mediums
from kvstore.events.wire import ENCODINGS, HASH_FORMATS, encode_batch

__all__ = ["END_SEQ", "ENCODINGS", "HASH_FORMATS", "MEDIUMS", "EventSink", "EventsConfig", "KVEventPublisher",
           "encode_batch", "medium_of", "mediums"]
