"""Preference pairs for DPO: JSONL records with a prompt, a chosen and a rejected completion, written as
a preference dataset (trainer/shards.py, manifest version 3) by prepare_data with --preference.

A record's fields are plain text, or chat messages: a prompt that is a list of {"role", "content"}
messages, and completions that are assistant messages (a list of them, or one string). Chat is
rendered with the tokenizer's chat template, the prompt with the generation prompt; the completion
is what the whole conversation adds to it. Each of the two sequences (prompt + chosen, prompt +
rejected) is tokenized as one text, closed by the end-of-sequence id, and masked so that only the
completion and its end-of-sequence id are trained (sft_examples.tokenize_examples), then cut to
--max-length tokens from its end (TRL's keep_start). A pair whose completions are identical, or one
of whose completions is empty after the cut, teaches nothing: it is left out and counted.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from training_jobs.contract.token_data import SPLITS
from training_jobs.sft_examples import check_messages, require_chat_template, tokenize_examples
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import DTYPES, dtype_for_vocab, mask_name, pairs_name, write_manifest

PAIRS_PER_TASK = 128


@dataclass(frozen=True)
class PreferenceFields:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"

    def option(self, name: str) -> str:
        return {self.prompt: "--prompt-key", self.chosen: "--chosen-key"}.get(name, "--rejected-key")


@dataclass(frozen=True)
class Pair:
    """A pair as text: the prompt, and the two completions (rendered by the chat template for chat)."""

    where: str
    prompt: str
    chosen: str
    rejected: str


@dataclass
class LeftOut:
    """The pairs left out, by reason, with where each is."""

    identical: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)

    def report(self, max_length: int) -> str:
        parts = []
        if self.identical:
            parts.append(f"{len(self.identical)} pair(s) whose chosen and rejected completions are "
                         f"identical (e.g. {self.identical[0]})")
        if self.empty:
            parts.append(f"{len(self.empty)} pair(s) with a completion that has no token left after "
                         f"cutting its sequence to --max-length {max_length} tokens (e.g. "
                         f"{self.empty[0]})")
        return "; ".join(parts)


def _completion_messages(where: str, value: Any, name: str) -> list[dict[str, str]]:
    messages = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
    checked = check_messages(where, messages, name)
    if checked[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message of {name!r} must be the assistant's (the completion)")
    return checked


def _chat_pair(where: str, record: dict, fields: PreferenceFields, tokenizer) -> Pair:
    require_chat_template(tokenizer)
    prompt = record[fields.prompt]
    if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                             and isinstance(m.get("content"), str) for m in prompt):
        raise DataError(f"{where}: field {fields.prompt!r} must be a non-empty list of messages "
                        "({\"role\": ..., \"content\": ...} objects)")
    rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    completions = []
    for name in (fields.chosen, fields.rejected):
        whole = tokenizer.apply_chat_template(prompt + _completion_messages(where, record[name], name),
                                              tokenize=False)
        if not whole.startswith(rendered):
            raise DataError(f"{where}: the tokenizer's chat template renders the prompt differently when "
                            "the completion follows it, so the completion cannot be told apart: format "
                            "the pairs as plain text instead")
        completions.append(whole[len(rendered):])
    return Pair(where, rendered, *completions)


def read_pair(where: str, line: bytes, fields: PreferenceFields, tokenizer) -> Pair:
    """One JSONL line as a Pair, or a DataError naming the line and the field to fix."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not a JSON object ({error})") from error
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object")
    for name in (fields.prompt, fields.chosen, fields.rejected):
        if name not in record:
            raise DataError(f"{where}: no field {name!r} (choose it with {fields.option(name)})")
    if isinstance(record[fields.prompt], list):
        return _chat_pair(where, record, fields, tokenizer)
    for name in (fields.prompt, fields.chosen, fields.rejected):
        if not isinstance(record[name], str):
            raise DataError(f"{where}: field {name!r} must be a string, or chat messages with a prompt "
                            "that is a list of messages")
    return Pair(where, record[fields.prompt], record[fields.chosen], record[fields.rejected])


def iter_lines(files: list[Path]) -> Iterator[tuple[str, bytes]]:
    for path in files:
        if path.suffix.lower() not in (".jsonl", ".json"):
            raise DataError(f"{path}: preference pairs are read from JSONL (one {{\"prompt\", \"chosen\", "
                            "\"rejected\"}} object per line)")
        with path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield f"{path}:{number}", line


# --- worker side ---------------------------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, dtype: str, fields: PreferenceFields, max_length: int) -> None:
    from transformers import AutoTokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.update(tokenizer=AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True),
                  dtype=DTYPES[dtype], fields=fields, max_length=max_length)


Tokenized = tuple[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | str]


def tokenize_lines(lines: list[tuple[str, bytes]]) -> list[Tokenized]:
    """Per line: (where, (chosen tokens, chosen mask, rejected tokens, rejected mask)), or (where,
    "identical" / "empty") for a pair left out."""
    tokenizer, limit = _STATE["tokenizer"], _STATE["max_length"]
    pairs = [read_pair(where, line, _STATE["fields"], tokenizer) for where, line in lines]
    examples = [(p.where, (p.prompt, completion)) for p in pairs for completion in (p.chosen, p.rejected)]
    encoded = tokenize_examples(examples, tokenizer, _STATE["dtype"])
    results: list[Tokenized] = []
    for index, pair in enumerate(pairs):
        (chosen, chosen_mask), (rejected, rejected_mask) = encoded[2 * index:2 * index + 2]
        chosen, chosen_mask, rejected, rejected_mask = (chosen[:limit], chosen_mask[:limit],
                                                        rejected[:limit], rejected_mask[:limit])
        if not (_has_answer(chosen_mask) and _has_answer(rejected_mask)):
            results.append((pair.where, "empty"))
        elif np.array_equal(chosen, rejected) and np.array_equal(chosen_mask, rejected_mask):
            results.append((pair.where, "identical"))
        else:
            results.append((pair.where, (chosen, chosen_mask, rejected, rejected_mask)))
    return results


def _has_answer(mask: np.ndarray) -> bool:
    """Some target of the sequence is trained (a token after the first one is in the completion)."""
    return bool(mask[1:].any())


# --- output side ---------------------------------------------------------------------------------

class PairShardWriter:
    """Writes whole pairs to shards of about `shard_tokens` tokens, with masks and pair indexes."""

    def __init__(self, split: str, folder: Path, dtype: str, shard_tokens: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.split, self.folder, self.dtype, self.shard_tokens = split, folder, dtype, shard_tokens
        self.shards: list[tuple[str, int]] = []
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.rows: list[tuple[int, int, int]] = []
        self.buffered = 0
        self.pairs = 0

    def add(self, chosen: np.ndarray, chosen_mask: np.ndarray, rejected: np.ndarray,
            rejected_mask: np.ndarray) -> None:
        start = self.buffered
        self.rows.append((start, start + len(chosen), start + len(chosen) + len(rejected)))
        self.tokens += [chosen, rejected]
        self.masks += [chosen_mask, rejected_mask]
        self.buffered += len(chosen) + len(rejected)
        self.pairs += 1
        if self.buffered >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        np.concatenate(self.tokens).astype(DTYPES[self.dtype]).tofile(self.folder / name)
        np.concatenate(self.masks).astype(np.uint8).tofile(self.folder / mask_name(name))
        np.asarray(self.rows, dtype="<i8").tofile(self.folder / pairs_name(name))
        self.shards.append((name, self.buffered))
        self.tokens, self.masks, self.rows, self.buffered = [], [], [], 0

    def close(self, vocab_size: int, eos_token_id: int, tokenizer: str) -> int:
        if self.buffered:
            self._flush()
        write_manifest(self.folder, dtype=self.dtype, vocab_size=vocab_size, eos_token_id=eos_token_id,
                       num_documents=self.pairs, shards=self.shards, tokenizer=tokenizer,
                       loss_mask=True, pairs=True)
        return sum(count for _, count in self.shards)


def _batches(lines: Iterator[tuple[str, bytes]]) -> Iterator[list[tuple[str, bytes]]]:
    batch = []
    for line in lines:
        batch.append(line)
        if len(batch) == PAIRS_PER_TASK:
            yield batch
            batch = []
    if batch:
        yield batch


def _tokenized(args, dtype: str, fields: PreferenceFields, files: list[Path]):
    setup = (str(args.tokenizer), dtype, fields, args.max_length)
    if args.workers == 1:
        _init_worker(*setup)
        return map(tokenize_lines, _batches(iter_lines(files))), None
    pool = get_context("spawn").Pool(args.workers, _init_worker, setup)
    return pool.imap(tokenize_lines, _batches(iter_lines(files))), pool


def write_preference_dataset(args, files: list[Path], tokenizer, folder: Path,
                             is_validation) -> dict[str, int]:
    """The preference dataset of `files` in `folder` (split like prepare_data's documents); returns
    the tokens of each split. Pairs left out are reported on stderr with their counts."""
    fields = PreferenceFields(args.prompt_key or "prompt", args.chosen_key, args.rejected_key)
    dtype = dtype_for_vocab(len(tokenizer))
    fraction = args.validation_fraction
    splits = {name: folder / name for name in SPLITS} if fraction > 0 else {"train": folder}
    writers = {name: PairShardWriter(name, path, dtype, args.shard_tokens) for name, path in splits.items()}
    left_out, index = LeftOut(), 0
    results, pool = _tokenized(args, dtype, fields, files)
    try:
        for batch in results:
            for where, result in batch:
                if isinstance(result, str):
                    getattr(left_out, result).append(where)
                    continue
                writers["validation" if is_validation(index, fraction) else "train"].add(*result)
                index += 1
    finally:
        if pool is not None:
            pool.terminate()
    _check_kept(writers, left_out, args, files)
    return {name: writer.close(len(tokenizer), tokenizer.eos_token_id, str(args.tokenizer))
            for name, writer in writers.items()}


def _check_kept(writers: dict[str, PairShardWriter], left_out: LeftOut, args, files: list[Path]) -> None:
    report = left_out.report(args.max_length)
    kept = sum(writer.pairs for writer in writers.values())
    if kept == 0:
        raise DataError(f"no preference pair to train on in {', '.join(map(str, files))}"
                        + (f": left out {report}" if report else "")
                        + "; check the fields (--prompt-key, --chosen-key, --rejected-key) and --max-length")
    if report:
        print(f"prepare_data: left out {report}; kept {kept} pair(s)", file=sys.stderr)
    for writer in writers.values():
        if writer.pairs == 0:
            raise DataError(f"no pair went to the {writer.split} split: the input's {kept} kept pair(s) "
                            f"all went to the other; change --validation-fraction "
                            f"({args.validation_fraction:g}) or add pairs")
