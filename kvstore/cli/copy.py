"""``kvstore cp --from URL --to URL [--namespace ID]``: copy records between stores, verified.

The way to warm a cache offline into a file store or a staging Redis and ship it to production
S3 (or back). Contract:

* Only kvstore records of this format version are copied (keys ``kvs<v>/<namespace>/<digest>``);
  other keys are counted and left alone, like every store tool.
* **Verified**: every record is decoded in full (header, token ids, checksum) and checked to
  belong under its key before it is written; a bad one is counted and never copied. After each
  batch, the destination's sizes of the written keys must equal what was sent.
* **Resumable**: a record the destination already holds with the same size is skipped, so
  running the same command again after an interruption copies only what is missing.
* The destination is probed before anything is read: unreachable, it is one line and exit 2.
* **Transient stalls are retried**: a batch that meets an outage or a missed deadline after the
  probe succeeded (a server busy for a moment, a connection reset) is run again from its size
  check, up to ``--retries`` times with a growing pause; its counts are added only once it
  completes, so a retried batch is never counted twice. Still failing, it is one line and exit 2.
* Progress: a bar on a terminal (tqdm when installed), ``--progress lines`` prints one line per
  batch; ``--json`` prints a summary document. Exit 0 when every record was copied or already
  there, 1 when some were skipped as invalid or failed to verify, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from contextlib import closing
from dataclasses import asdict, dataclass

from kvstore.buffers import BufferPool, Lease, footprint
from kvstore.cli import tiers as tier_io
from kvstore.cli.clean import gc_verdict
from kvstore.cli.common import number
from kvstore.cli.tiers import (
    Tier,
    batched,
    emit_json,
    human_bytes,
    iter_tier_keys,
    require_existing,
    unavailable_as_error,
)
from kvstore.config import redact_url
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.keys import FORMAT_VERSION, namespace_prefix, split_key
from kvstore.stores import open_store

__all__ = ["register", "cmd_cp", "CopySummary"]

_PROBE_KEY = "kvstore-cp-probe"
_MIN_POOL_BYTES = 64 << 20


@dataclass
class CopySummary:
    source: str
    destination: str
    records: int = 0
    copied: int = 0
    copied_bytes: int = 0
    already_there: int = 0
    invalid: int = 0
    vanished: int = 0
    verify_failed: int = 0
    foreign_keys: int = 0
    retried_batches: int = 0
    seconds: float = 0.0
    interrupted: bool = False

    def add(self, batch: CopySummary) -> None:
        """Add a completed batch's record counts."""
        for name in _RECORD_COUNTS:
            setattr(self, name, getattr(self, name) + getattr(batch, name))


_RECORD_COUNTS = ("copied", "copied_bytes", "already_there", "invalid", "vanished", "verify_failed")
_RETRY_PAUSE_S = 0.5  # the first pause before a batch is retried; it doubles with each retry


class _Progress:
    def __init__(self, mode: str, total: int) -> None:
        self.mode, self.total, self.bar = mode, total, None
        if mode == "bar":
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="rec", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.mode = "lines"

    def update(self, n: int, s: CopySummary) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(copied=s.copied, skipped=s.already_there, bytes=human_bytes(s.copied_bytes),
                                 refresh=False)
        elif self.mode == "lines":
            done = s.copied + s.already_there + s.invalid + s.vanished + s.verify_failed
            print(f"cp: {done}/{self.total} records: {s.copied} copied ({human_bytes(s.copied_bytes)}), "
                  f"{s.already_there} already there, {s.invalid} invalid", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _open(url: str, role: str) -> Tier:
    try:
        return Tier(0, url, open_store(url))
    except (ConfigError, StoreUnavailableError):
        raise
    except ValueError as exc:
        raise ConfigError(f"{role} URL {redact_url(url)!r} is not valid: {exc}") from exc


def _probe(tier: Tier, role: str) -> None:
    try:
        with unavailable_as_error(tier.name):
            tier.store.size_many([_PROBE_KEY])
    except StoreUnavailableError as exc:
        raise StoreUnavailableError(f"{role} {tier.name} is unreachable: {exc}") from None


def cmd_cp(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be at least 1")
    prefix = namespace_prefix(args.namespace) if args.namespace else ""
    if redact_url(args.source) == redact_url(args.dest):
        raise ConfigError("--from and --to name the same store")
    require_existing(args.source, "--from")
    src = _open(args.source, "source")
    try:
        dst = _open(args.dest, "destination")
    except BaseException:
        src.store.close()
        raise
    summary = CopySummary(src.name, dst.name)
    start = time.monotonic()
    bar: _Progress | None = None
    try:
        _probe(dst, "destination")
        keys: list[str] = []
        for key in iter_tier_keys(src, prefix):
            parts = split_key(key)
            if parts is None or parts[0] != FORMAT_VERSION:
                summary.foreign_keys += 1
            else:
                keys.append(key)
        summary.records = len(keys)
        mode = args.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() and not args.json else "none"
        bar = _Progress(mode, len(keys))
        buffers = _Buffers()
        for batch in batched(sorted(keys), args.batch):
            _copy_with_retries(src, dst, batch, summary, buffers, args.retries)
            bar.update(len(batch), summary)
        with unavailable_as_error(dst.name):
            if not dst.store.flush(args.flush_timeout):
                raise StoreUnavailableError(f"destination {dst.name}: writes still pending after "
                                            f"{args.flush_timeout:g}s")
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        if bar is not None:
            bar.close()
        summary.seconds = round(time.monotonic() - start, 3)
        for tier in (src, dst):
            try:
                tier.store.close()
            except Exception:  # noqa: BLE001 - closing must not hide the command's own outcome
                pass
    _report(summary, args.json)
    if summary.interrupted:
        return 130
    return 1 if summary.invalid or summary.verify_failed else 0


class _Buffers:
    """The pool a batch's values are received into: resident buffers reused from one batch to
    the next, where fresh ones would cost the kernel's zeroing and a page fault per page every
    time. It holds a whole batch (its values stay leased until the destination has them), and
    grows when a batch needs more: the bytes a batch holds at once, as before."""

    def __init__(self) -> None:
        self.pool: BufferPool | None = None

    def for_batch(self, nbytes: int) -> BufferPool:
        if self.pool is None or self.pool.max_bytes < nbytes:
            self.pool = BufferPool(max(nbytes, _MIN_POOL_BYTES))
        return self.pool

    def forget(self) -> None:
        """Leave the pool to the values still leased from it (writes not known to have landed):
        the next batch gets a new one rather than wait for space that may never come back."""
        self.pool = None


def _receive(src: Tier, keys: list[str], pool: BufferPool) -> list[Lease | None]:
    """The values of ``keys`` as leases of ``pool`` (None: gone), all released on an error."""
    leases: list[Lease | None] = []
    try:
        with unavailable_as_error(src.name), closing(src.store.get_into(keys, pool)) as stream:
            leases.extend(stream)
    except BaseException:
        _release(leases)
        raise
    return leases


def _release(leases: Iterable[Lease | None]) -> None:
    for lease in leases:
        if lease is not None:
            lease.release()


def _copy_with_retries(src: Tier, dst: Tier, batch: list[str], s: CopySummary, buffers: _Buffers,
                       retries: int) -> None:
    """``_copy_batch`` run again on a ``StoreUnavailableError``, up to ``retries`` times with a
    doubling pause; the batch's counts reach ``s`` only once it completes. Rerunning is safe: it
    starts from the sizes both sides hold, and a write of the same record is idempotent."""
    for attempt in range(retries + 1):
        counts = CopySummary(s.source, s.destination)
        try:
            _copy_batch(src, dst, batch, counts, buffers)
        except StoreUnavailableError as exc:
            if attempt == retries:
                raise StoreUnavailableError(f"{exc} (the batch was tried {retries + 1} times)") from exc
            s.retried_batches += 1
            time.sleep(_RETRY_PAUSE_S * 2 ** attempt)
            continue
        s.add(counts)
        return


def _copy_batch(src: Tier, dst: Tier, batch: list[str], s: CopySummary, buffers: _Buffers) -> None:
    src_sizes = tier_io.sizes(src, batch)
    dst_sizes = tier_io.sizes(dst, batch)
    todo, nbytes = [], 0
    for key, have, there in zip(batch, src_sizes, dst_sizes):
        if have is None:
            s.vanished += 1  # evicted or expired while we listed
        elif there == have:
            s.already_there += 1
        else:
            todo.append(key)
            nbytes += footprint(have)
    if not todo:
        return
    leases = _receive(src, todo, buffers.for_batch(nbytes))
    now = time.time()
    good: list[tuple[str, Lease]] = []
    for key, lease in zip(todo, leases):
        if lease is None:
            s.vanished += 1
        elif gc_verdict(key, lease.view, now=now, older_than=None, verify=True, digest=lease.digest) is not None:
            s.invalid += 1
            lease.release()
        else:
            good.append((key, lease))
    if not good:
        return
    sent = [len(lease.view) for _, lease in good]
    # The destination may still be sending a value until its flush says otherwise: a lease
    # goes back to the pool (whose next batch writes over it) only once nothing is pending.
    landed = False
    try:
        with unavailable_as_error(dst.name):
            dst.store.put_many([(key, lease.view) for key, lease in good])
            landed = dst.store.flush(30.0)
            written = dst.store.size_many([k for k, _ in good])
    finally:
        if landed:
            _release(lease for _, lease in good)
        else:
            buffers.forget()
    for size, there in zip(sent, written):
        if there == size:
            s.copied += 1
            s.copied_bytes += size
        else:
            s.verify_failed += 1


def _report(s: CopySummary, as_json: bool) -> None:
    if as_json:
        emit_json(asdict(s))
        return
    rate = s.copied_bytes / s.seconds / 1e9 if s.seconds > 0 else 0.0
    print(f"{s.source} -> {s.destination}: {s.records} records; copied {s.copied} "
          f"({human_bytes(s.copied_bytes)}, {rate:.2f} GB/s), {s.already_there} already there, "
          f"{s.invalid} invalid (not copied), {s.vanished} vanished, {s.verify_failed} failed verification "
          f"in {s.seconds:.1f} s")
    if s.retried_batches:
        print(f"cp: {s.retried_batches} batch attempts met an outage or a missed deadline and were retried")
    if s.foreign_keys:
        print(f"{s.source}: left {s.foreign_keys} keys that are not kvstore records of format v{FORMAT_VERSION}")
    if s.interrupted:
        print("cp: interrupted; run the same command again to copy the rest", file=sys.stderr)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cp", help="copy (and verify) records from one store to another; resumable")
    p.add_argument("--from", dest="source", required=True, metavar="URL", help="the store to read")
    p.add_argument("--to", dest="dest", required=True, metavar="URL", help="the store to write")
    p.add_argument("--namespace", metavar="ID", help="only this namespace (default: every record)")
    p.add_argument("--batch", type=number(int, 1, 100000), default=32, metavar="N",
                   help="records per round trip (bounds memory: N x record size; default 32)")
    p.add_argument("--retries", type=number(int, 0, 100), default=3, metavar="N",
                   help="times a batch that meets an outage or a missed deadline is run again, "
                        "pausing 0.5 s, 1 s, 2 s... (default 3; the destination's probe is not retried)")
    p.add_argument("--flush-timeout", type=number(float, 0, 86400), default=60.0, metavar="S",
                   help="seconds to wait at the end for the destination's pending writes (default 60)")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="progress display (auto: a bar on a terminal; lines: one line per batch)")
    p.add_argument("--json", action="store_true", help="print a JSON summary (for scripts)")
    p.set_defaults(func=cmd_cp)
