"""Turn text or JSONL files into the token shards the training program reads.

    python -m training_jobs.prepare_data --input FILES_OR_DIR... --tokenizer DIR --output DIR
        [--workers N] [--text-key text | --completion-key completion [--prompt-key prompt]
                       | --messages-key messages]
        [--validation-fraction 0.01] [--shard-tokens N] [--dedup exact|minhash] [--filter NAME]...
        [--unit-bytes N]
    ... --host-config [PATH] [--state DIR] [--previous DIR]   one instance of a distributed job
    python -m training_jobs.prepare_data --merge-only --input DIR --tokenizer DIR --output DIR [--shards DIR]

Inputs: `.jsonl`/`.json` files hold one JSON object per line (the document is its `--text-key`
field); `.csv`/`.tsv` files have a header row (the document is the `--text-key` column of each row);
any other file (`.txt`, `.md`, ...) is one UTF-8 document. Binary and compressed formats (Parquet,
Arrow, gzip, ...) are refused with what to convert them to. Folders are searched recursively.
The input is cut into work units (whole files, or byte ranges of large JSONL files) that --workers
processes tokenize (data_pipeline/); the output is identical whatever the number of workers, or of
the instances of a SageMaker Processing job that each run their share of the units (--host-config)
before one --merge-only step (data_pipeline/instances.py; with --dedup the merge removes the
duplicates across all units, data_pipeline/dedup_merge.py). With
`--validation-fraction`, a deterministic share of the documents goes to OUTPUT/validation and the
rest to OUTPUT/train; upload each folder as its own channel. A plain-text file is one document, so
it gives its own end instead: the text after the first paragraph boundary (else line, else word
boundary) at which at most that fraction of its characters is left is a validation document, the
text before it a training document.

The output is written to a work folder beside OUTPUT (.OUTPUT.partial) and renamed to OUTPUT at the
end: bad input leaves nothing behind; a run that stops (a killed worker, Ctrl-C) leaves the work
folder, and the same command resumes it. OUTPUT must not exist yet (or be empty). OUTPUT/tokenizer
holds the tokenizer the shards were made with (a run's `tokenizer` channel, so that the job reads
the data with the same vocabulary).

Supervised fine-tuning: with `--completion-key`, each JSONL record or CSV/TSV row is one example, a
prompt (`--prompt-key`, default `prompt`) and its completion. The two are tokenized as one text and
packed like documents (prompt, completion, end-of-sequence id), and a loss mask beside the shards
marks the completion and its end-of-sequence id as the only training targets: the model learns to
answer and to stop, not to reproduce prompts. With `--messages-key`, each JSONL record holds a
conversation (a list of {"role", "content"} messages) rendered with the tokenizer's chat template;
every assistant turn is trained (sft_examples.py).

Preference pairs (DPO): with `--preference`, each JSONL record holds a prompt (`--prompt-key`) and a
chosen and a rejected completion (`--chosen-key`, `--rejected-key`, default `chosen` and `rejected`),
as plain text or chat messages; each sequence is cut to `--max-length` tokens, and the output is a
preference dataset (preference_examples.py). Prompts with answers (GRPO): with `--prompts`, each JSONL
record's `--prompt-key` field is a prompt and its other fields are kept for the reward functions
(prompt_examples.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from training_jobs.contract.token_data import BINARY_SUFFIXES, SPLITS, TOKENIZER_FOLDER  # noqa: E402
from training_jobs.data_pipeline.arguments import (  # noqa: E402
    add_pipeline_arguments,
    check_pipeline_arguments,
)
from training_jobs.data_pipeline.plan import lines_in_range  # noqa: E402
from training_jobs.preference_examples import (  # noqa: E402
    add_post_training_arguments,
    check_post_training_arguments,
)
from training_jobs.sft_examples import (  # noqa: E402
    Example,
    check_messages,
    document_separators,
    require_chat_template,
    tokenize_examples,
)
from training_jobs.trainer.errors import DataError  # noqa: E402
from training_jobs.trainer.shards import (  # noqa: E402
    DTYPES,
    MANIFEST,
)

JSONL_SUFFIXES = (".jsonl", ".json")
TABLE_DELIMITERS = {".csv": ",", ".tsv": "\t"}
CONVERT_HINT = "convert it to JSONL (one {\"text\": ...} object per line), CSV or UTF-8 text first"
DOCUMENTS_PER_TASK = 256
# Where a text file's validation part may begin, coarsest first: after a blank line, a line, a word.
HOLD_OUT_BOUNDARIES = (("paragraph", re.compile(r"\n[ \t]*\n\s*")), ("line", re.compile(r"\n\s*")),
                       ("word", re.compile(r"\s+")))


# A document's text, or an example (prompt and completion, or a conversation) of a loss-masked
# dataset.
Content = str | Example


@dataclass(frozen=True)
class Fields:
    """Which JSONL fields or CSV/TSV columns hold a document (text) or an example (prompt and
    completion, or a conversation's messages)."""

    text: str = "text"
    prompt: str | None = None
    completion: str | None = None
    messages: str | None = None

    @property
    def loss_mask(self) -> bool:
        return self.completion is not None or self.messages is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The string fields of a record or row (a conversation's messages are read apart)."""
        if self.messages is not None:
            return ()
        return (self.prompt, self.completion) if self.completion is not None else (self.text,)

    def option(self, name: str) -> str:
        """The command-line option that chooses the field `name`."""
        if self.completion is None:
            return "--text-key"
        return "--prompt-key" if name == self.prompt else "--completion-key"

    def content(self, values: list[str]) -> Content:
        return (values[0], values[1]) if self.completion is not None else values[0]


@dataclass(frozen=True)
class Document:
    """A document or example: where it comes from, its content, its size in bytes, and the split
    it must go to (the parts of a text file cut for validation), else None (drawn per document)."""

    where: str
    content: Content
    num_bytes: int
    split: str | None = None


@dataclass(frozen=True)
class Task:
    """A batch of documents for one worker: (source, content) pairs, the split each must go to (or
    None), plus the bytes they span."""

    documents: list[tuple[str, Content]]
    splits: list[str | None]
    num_bytes: int


@dataclass
class Inputs:
    """What was read, for the errors that say what to change: the documents, the blank ones left
    out, and the text files too short to hold out their validation part (with the fraction each
    would need)."""

    files: list[Path]
    documents: int = 0
    blank: list[str] = field(default_factory=list)
    too_short: list[tuple[Path, float]] = field(default_factory=list)


class SplitContents(Protocol):
    """What the checks of a whole dataset read of each split (data_pipeline's merge sums it)."""

    split: str
    documents: int
    loss_mask: bool
    answer_tokens: int  # trained tokens besides each example's closing end-of-sequence id


def find_inputs(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"--input {item}: no such file or folder")
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no files found")
    return files


def _jsonl_documents(path: Path, fields: Fields, start: int = 0,
                     end: int | None = None) -> Iterator[Document]:
    """The records of the lines that begin in bytes [start, end) (a work unit's range)."""
    with path.open("rb") as handle:
        for number, (offset, line) in enumerate(lines_in_range(handle, start, end), start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}" if start == 0 else f"{path}:byte {offset}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not a JSON object ({error})") from error
            if not isinstance(record, dict):
                raise DataError(f"{where}: not a JSON object")
            if fields.messages is not None:
                if fields.messages not in record:
                    raise DataError(f"{where}: no field {fields.messages!r} (choose it with "
                                    "--messages-key)")
                yield Document(where, check_messages(where, record[fields.messages], fields.messages),
                               len(line))
                continue
            for name in fields.names:
                if not isinstance(record.get(name), str):
                    raise DataError(f"{where}: no string field {name!r} (choose it with "
                                    f"{fields.option(name)})")
            yield Document(where, fields.content([record[name] for name in fields.names]), len(line))


def _table_documents(path: Path, fields: Fields) -> Iterator[Document]:
    if fields.messages is not None:
        raise DataError(f"{path}: a {path.suffix} file holds no conversations; with --messages-key "
                        "the input must be JSONL")
    delimiter = TABLE_DELIMITERS[path.suffix.lower()]
    csv.field_size_limit(2**31 - 1)  # a cell holds a whole document (the default stops at 128 KiB)
    with path.open(newline="", encoding="utf-8") as handle:
        rows = csv.DictReader(handle, delimiter=delimiter)
        for name in fields.names:
            if name not in (rows.fieldnames or ()):
                columns = ", ".join(rows.fieldnames or ()) or "none"
                raise DataError(f"{path}: no column {name!r} in the header (columns: {columns}); "
                                f"choose it with {fields.option(name)}")
        try:
            for row in rows:
                values = [row[name] or "" for name in fields.names]
                if values[-1]:  # a row without text (or without a completion) trains nothing
                    yield Document(f"{path}:{rows.line_num}", fields.content(values),
                                   sum(len(value.encode()) for value in values))
        except csv.Error as error:
            where = f"{path}:{rows.line_num}"
            raise DataError(f"{where}: not a well-formed {path.suffix} row ({error})") from error


def _text_documents(path: Path, fields: Fields, inputs: Inputs,
                    validation_fraction: float) -> Iterator[Document]:
    """A text file as one document; with a validation fraction, its train part and its held-out end."""
    if fields.loss_mask:
        raise DataError(f"{path}: a plain text file holds no examples; with --completion-key the "
                        "input must be JSONL, CSV or TSV, with --messages-key JSONL")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}); {CONVERT_HINT}") from error
    if validation_fraction <= 0 or not text.strip():
        yield Document(str(path), text, len(data))
        return
    start = held_out_start(text, validation_fraction)
    if start is None:
        inputs.too_short.append((path, _fraction_to_hold_out_a_word(text)))
        yield Document(str(path), text, len(data), "train")
        return
    head = len(text[:start].encode())
    yield Document(str(path), text[:start], head, "train")
    yield Document(f"{path} (its end, held out for validation)", text[start:], len(data) - head,
                   "validation")


def held_out_start(text: str, fraction: float) -> int | None:
    """Where a text's validation part begins: the first paragraph boundary (else line, else word
    boundary) after which at most `fraction` of its characters are left, with text on both sides;
    None when no boundary leaves so little."""
    target = len(text) * (1 - fraction)
    for _, boundary in HOLD_OUT_BOUNDARIES:
        for match in boundary.finditer(text):
            if match.end() >= len(text):  # trailing whitespace: nothing would be held out
                break
            if match.end() >= target and text[:match.start()].strip():
                return match.end()
    return None


def _fraction_to_hold_out_a_word(text: str) -> float:
    """The smallest validation fraction that would hold out the text's last word."""
    words = list(HOLD_OUT_BOUNDARIES[-1][1].finditer(text.rstrip()))
    return 1.0 if not words else (len(text) - words[-1].end()) / len(text)


def iter_documents(files: list[Path], fields: Fields, inputs: Inputs | None = None,
                   validation_fraction: float = 0.0) -> Iterator[Document]:
    """Every document or example, in a fixed order."""
    inputs = inputs or Inputs(files)
    for path in files:
        suffix = path.suffix.lower()
        if suffix in BINARY_SUFFIXES:
            raise DataError(f"{path}: a {suffix} file is not text; {CONVERT_HINT}")
        try:
            if suffix in JSONL_SUFFIXES:
                yield from _jsonl_documents(path, fields)
            elif suffix in TABLE_DELIMITERS:
                yield from _table_documents(path, fields)
            else:
                yield from _text_documents(path, fields, inputs, validation_fraction)
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text ({error.reason}); {CONVERT_HINT}") from error


# --- worker side ---------------------------------------------------------------------------------

_TOKENIZER = None
_DTYPE = None


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _init_worker(tokenizer_path: str, dtype: str) -> None:
    global _TOKENIZER, _DTYPE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _TOKENIZER = load_tokenizer(tokenizer_path)
    _DTYPE = DTYPES[dtype]


Tokenized = tuple[np.ndarray, np.ndarray | None]  # token ids, and the loss mask of an example


def tokenize_task(task: Task) -> tuple[list[Tokenized], list[str | None], int]:
    """Token ids of each document, with the document separators added; for examples, also the
    loss mask (sft_examples.py); with the task's splits and bytes."""
    tokenizer = _TOKENIZER
    contents = [content for _, content in task.documents]
    if contents and not isinstance(contents[0], str):
        return tokenize_examples(task.documents, tokenizer, _DTYPE), task.splits, task.num_bytes
    prefix, eos = document_separators(tokenizer)
    encoded = tokenizer(contents, add_special_tokens=False)["input_ids"]
    return ([(np.asarray(prefix + ids + [eos], dtype=_DTYPE), None) for ids in encoded], task.splits,
            task.num_bytes)


# --- output side ---------------------------------------------------------------------------------

def is_validation(index: int, fraction: float) -> bool:
    """A stable per-document coin flip, the same for any number of workers."""
    return fraction > 0 and zlib.crc32(index.to_bytes(8, "little")) / 2**32 < fraction


def _progress(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)


def prepare(args: argparse.Namespace) -> dict[str, int]:
    """Prepare the dataset in work units over --workers processes (data_pipeline): the output
    appears whole at the end or not at all, and an interrupted run resumes where it stopped.
    Preference and prompt datasets are written by one process (`_prepare_examples`). With
    --host-config this is one instance of a distributed job, and --merge-only the step after its
    instances (data_pipeline/instances.py)."""
    if args.preference or args.prompts:
        return _prepare_examples(args)
    if args.host_config or args.merge_only:
        from training_jobs.data_pipeline.instances import merge_written, prepare_share

        return merge_written(args) if args.merge_only else prepare_share(args)
    from training_jobs.data_pipeline.pipeline import prepare_dataset

    return prepare_dataset(args)


def _prepare_examples(args: argparse.Namespace) -> dict[str, int]:
    """A preference (DPO) or prompts (GRPO) dataset, written by one process to a temporary folder
    beside --output and renamed at the end; a failure removes it, so nothing half-written is ever
    left (and the same command can simply be retried)."""
    inputs = Inputs(find_inputs(args.input))
    output = Path(args.output)
    _check_output(output)
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {args.tokenizer} has no end-of-sequence token")
    if args.messages_key is not None:
        require_chat_template(tokenizer)
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        if args.preference:
            from training_jobs.preference_examples import write_preference_dataset

            counts = write_preference_dataset(args, inputs.files, tokenizer, scratch, is_validation)
        else:
            from training_jobs.prompt_examples import write_prompt_dataset

            counts = write_prompt_dataset(args, inputs.files, tokenizer, scratch, is_validation)
        tokenizer.save_pretrained(str(scratch / TOKENIZER_FOLDER))
        if output.exists():
            output.rmdir()  # empty (_check_output): a folder the user made for it
        scratch.rename(output)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return counts


def _check_output(output: Path) -> None:
    if not output.exists():
        return
    if not output.is_dir():
        raise DataError(f"--output {output} is a file: name a new folder")
    if any((folder / MANIFEST).is_file() for folder in (output, *(output / s for s in SPLITS))):
        raise DataError(f"{output} already holds a dataset ({MANIFEST}); choose another --output")
    if any(output.iterdir()):
        raise DataError(f"--output {output} is not empty: name a new folder (prepare_data writes "
                        "the whole folder)")


def _check_filled(writer: SplitContents, inputs: Inputs, fraction: float) -> None:
    """Each split holds documents, and a loss-masked one an answer to train on; else say what helps."""
    if writer.documents == 0 and writer.split == "validation":
        raise DataError(_empty_validation(inputs, fraction))
    if writer.documents == 0:
        raise DataError(f"no document went to the train split: the input's {inputs.documents} "
                        f"document(s) were all drawn for validation; lower --validation-fraction "
                        f"({fraction:g}) or add data")
    if writer.loss_mask and writer.answer_tokens == 0:
        where = ", ".join(map(str, inputs.files))
        split = f" of the {writer.split} split" if fraction > 0 else ""
        raise DataError(f"no example{split} in {where} has an answer to train on: every completion is "
                        "empty, so the loss mask trains only end-of-sequence tokens; check "
                        "--completion-key (the field that holds the answers) or, with --messages-key, "
                        "the assistant messages")


def _empty_validation(inputs: Inputs, fraction: float) -> str:
    leave_out = "or leave --validation-fraction out (the run then has no evaluation loss)"
    if inputs.too_short:
        path, needed = min(inputs.too_short, key=lambda item: item[1])
        return (f"{path} is too short to hold out {fraction:.0%} of its text for validation at a "
                f"paragraph, line or word boundary (its last word alone is {needed:.0%} of it): add "
                f"text, pass --validation-fraction {_rounded_up(needed)} or more, {leave_out}")
    expected = 2 / inputs.documents if inputs.documents else 1.0
    return (f"none of the input's {inputs.documents} documents was drawn for the validation split "
            f"(each is drawn with probability {fraction:g}): add documents, pass --validation-fraction "
            f"{_rounded_up(expected)} or more, {leave_out}")


def _rounded_up(fraction: float) -> str:
    """A fraction rounded up to one significant digit, below 1."""
    for step in (0.001, 0.01, 0.1):
        if fraction <= step * 9:
            return f"{min(0.9, -(-fraction // step) * step):.3g}"
    return "0.9"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training_jobs.prepare_data",
                                     description="Tokenize text or JSONL into training shards.")
    parser.add_argument("--input", nargs="+", required=True, help="files or folders")
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer folder")
    parser.add_argument("--output", required=True, help="folder to write (must not hold a dataset)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes (default: the cores but one)")
    parser.add_argument("--text-key", default="text",
                        help="JSONL field or CSV/TSV column holding the text")
    parser.add_argument("--completion-key", default=None,
                        help="supervised fine-tuning: the field or column holding each example's "
                             "completion; the loss is then computed on completions only")
    parser.add_argument("--prompt-key", default=None,
                        help="with --completion-key: the field or column holding the prompt "
                             "(default: prompt)")
    parser.add_argument("--messages-key", default=None,
                        help="supervised fine-tuning on conversations: the JSONL field holding each "
                             "record's messages, rendered with the tokenizer's chat template; the "
                             "loss is computed on the assistant turns only")
    add_post_training_arguments(parser)
    parser.add_argument("--validation-fraction", type=float, default=0.0)
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    add_pipeline_arguments(parser)
    args = parser.parse_args(argv)
    check_pipeline_arguments(parser, args)
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    if not 0.0 <= args.validation_fraction < 1.0:
        parser.error("--validation-fraction must be in [0, 1)")
    if args.shard_tokens < 1:
        parser.error("--shard-tokens must be at least 1")
    if args.workers is None:
        args.workers = max(1, (os.cpu_count() or 2) - 1)
    if check_post_training_arguments(parser, args):  # preference pairs or prompts: checked there
        if args.dedup or args.filters:
            parser.error("--dedup and --filter are steps of text and SFT data; preference pairs and "
                         "prompts are not deduplicated or filtered: leave them out")
        return args
    if args.prompt_key is not None and args.completion_key is None:
        parser.error("--prompt-key needs --completion-key (an example is a prompt and its completion)")
    if args.text_key != "text" and (args.completion_key or args.messages_key):
        parser.error("--text-key is for plain text; examples are read from --completion-key/"
                     "--prompt-key or --messages-key")
    if args.messages_key is not None and args.completion_key is not None:
        parser.error("--messages-key and --completion-key are two formats of examples: choose one")
    if args.completion_key is not None:
        args.prompt_key = args.prompt_key or "prompt"
        if args.prompt_key == args.completion_key:
            parser.error("--prompt-key and --completion-key name the same field")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        counts = prepare(args)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for split, count in counts.items():
        print(f"{split}: {count} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
