"""The Triton candidate for the device path's per-layer copies (``kvstore.paged.triton_copy``)
against the torch path it would replace, bit for bit: scatter and gather, the flash layout and
vLLM's permuted per-layer view. Skipped where Triton is not installed (CPU installs: vLLM CPU's
set-up removes it); on the CPU it runs in Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported), on a GPU for real (``scripts/gpu_check``)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (it is optional: the torch path is the default)", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA, and TRITON_INTERPRET=1 was not set before Triton loaded", allow_module_level=True)

from kvstore.paged import (
    BHNCLayout,
    FlashLayout,
    slots_from_block_table,
    triton_copy,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, N, H, D, L = 24, 16, 2, 32, 3  # blocks, block size, KV heads, head size, layers


def _caches(layout: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if layout == "flash":
        return [torch.randn(2, B, N, H, D, generator=g, device=DEVICE).bfloat16() for _ in range(L)]
    return [torch.randn(B, N, H, 2 * D, generator=g, device=DEVICE).bfloat16().permute(0, 2, 1, 3) for _ in range(L)]


@pytest.mark.parametrize("layout_name", ["flash", "bhnc"])
def test_one_launch_copies_every_layer_as_the_torch_path_does(layout_name):
    layout = FlashLayout() if layout_name == "flash" else BHNCLayout()
    k, n = 3, 2 * N
    blocks = torch.randperm(B, generator=torch.Generator().manual_seed(1))[:k * n // N].tolist()
    slots = slots_from_block_table(blocks, N, k * n, device=DEVICE)
    assert triton_copy.available(torch.device(DEVICE)) and triton_copy.supports(_caches(layout_name, 0), layout)
    records = torch.randn(k, L, *layout.chunk_shape(_caches(layout_name, 0)[0], n), device=DEVICE).bfloat16()

    by_torch, by_kernel = _caches(layout_name, 2), _caches(layout_name, 2)
    for layer, cache in enumerate(by_torch):
        layout.scatter_chunks(cache, slots, records[:, layer])
    triton_copy.LayerScatter(by_kernel, layout)(slots, records)
    assert all(torch.equal(a, b) for a, b in zip(by_torch, by_kernel))

    want, got = torch.empty_like(records), torch.full_like(records, 7)
    for layer, cache in enumerate(by_torch):
        layout.gather_chunks(cache, slots, want[:, layer])
    triton_copy.LayerGather(by_kernel, layout)(slots, got)
    assert torch.equal(want, got) and torch.equal(got, records)


def test_caches_it_cannot_take_are_refused_not_miscopied():
    layout = FlashLayout()
    caches = _caches("flash", 3)
    odd = [caches[0], caches[1][:, :B // 2]]  # another geometry in one layer
    assert not triton_copy.supports(odd, layout)
    with pytest.raises(ValueError, match="use the torch path"):
        triton_copy.LayerScatter(odd, layout)


@pytest.mark.parametrize("staging", [None, 2])
def test_a_transfer_with_the_kernel_saves_and_loads_as_the_torch_path(staging):
    """``KVTransfer(kernel="triton")``: every window's gather and scatter in one launch, windows in
    the staging's halves; the loaded KV equals the saved KV, a local hit's chunk is untouched."""
    from kvstore.keys import Namespace
    from kvstore.paged import KVTransfer
    from kvstore.prefix_cache import PrefixCache
    from kvstore.stores import open_store

    layout = FlashLayout()
    ns = Namespace(model="triton", model_fingerprint="f", kv_dtype="bfloat16", layout=layout.name, block_size=N,
                   chunk_tokens=2 * N, layer_end=L)
    tokens = list(range(100, 100 + 6 * 2 * N))
    record = 2 * N * L * 2 * H * D * 2
    kw = {} if staging is None else {"staging_bytes": staging * record}
    with open_store("memory://?max_bytes=64MiB") as store:
        src, dst = _caches("flash", 4), [torch.zeros_like(c) for c in _caches("flash", 4)]
        saver = KVTransfer(PrefixCache(store, ns), src, layout, device_path=True, kernel="triton", **kw)
        assert saver.copies._layer_copies is not None
        slots = slots_from_block_table(list(range(12)), N, len(tokens), device=DEVICE)
        assert saver.save_sequence(tokens, slots) == 6
        loader = KVTransfer(PrefixCache(store, ns), dst, layout, device_path=True, kernel="triton", **kw)
        dst_slots = slots_from_block_table(list(range(12, 24)), N, len(tokens), device=DEVICE)
        assert loader.load_sequence(tokens, dst_slots, skip_tokens=N)[0] == len(tokens)
        assert all(torch.equal(d[:, 13:24], s[:, 1:12]) for d, s in zip(dst, src))
        assert all(not d[:, 12].any() for d in dst)  # the local hit's block
