"""Test helpers shipped with the package, so that third-party backends and engines can reuse them.

* ``store_tests``: the store conformance suite (subclass ``StoreTests`` once per backend).
* ``damage``: damage stored records on purpose (detection and healing tests).
* ``engine``: a small reference LLM engine with a paged KV cache (tests, the demo, benchmarks);
  scaffolding, not something to serve with.
"""
