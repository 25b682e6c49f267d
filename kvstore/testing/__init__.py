"""Test kit shipped with the package, so that third-party backends and engines can reuse it.

* ``store_tests``: the store conformance suite (subclass ``StoreTests`` once per backend).
* ``damage``: damage stored records on purpose (detection and healing tests).
* ``proxy``: ``ShapedProxy``, a TCP proxy that adds delay and caps bandwidth (slow-network tests).
* ``pinner``: ``CountingPinner``, a host-memory pinner that counts instead of registering (the
  device path's tests on the CPU).

This is the top layer: tests and benchmarks import it, no product module does (the reference
engine is ``kvstore.reference``, the raw RESP client ``kvstore.stores.redis.raw``).
"""
