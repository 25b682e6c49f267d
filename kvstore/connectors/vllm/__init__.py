"""vLLM's V1 connector API over kvstore.

``connector`` (``KVStoreConnector``, the facade vLLM loads) imports vLLM; the rest does only
where noted: ``options`` (the connector's options, no vLLM), ``facts`` (what the namespace needs
from vLLM's config), ``plan`` (pure token/block arithmetic), ``metadata`` (scheduler -> worker
messages), ``scheduler`` and ``worker`` (the two sides). Importing this package imports none of
them.
"""
