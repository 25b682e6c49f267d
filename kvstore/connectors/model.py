"""A model's fingerprint, defined once for every engine adapter (the vLLM connector's namespace
and the V0 agent's default ``model_fingerprint``): the same weights, config and dtype give the
same fingerprint whichever adapter computes it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["model_fingerprint"]

#: Config keys that name where or by what a config was written, not what it computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "architectures_auto_map", "torch_dtype", "dtype"}


def model_fingerprint(hf_config: dict[str, Any], *, dtype: str, revision: str | None,
                      quantization: str | None, extra: str = "") -> str:
    """A short hash of what fixes the model's KV for given tokens: its HF config (private and
    volatile keys such as paths and the transformers version left out), dtype, revision,
    quantization and ``extra`` (e.g. a weights hash)."""
    cfg = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps({"config": cfg, "dtype": dtype, "revision": revision or "",
                       "quantization": quantization or "", "extra": extra},
                      sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
