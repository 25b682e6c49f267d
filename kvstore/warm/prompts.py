"""Prompt files for warming: one JSON object per line, read one line at a time.

A line is ``{"prompt_token_ids": [...]}`` or ``{"text": "..."}`` (tokenized with a local
tokenizer). A line that is not a prompt becomes a ``BadLine`` with its line number and reason;
blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["Prompt", "BadLine", "Tokenizer", "parse_line", "iter_prompts", "MAX_TOKEN_ID"]

#: Largest token id accepted in a prompt file (token ids are stored as uint32).
MAX_TOKEN_ID = (1 << 32) - 1


@dataclass(frozen=True)
class Prompt:
    """One prompt of the input file: its 1-based line number and token ids."""

    line: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class BadLine:
    """A line that is not a prompt, and why."""

    line: int
    reason: str


class Tokenizer:
    """A local Hugging Face tokenizer (``transformers``), loaded without network access."""

    def __init__(self, path: str, *, add_special_tokens: bool = True) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError("text prompts need the transformers package (pip install transformers) "
                              "or prompts given as prompt_token_ids") from exc
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tokenizer {path!r} is not a local tokenizer directory: {exc}") from exc
        self.add_special_tokens = add_special_tokens

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=self.add_special_tokens)["input_ids"])


def parse_line(text: str, line: int, tokenizer: Tokenizer | None) -> Prompt | BadLine | None:
    """One JSONL line as a prompt; ``None`` for a blank line."""
    if not text.strip():
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return BadLine(line, f"not JSON ({exc})")
    if not isinstance(doc, dict):
        return BadLine(line, "not a JSON object")
    if "prompt_token_ids" in doc:
        ids = doc["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids)):
            return BadLine(line, "prompt_token_ids must be a non-empty list of non-negative integer token ids")
        return Prompt(line, tuple(ids))
    if "text" in doc:
        if not isinstance(doc["text"], str) or not doc["text"]:
            return BadLine(line, "text must be a non-empty string")
        if tokenizer is None:
            return BadLine(line, "a text prompt needs --tokenizer PATH (or give prompt_token_ids)")
        try:
            ids = tokenizer.encode(doc["text"])
        except Exception as exc:  # noqa: BLE001 - a tokenizer's failure on one line is that line's problem
            return BadLine(line, f"tokenizer failed: {exc}")
        if not ids:
            return BadLine(line, "text tokenizes to no tokens")
        return Prompt(line, tuple(ids))
    return BadLine(line, 'expected {"prompt_token_ids": [...]} or {"text": "..."}')


def iter_prompts(lines: Iterable[str], *, tokenizer: Tokenizer | None = None) -> Iterator[Prompt | BadLine]:
    """Prompts and bad lines of a JSONL stream, in order, one line at a time."""
    for number, text in enumerate(lines, start=1):
        item = parse_line(text, number, tokenizer)
        if item is not None:
            yield item
