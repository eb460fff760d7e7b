"""The token shards of a run's `train` and `validation` channels, checked before a job starts.

`llmtrain data prepare` (the training program's prepare_data) writes a dataset folder: with
`--validation-fraction`, `train/` and `validation/`, else the shards at its top; each split a
`manifest.json` and its shard files; and beside them `tokenizer/`, the tokenizer the shards were
made with. The format's names are the training contract's (training_jobs/contract/token_data.py),
which the program writes and loads them by.

The rules are those the job applies when it loads the channels, so that a run that would fail a
minute (or an hour of provisioning) into its job is refused before anything starts:

- a channel holds a manifest, and every shard (and loss mask) it lists with the size it says;
- `train` holds at least one sample of seq_len + 1 tokens within one shard, `validation` at least
  one evaluation batch (data-parallel ranks x micro_batch_size samples);
- each manifest's version is one the code the template version runs reads (version 2, loss-masked
  data, is read by code published from release 1.1.0 on), its vocab_size holds its end-of-sequence
  id, and a loss-masked one that records its trained answer tokens (`answer_tokens`, written by
  prepare_data) has some;
- the shards' content agrees with the manifest (no token id at or beyond vocab_size) and a
  loss-masked dataset's masks train some answer token: read by the program's own check
  (`python -m training_jobs.data_info`) for local folders; in S3 only the manifest's `answer_tokens`
  is checked (the job checks the rest when it loads the shards);
- both splits were made by one tokenizer (vocabulary size, end-of-sequence id) with the same loss
  (both loss-masked or neither);
- the tokenizer the job reads them with (its `tokenizer` channel, else its `model` channel's, else
  the program's shipped one) has the data's end-of-sequence id and at least its vocabulary.

`llmtrain run --local` checks local folders, `llmtrain start` the manifests in S3 (the shard sizes
from the listing: no shard is read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.program_contract import request_hyperparameters
from llmtrain.core.sourcedir import program_environment, repository_root
from llmtrain.core.user_cache import cached_json, content_key, installed_version
from training_jobs.contract import ConfigError
from training_jobs.contract.hyperparameters import from_hyperparameters, hyperparameter_fields
from training_jobs.contract.parallel_dims import ParallelDims
from training_jobs.contract.token_data import (
    DTYPE_BYTES,
    FORMAT,
    LOSS_MASKED,
    MANIFEST,
    TOKENIZER_FOLDER,
)
from training_jobs.contract.token_data import SHIPPED_TOKENIZER as CONTRACT_SHIPPED_TOKENIZER

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SHIPPED_TOKENIZER = Path(*CONTRACT_SHIPPED_TOKENIZER)
TOKENIZER_INFO_MODULE = "training_jobs.tokenizer_info"
DATA_INFO_MODULE = "training_jobs.data_info"
PREPARE_HINT = "prepare it with `llmtrain data prepare --input FILES --output DIR`"


class TokenDataError(LlmtrainError):
    """A channel's token shards would fail the job; the message says what to fix."""


@dataclass(frozen=True)
class ShardsManifest:
    """What a channel's manifest says: the tokenizer's vocabulary and end-of-sequence id, whether
    the data is loss-masked, and each shard file (and its mask) with its token count."""

    where: str
    vocab_size: int
    eos_token_id: int
    loss_mask: bool
    dtype: str
    shards: tuple[tuple[str, int], ...]
    masks: tuple[str, ...] = ()
    version: int = 1
    answer_tokens: int | None = None  # loss-masked data by prepare_data: trained non-EOS tokens

    @property
    def num_tokens(self) -> int:
        return sum(count for _, count in self.shards)

    def samples(self, seq_len: int) -> int:
        """Samples of seq_len + 1 tokens (overlapping by one), cut within each shard as the job cuts them."""
        return sum(max(count - 1, 0) // seq_len for _, count in self.shards)

    def file_sizes(self) -> dict[str, int]:
        """The bytes each listed file must have."""
        sizes = {name: count * DTYPE_BYTES[self.dtype] for name, count in self.shards}
        sizes.update({mask: count for mask, (_, count) in zip(self.masks, self.shards, strict=False)})
        return sizes


@dataclass(frozen=True)
class RunShape:
    """What one sample and one evaluation step of the run take."""

    seq_len: int
    eval_batch: int  # samples: data-parallel ranks x micro_batch_size

    @classmethod
    def of(cls, hyperparameters: Mapping[str, Any], *, hosts: int, processes_per_host: int) -> RunShape:
        """From a request's (JSON-encoded) hyperparameters, on `hosts` x `processes_per_host` ranks."""
        values = request_hyperparameters({"HyperParameters": hyperparameters})
        known = hyperparameter_fields()
        try:
            config = from_hyperparameters({name: v for name, v in values.items() if name in known})
            dims = ParallelDims.resolve(config.parallel, hosts * processes_per_host, hosts)
        except ConfigError as error:
            raise TokenDataError(str(error)) from None
        flat = config.flat()
        return cls(int(flat["seq_len"]), dims.data_parallel * int(flat["micro_batch_size"]))


@dataclass(frozen=True)
class TokenizerFacts:
    """What the job's tokenizer gives the data: its size (len(tokenizer)) and end-of-sequence id."""

    where: str
    vocab_size: int
    eos_token_id: int | None


def parse_manifest(raw: bytes, where: str) -> ShardsManifest:
    """A manifest's content, or a TokenDataError naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise TokenDataError(f"{where}{MANIFEST} is not valid JSON ({error}); {PREPARE_HINT}") from error
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") not in LOSS_MASKED:
        raise TokenDataError(f"{where}{MANIFEST} is not a manifest of token shards ({FORMAT}, version "
                             f"{' or '.join(map(str, LOSS_MASKED))}); {PREPARE_HINT}")
    loss_mask = LOSS_MASKED[body["version"]]
    entries = body.get("shards")
    if body.get("dtype") not in DTYPE_BYTES or not isinstance(entries, list) or not all(
            _valid_entry(entry, loss_mask) for entry in entries):
        raise TokenDataError(f"{where}{MANIFEST} lacks its dtype or a well-formed list of shards; "
                             f"{PREPARE_HINT}")
    for name in ("vocab_size", "eos_token_id"):
        if not isinstance(body.get(name), int) or isinstance(body.get(name), bool):
            raise TokenDataError(f"{where}{MANIFEST} has no integer {name!r}; {PREPARE_HINT}")
    if not 0 <= body["eos_token_id"] < body["vocab_size"]:
        raise TokenDataError(f"{where}{MANIFEST} says vocab_size {body['vocab_size']} and eos_token_id "
                             f"{body['eos_token_id']}: a vocabulary holds at least one token and its "
                             f"end-of-sequence id; {PREPARE_HINT}")
    answer_tokens = body.get("answer_tokens")
    return ShardsManifest(
        where=where, vocab_size=body["vocab_size"], eos_token_id=body["eos_token_id"], loss_mask=loss_mask,
        dtype=body["dtype"], shards=tuple((entry["path"], entry["num_tokens"]) for entry in entries),
        masks=tuple(entry["mask"] for entry in entries) if loss_mask else (), version=body["version"],
        answer_tokens=answer_tokens if type(answer_tokens) is int else None)


def _valid_entry(entry: Any, loss_mask: bool) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("path"), str)
            and isinstance(entry.get("num_tokens"), int) and entry["num_tokens"] >= 0
            and (not loss_mask or isinstance(entry.get("mask"), str)))


def file_problems(manifest: ShardsManifest, sizes: Mapping[str, int]) -> list[str]:
    """Listed files missing from `sizes` (name -> bytes present) or of another size."""
    problems = []
    for name, wanted in manifest.file_sizes().items():
        present = sizes.get(name)
        if present is None:
            problems.append(f"{manifest.where}{name}, listed in its manifest, is missing")
        elif present != wanted:
            problems.append(f"{manifest.where}{name} has {present} bytes where its manifest says "
                            f"{wanted} (truncated, or not written by `llmtrain data prepare`)")
    return problems


def split_folders_hint(channel: str, where: str, splits: list[str]) -> str:
    """The problem of a channel that names a prepared dataset's folder instead of one of its splits."""
    sets = " and ".join(f"{split} -> {where}{split}/" for split in splits)
    return (f"channel {channel}: {where} holds no {MANIFEST} but the split folder(s) "
            f"{', '.join(f'{s}/' for s in splits)} of a prepared dataset: give each split as its own "
            f"channel ({sets})")


def data_problems(manifests: Mapping[str, ShardsManifest], shape: RunShape,
                  tokenizer: TokenizerFacts | None, manifest_versions: tuple[int, ...] = (1, 2)) -> list[str]:
    """What would stop the job when it loads these channels (see the module's rules);
    `manifest_versions`: those the code the template version runs reads (ProgramContract's)."""
    problems = [_version_problem(name, m, manifest_versions) for name, m in manifests.items()
                if m.version not in manifest_versions]
    if problems:
        return problems
    problems += [f"channel {name} ({m.where}) trains no answer token (its manifest records answer_tokens "
                 "0): its loss masks mark only prompts and end-of-sequence ids; prepare it again with "
                 "--completion-key naming the answers' field (or --messages-key with assistant messages)"
                 for name, m in manifests.items() if m.loss_mask and m.answer_tokens == 0]
    train, validation = manifests.get("train"), manifests.get("validation")
    if train is not None and train.samples(shape.seq_len) == 0:
        problems.append(f"channel train ({train.where}) holds {train.num_tokens} tokens, not one sample "
                        f"of seq_len + 1 = {shape.seq_len + 1} tokens within a shard: add data, or "
                        "--set seq_len to a shorter length")
    if validation is not None and validation.samples(shape.seq_len) < shape.eval_batch:
        problems.append(f"channel validation ({validation.where}) holds "
                        f"{validation.samples(shape.seq_len)} sample(s) of seq_len + 1 = "
                        f"{shape.seq_len + 1} tokens, and one evaluation step takes {shape.eval_batch} "
                        "(data-parallel ranks x micro_batch_size): hold out more of the data (`llmtrain "
                        "data prepare --validation-fraction`), shorten seq_len, or leave the validation "
                        "channel out")
    if train is not None and validation is not None:
        problems += _split_disagreements(train, validation)
    if tokenizer is not None:
        problems += [_tokenizer_problem(m, name, tokenizer) for name, m in manifests.items()
                     if _tokenizer_problem(m, name, tokenizer)]
    return problems


def _version_problem(channel: str, manifest: ShardsManifest, versions: tuple[int, ...]) -> str:
    kind = "a loss-masked dataset" if manifest.loss_mask else "a dataset"
    return (f"channel {channel} ({manifest.where}) is {kind} of manifest version {manifest.version}, but "
            f"the code this template version runs reads manifest version {' and '.join(map(str, versions))} "
            "only (it predates the format): run a newer version of the template (`llmtrain templates` "
            "lists them), or prepare the data for it (without --completion-key/--messages-key)")


def _split_disagreements(train: ShardsManifest, validation: ShardsManifest) -> list[str]:
    if train.loss_mask != validation.loss_mask:
        masked = "train" if train.loss_mask else "validation"
        return [f"only the {masked} channel is loss-masked (prompt/completion or chat examples): "
                "prepare both splits in one `llmtrain data prepare` run with --validation-fraction"]
    if (train.vocab_size, train.eos_token_id) != (validation.vocab_size, validation.eos_token_id):
        return [f"channels train ({train.where}) and validation ({validation.where}) were made with "
                f"different tokenizers (vocabularies of {train.vocab_size} and {validation.vocab_size} "
                f"tokens, end-of-sequence ids {train.eos_token_id} and {validation.eos_token_id}): "
                "prepare both with the model's tokenizer"]
    return []


def _tokenizer_problem(manifest: ShardsManifest, channel: str, tokenizer: TokenizerFacts) -> str | None:
    if manifest.eos_token_id == tokenizer.eos_token_id and manifest.vocab_size <= tokenizer.vocab_size:
        return None
    return (f"channel {channel} ({manifest.where}) was made with a tokenizer of {manifest.vocab_size} "
            f"tokens (end-of-sequence id {manifest.eos_token_id}), but the job reads it with "
            f"{tokenizer.where}, {tokenizer.vocab_size} tokens (end-of-sequence id "
            f"{tokenizer.eos_token_id}): give the run the tokenizer the data was made with as its "
            f"tokenizer channel (`llmtrain data prepare` writes it as {TOKENIZER_FOLDER}/ beside the "
            "splits), or prepare the data with the model's tokenizer")


# -- the tokenizer a job reads its data with ------------------------------------------------------------


def has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES)


def job_tokenizer(channels: Mapping[str, Path]) -> Path:
    """The folder the training program loads its tokenizer from (models.load_tokenizer): the
    tokenizer channel, else the model channel when it holds one, else the program's shipped one."""
    if "tokenizer" in channels:
        return channels["tokenizer"]
    if has_tokenizer(channels.get("model")):
        return channels["model"]
    return repository_root() / SHIPPED_TOKENIZER


@cache
def tokenizer_facts(folder: Path, described_as: str | None = None) -> TokenizerFacts:
    """Load the tokenizer as the training program does, in a subprocess of the shipped program
    (`python -m training_jobs.tokenizer_info`): llmtrain itself never imports it (nor torch). The
    answer is kept in the user's cache (llmtrain.core.user_cache), keyed by the folder's tokenizer
    files, the interpreter and its transformers: loading takes seconds, every local run asks."""
    key = content_key(_tokenizer_files(folder), os.path.realpath(sys.executable),
                      installed_version("transformers"))
    facts = cached_json("tokenizers", key, lambda: _load_tokenizer_facts(folder))
    return TokenizerFacts(described_as or f"the tokenizer in {folder}", facts["vocab_size"],
                          facts["eos_token_id"])


# Larger files beside a tokenizer are a model's weights, which no tokenizer reads.
_TOKENIZER_FILE_LIMIT = 64 * 2**20


def _tokenizer_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    return [p for p in files if p.stat().st_size < _TOKENIZER_FILE_LIMIT]


def _load_tokenizer_facts(folder: Path) -> dict[str, int]:
    result = subprocess.run([sys.executable, "-m", TOKENIZER_INFO_MODULE, str(folder)],
                            env=program_environment(), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split()) or "(no message)"
        raise TokenDataError(f"cannot load the tokenizer in {folder}: {reason}")
    facts = json.loads(result.stdout)
    return {"vocab_size": facts["vocab_size"], "eos_token_id": facts["eos_token_id"]}


def shipped_tokenizer_facts() -> TokenizerFacts:
    return tokenizer_facts(repository_root() / SHIPPED_TOKENIZER,
                           "the training program's shipped tokenizer (the run has no tokenizer channel)")


def content_problems(channels: Mapping[str, Path]) -> list[str]:
    """What the program refuses in the shards' content of these local channels (a token id beyond
    vocab_size, masks that train no answer token), checked by the shipped program itself in a
    subprocess (`python -m training_jobs.data_info`): it reads every shard, as the job's loader does."""
    result = subprocess.run([sys.executable, "-m", DATA_INFO_MODULE,
                             *(f"{name}={folder}" for name, folder in channels.items())],
                            env=program_environment(), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split()[-60:]) or "(no message)"
        raise TokenDataError(f"cannot check the shards of {', '.join(map(str, channels.values()))}: {reason}")
    return result.stdout.splitlines()
