"""Does loading beat recomputing on a GPU? Loads of a Llama-3-8B-shaped prefix into a paged KV
cache on the device, from every store a GPU host uses, against the prefill of the same tokens by
a real Llama implementation on the same device, in the same run, at 2,048 and 8,192 tokens.

Prefill: HF transformers' ``LlamaForCausalLM`` built from a Llama-3-8B config (hidden 4,096, 32
layers, 32 query and 8 KV heads of 128, MLP 14,336, vocabulary 128,256, RoPE theta 500,000),
random bf16 weights, ``attn_implementation="sdpa"``, ``logits_to_keep=1``: the forward pass an
engine runs to prefill, the embedding, norms, RoPE and the last token's logits included. Where
transformers is missing, a model-shaped stand-in (the same matmuls and attention, without RoPE
or the vocabulary; about 2.5x slower than the real implementation on an H200) says so in the table.

Load: ``KVTransfer.load_sequence`` (records read where they lie, every one verified, DMA'd and
scattered at random blocks; flash layout, 16-token blocks, 256-token chunks) from ``memory://``,
``shm://``, one redis-server and ``redis+shards://`` of ``--shards`` servers. Each load is also
given as a ratio to ``copy_`` of the same bytes from pinned host memory (its ceiling). The first
table row checks the data path with the model's own KV: the prefill's keys and values, written
into a paged cache, saved to ``shm://`` and loaded into another one, must come back bit-equal.

Every time is a median [min-max] of ``--reps`` after a warm-up, synchronised with the device. The
verdict divides each load's time by the prefill's: below 1, loading wins.

    python benchmarks/bench_breakeven.py [--reps 5] [--json out.json]                       # a GPU host
    python benchmarks/bench_breakeven.py --device cpu --layers 2 --vocab 1024 --tokens 256 --reps 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine
from gpu_common import (
    BLOCK,
    HEAD,
    KV_HEADS,
    Prefix,
    copy_ceilings,
    med,
    redis_servers,
    shards_url,
    shm_store,
    span,
    timed,
)

from kvstore.paged import slots_from_block_table
from kvstore.stores import open_store
from kvstore.stores.base import Store

HIDDEN, Q_HEADS, MLP, VOCAB = 4096, 32, 14336, 128256


def llama(device: torch.device, layers: int, vocab: int) -> tuple[Callable[[torch.Tensor, bool], object], str]:
    """The prefill to beat: HF ``LlamaForCausalLM`` (Llama-3-8B shape, random bf16 weights,
    sdpa), or the stand-in where transformers is missing. Returns ``(forward(ids, use_cache),
    description)``."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return _stand_in(device, layers), "model-shaped stand-in (transformers is not installed)"
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD, vocab_size=vocab,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
        except TypeError:  # transformers 4: torch_dtype
            model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    model.eval()

    @torch.inference_mode()
    def forward(ids: torch.Tensor, use_cache: bool) -> object:
        return model(ids, use_cache=use_cache, logits_to_keep=1)
    version = __import__("transformers").__version__
    return forward, f"HF transformers {version} LlamaForCausalLM, {layers} layers, sdpa, random bf16 weights"


def _stand_in(device: torch.device, layers: int) -> Callable[[torch.Tensor, bool], object]:
    g = torch.Generator(device=device).manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16) * cols ** -0.5
    qkv, o = w((Q_HEADS + 2 * KV_HEADS) * HEAD, HIDDEN), w(HIDDEN, Q_HEADS * HEAD)
    gate_up, down = w(2 * MLP, HIDDEN), w(HIDDEN, MLP)
    norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)

    @torch.inference_mode()
    def forward(ids: torch.Tensor, use_cache: bool) -> object:
        n = ids.shape[1]
        x = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
        for _ in range(layers):  # the same weights each layer: an 8B model's FLOPs and weight traffic
            h = F.rms_norm(x, (HIDDEN,), norm)
            q, k, v = (h @ qkv.T).split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
            q = q.view(n, Q_HEADS, HEAD).transpose(0, 1)
            k = k.view(n, KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0)
            v = v.view(n, KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, Q_HEADS * HEAD)
            x = x + a @ o.T
            gate, up = (F.rms_norm(x, (HIDDEN,), norm) @ gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down.T
        return x
    return forward


def model_kv_round_trip(forward: Callable[[torch.Tensor, bool], object], device: torch.device, tokens: int,
                        layers: int, vocab: int) -> str:
    """The model's own KV of a ``tokens`` prefill, into a paged cache, through ``shm://`` and back
    into another at other blocks: bit-equal, or a SystemExit."""
    out = forward(torch.randint(0, vocab, (1, tokens), device=device), True)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        return "skipped (the stand-in has no KV cache)"
    per_layer = [(lay.keys, lay.values) for lay in cache.layers] if hasattr(cache, "layers") else \
        list(zip(cache.key_cache, cache.value_cache))
    prefix = Prefix(device, tokens, layers, seed=1)
    for c, (k, v) in zip(prefix.src, per_layer):
        flat = c.view(2, -1, KV_HEADS, HEAD)
        flat[0, prefix.src_slots] = k[0].transpose(0, 1)
        flat[1, prefix.src_slots] = v[0].transpose(0, 1)
    with shm_store("kv-check", 2 * prefix.nbytes) as (store, _):
        prefix.transfer(store, prefix.src, model="llama-kv").save_sequence(prefix.token_ids, prefix.src_slots)
        n, _ = prefix.transfer(store, prefix.dst, model="llama-kv").load_sequence(prefix.token_ids, prefix.dst_slots)
    dst_slots = slots_from_block_table(prefix.dst_blocks, BLOCK, tokens, device=device)
    same = n == tokens and all(
        torch.equal(d.view(2, -1, KV_HEADS, HEAD)[0, dst_slots], k[0].transpose(0, 1)) and
        torch.equal(d.view(2, -1, KV_HEADS, HEAD)[1, dst_slots], v[0].transpose(0, 1))
        for d, (k, v) in zip(prefix.dst, per_layer))
    if not same:
        raise SystemExit("the model's KV did not come back bit-equal through shm://")
    return f"bit-equal ({tokens} tokens, {layers} layers, {prefix.nbytes / 1e6:.0f} MB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="2048,8192", help="prefix lengths (multiples of 256)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--shards", type=int, default=4, help="servers of the sharded store (0: none)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the figures as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    lengths = [int(t) for t in args.tokens.split(",")]
    if any(t % 256 for t in lengths):
        raise SystemExit("--tokens must be multiples of 256")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (device path, smoke run)"
    print(f"{machine()}; device: {name}", flush=True)
    forward, model_name = llama(device, args.layers, args.vocab)
    print(f"prefill: {model_name}", flush=True)
    check = model_kv_round_trip(forward, device, lengths[0], args.layers, args.vocab)
    print(f"the model's KV through shm://: {check}", flush=True)
    results: dict[str, object] = {"machine": machine(), "device": name, "model": model_name, "kv_check": check,
                                  "layers": args.layers, "by_tokens": {}}
    lines = []
    with redis_servers(max(1, args.shards)) as started:
        for tokens in lengths:
            ids = torch.randint(0, args.vocab, (1, tokens), device=device)
            pre = timed(lambda ids=ids: forward(ids, False), args.reps, device)
            prefix = Prefix(device, tokens, args.layers)
            ceiling = copy_ceilings(prefix.nbytes, args.reps, device)["h2d_pinned"]
            loads = run_loads(prefix, started, args, device)
            results["by_tokens"][str(tokens)] = {"kv_bytes": prefix.nbytes, "prefill_s": pre, "copy_h2d_s": ceiling,  # type: ignore[index]
                                                 "loads_s": loads}
            lines.append(f"| {tokens} | prefill | {span(pre)} | - | - | 1.00 |")
            lines.append(f"| {tokens} | copy_ pinned H2D of the KV | {span(ceiling)} | "
                         f"{prefix.nbytes / med(ceiling) / 1e9:.1f} | 1.00 | {med(ceiling) / med(pre):.3f} |")
            for label, ts in loads.items():
                lines.append(f"| {tokens} | load from {label} | {span(ts)} | {prefix.nbytes / med(ts) / 1e9:.1f} | "
                             f"{med(ceiling) / med(ts):.2f} | {med(ts) / med(pre):.3f} |")
            del prefix
    if not any("redis" in k for r in results["by_tokens"].values() for k in r["loads_s"]):  # type: ignore[attr-defined]
        print("redis-server or redis-py is not installed here: the Redis rows are left out", flush=True)
    print(f"\nseconds, median [min-max] of {args.reps}; GB/s of KV; x copy_: the load's rate over copy_'s; "
          f"x prefill: the load's time over the prefill's (below 1: loading wins)\n")
    print("| tokens | path | s | GB/s | x copy_ | x prefill |\n|---|---|---|---|---|---|")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def run_loads(prefix: Prefix, started: list, args: argparse.Namespace, device: torch.device) -> dict[str, list[float]]:
    """Seconds of a load of ``prefix`` from each store (saved there first, untimed)."""
    out: dict[str, list[float]] = {}

    def measure(label: str, store: Store) -> None:
        prefix.transfer(store, prefix.src).save_sequence(prefix.token_ids, prefix.src_slots)
        store.flush(60)
        loader = prefix.transfer(store, prefix.dst)

        def load() -> None:
            n, _ = loader.load_sequence(prefix.token_ids, prefix.dst_slots)
            assert n == prefix.tokens, f"{label}: {n} of {prefix.tokens} tokens"
        out[label] = timed(load, args.reps, device, prefix.clear)
        if not prefix.loaded_right():
            raise SystemExit(f"{label}: the loaded KV differs from the saved KV")

    with open_store(f"memory://?max_bytes={2 * prefix.nbytes}") as memory:
        measure("memory://", memory)
    with shm_store("breakeven", 2 * prefix.nbytes) as (shm, _):
        measure("shm://", shm)
    for n in sorted({1, args.shards}) if started else []:
        if n < 1:
            continue
        for s in started[:n]:
            s.flushall()
        with open_store(shards_url(started[:n])) as store:
            measure("one redis-server" if n == 1 else f"redis+shards://, {n} servers", store)
    return out


if __name__ == "__main__":
    np.random.seed(0)
    main()
