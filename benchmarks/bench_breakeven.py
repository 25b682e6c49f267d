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
verdict divides each load's time by the prefill's: below 1, loading wins. Each row is printed
(and the JSON rewritten) as soon as it is measured; a row that fails becomes a note and the run
goes on. Loads take the slots on the host, as vLLM's connector passes them.

    python benchmarks/bench_breakeven.py [--reps 5] [--json out.json]                       # a GPU host
    python benchmarks/bench_breakeven.py --device cpu --layers 2 --vocab 1024 --tokens 256 --reps 1 \
        --hidden 256 --mlp 512 --model stand-in --shards 0                                   # plumbing, anywhere
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
    noted,
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


def llama(device: torch.device, layers: int, vocab: int, hidden: int = HIDDEN, mlp: int = MLP,
          stand_in: bool = False) -> tuple[Callable[[torch.Tensor, bool], object], str]:
    """The prefill to beat: HF ``LlamaForCausalLM`` (Llama-3-8B shape, random bf16 weights,
    sdpa), or the stand-in where transformers is missing (or ``stand_in``). Returns
    ``(forward(ids, use_cache), description)``."""
    if stand_in:
        return _stand_in(device, layers, hidden, mlp), "model-shaped stand-in (asked for)"
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return _stand_in(device, layers, hidden, mlp), "model-shaped stand-in (transformers is not installed)"
    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
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


def _stand_in(device: torch.device, layers: int, hidden: int = HIDDEN, mlp: int = MLP
              ) -> Callable[[torch.Tensor, bool], object]:
    g = torch.Generator(device=device).manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16) * cols ** -0.5
    qkv, o = w((Q_HEADS + 2 * KV_HEADS) * HEAD, hidden), w(hidden, Q_HEADS * HEAD)
    gate_up, down = w(2 * mlp, hidden), w(hidden, mlp)
    norm = torch.ones(hidden, device=device, dtype=torch.bfloat16)

    @torch.inference_mode()
    def forward(ids: torch.Tensor, use_cache: bool) -> object:
        n = ids.shape[1]
        x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
        for _ in range(layers):  # the same weights each layer: an 8B model's FLOPs and weight traffic
            h = F.rms_norm(x, (hidden,), norm)
            q, k, v = (h @ qkv.T).split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
            q = q.view(n, Q_HEADS, HEAD).transpose(0, 1)
            k = k.view(n, KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0)
            v = v.view(n, KV_HEADS, HEAD).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, Q_HEADS * HEAD)
            x = x + a @ o.T
            gate, up = (F.rms_norm(x, (hidden,), norm) @ gate_up.T).chunk(2, dim=-1)
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


class Table:
    """The verdict table, printed and written as it grows (a row that fails is a note row)."""

    def __init__(self, path: str | None, results: dict[str, Any]) -> None:
        self.path, self.results = path, results
        results.setdefault("rows", [])
        results.setdefault("notes", [])
        print("\n| tokens | path | s | GB/s | x copy_ | x prefill |\n|---|---|---|---|---|---|", flush=True)

    def row(self, line: str, **fields: Any) -> None:
        print(line, flush=True)
        self.results["rows"].append(fields)  # type: ignore[union-attr]
        self.write()

    def note(self, text: str) -> None:
        print(f"| - | {text} | - | - | - | - |", flush=True)
        self.results["notes"].append(text)  # type: ignore[union-attr]
        self.write()

    def run(self, label: str, fn: Callable[[], object]) -> object:
        """``fn()``, or None where it failed (a note row)."""
        return noted(label, fn, self.note)

    def write(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps(self.results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="2048,8192", help="prefix lengths (multiples of 256)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the model's hidden size (smaller: a plumbing run)")
    parser.add_argument("--mlp", type=int, default=MLP, help="the model's MLP size (smaller: a plumbing run)")
    parser.add_argument("--model", choices=("llama", "stand-in"), default="llama")
    parser.add_argument("--shards", type=int, default=4, help="servers of the sharded store (0: no Redis rows)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the figures as JSON here (rewritten after every row)")
    args = parser.parse_args()
    device = torch.device(args.device)
    lengths = [int(t) for t in args.tokens.split(",")]
    if any(t % 256 for t in lengths):
        raise SystemExit("--tokens must be multiples of 256")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (device path, plumbing run)"
    print(f"{machine()}; device: {name}", flush=True)
    forward, model_name = llama(device, args.layers, args.vocab, args.hidden, args.mlp, args.model == "stand-in")
    print(f"prefill: {model_name}", flush=True)
    results: dict[str, Any] = {"machine": machine(), "device": name, "model": model_name, "layers": args.layers}
    print(f"seconds, median [min-max] of {args.reps}; GB/s of KV; x copy_: the load's rate over copy_'s; "
          f"x prefill: the load's time over the prefill's (below 1: loading wins)", flush=True)
    table = Table(args.json, results)
    check = table.run("the model's KV through shm://",
                      lambda: model_kv_round_trip(forward, device, lengths[0], args.layers, args.vocab))
    results["kv_check"] = check
    if check is not None:
        table.note(f"the model's KV through shm://: {check}")
    with redis_servers(args.shards if args.shards > 0 else 0) as started:
        if args.shards > 0 and not started:
            table.note("redis-server or redis-py is not installed here: the Redis rows are left out")
        for tokens in lengths:
            table.run(f"{tokens} tokens", lambda tokens=tokens: one_length(tokens, forward, started, args, device, table))


def one_length(tokens: int, forward: Callable[[torch.Tensor, bool], object], started: list,
               args: argparse.Namespace, device: torch.device, table: Table) -> None:
    """The prefill of ``tokens``, the copy_ ceiling and every store's load, each row as it is measured."""
    ids = torch.randint(0, args.vocab, (1, tokens), device=device)
    pre = timed(lambda: forward(ids, False), args.reps, device)
    table.row(f"| {tokens} | prefill | {span(pre)} | - | - | 1.00 |", tokens=tokens, path="prefill", seconds=pre)
    prefix = Prefix(device, tokens, args.layers)
    ceiling = copy_ceilings(prefix.nbytes, args.reps, device)["h2d_pinned"]
    table.row(f"| {tokens} | copy_ pinned H2D of the KV | {span(ceiling)} | {prefix.nbytes / med(ceiling) / 1e9:.1f} | "
              f"1.00 | {med(ceiling) / med(pre):.3f} |", tokens=tokens, path="copy_ pinned H2D", seconds=ceiling,
              kv_bytes=prefix.nbytes)
    for label, ts in run_loads(prefix, started, args, device, table):
        table.row(f"| {tokens} | load from {label} | {span(ts)} | {prefix.nbytes / med(ts) / 1e9:.1f} | "
                  f"{med(ceiling) / med(ts):.2f} | {med(ts) / med(pre):.3f} |", tokens=tokens, path=f"load from {label}",
                  seconds=ts, kv_bytes=prefix.nbytes, prefill_s=pre, copy_h2d_s=ceiling)


def run_loads(prefix: Prefix, started: list, args: argparse.Namespace, device: torch.device,
              table: Table) -> Iterator[tuple[str, list[float]]]:
    """Seconds of a load of ``prefix`` from each store (saved there first, untimed), yielded as
    each is measured; a store that fails is a note."""

    def measure(label: str, store: Store) -> list[float]:
        prefix.transfer(store, prefix.src).save_sequence(prefix.token_ids, prefix.src_slots)
        store.flush(60)
        loader = prefix.transfer(store, prefix.dst)

        def load() -> None:
            n, _ = loader.load_sequence(prefix.token_ids, prefix.dst_slots_host)
            assert n == prefix.tokens, f"{label}: {n} of {prefix.tokens} tokens"
        ts = timed(load, args.reps, device, prefix.clear)
        if not prefix.loaded_right():
            raise RuntimeError(f"{label}: the loaded KV differs from the saved KV")
        return ts

    def memory() -> list[float]:
        with open_store(f"memory://?max_bytes={2 * prefix.nbytes}") as store:
            return measure("memory://", store)

    def shm() -> list[float]:
        with shm_store("breakeven", 2 * prefix.nbytes) as (store, _):
            return measure("shm://", store)
    stores: list[tuple[str, Callable[[], list[float]]]] = [("memory://", memory), ("shm://", shm)]
    for n in sorted({1, args.shards}) if started else []:
        if n < 1:
            continue

        def redis(n: int = n) -> list[float]:
            for s in started[:n]:
                s.flushall()
            with open_store(shards_url(started[:n])) as store:
                return measure("redis", store)
        stores.append(("one redis-server" if n == 1 else f"redis+shards://, {n} servers", redis))
    for label, fn in stores:
        ts = table.run(f"{prefix.tokens} tokens, load from {label}", fn)
        if ts is not None:
            yield label, ts  # type: ignore[misc]


if __name__ == "__main__":
    np.random.seed(0)
    main()
