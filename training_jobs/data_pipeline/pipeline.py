"""prepare_data's steps in order, in N worker processes, resumable.

1. Checks before any work: the inputs (formats, UTF-8, not all empty), the output (no dataset
   there), the tokenizer (it loads).
2. The plan (plan.py), written to the work folder `.OUTPUT.partial` beside the output.
3. With --dedup: every unit's signatures (workers), then the duplicates across all units (one step).
4. Every unit's shards and manifest (workers; units.py).
5. The merge (merge.py) and the tokenizer, then the work folder is renamed to the output: nothing
   half-written is ever a dataset.

A preparation that stops (a killed worker, Ctrl-C, a lost machine) leaves the work folder; the same
command resumes it and redoes only the units that are not complete (and the signatures not written).
Bad input (a DataError) removes it: there is nothing to resume.
"""

from __future__ import annotations

import argparse
import codecs
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

from training_jobs import prepare_data
from training_jobs.contract.token_data import TOKENIZER_FOLDER
from training_jobs.data_pipeline.merge import merge
from training_jobs.data_pipeline.plan import Plan, WorkUnit, local_inputs, make_plan
from training_jobs.data_pipeline.quality import (
    DUPLICATES,
    REMOVALS,
    QualitySettings,
    find_duplicates,
)
from training_jobs.data_pipeline.units import SIGNED_FOLDER, UnitJob, complete_manifest, run_unit, sign_unit
from training_jobs.sft_examples import require_chat_template
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import dtype_for_vocab

PLAN_FILE = "plan.json"
FOUND_MARKER = "duplicates-found"
UTF8_CHECK_BYTES = 1 << 16
WORKER_PRELOAD = ("numpy", "transformers.models.auto.tokenization_auto")
START_METHOD_VARIABLE = "PREPARE_DATA_START_METHOD"  # "spawn": each worker imports everything itself


@dataclass(frozen=True)
class Setup:
    """What every way of running the pipeline decides first: the checked inputs' plan, the
    tokenizer, and the options that shape each unit."""

    plan: Plan
    tokenizer: Any
    fields: prepare_data.Fields
    quality: QualitySettings
    dtype: str

    def job(self, unit: WorkUnit, work: Path, args: argparse.Namespace, state: Path | None = None,
            dedup_at_merge: bool = False) -> UnitJob:
        return UnitJob(unit, tuple(self.plan.paths(unit)), work, self.fields, args.validation_fraction,
                       args.shard_tokens, self.dtype, self.quality, state, dedup_at_merge)


def set_up(args: argparse.Namespace, versions: bool = True) -> Setup:
    """The checks before any work and the plan. `versions`: whether a file's modification time is
    part of the plan (not for the instances of a distributed job, whose copies of the input files
    each have their own)."""
    files = prepare_data.find_inputs(args.input)
    check_inputs(files)
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {args.tokenizer} has no end-of-sequence token")
    if args.messages_key is not None:
        require_chat_template(tokenizer)
    if args.unit_bytes < 1:
        raise DataError(f"--unit-bytes {args.unit_bytes}: a work unit reads at least 1 byte")
    fields = prepare_data.Fields(args.text_key, args.prompt_key, args.completion_key, args.messages_key)
    quality = QualitySettings(tuple(args.filters or ()), args.dedup)
    dtype = dtype_for_vocab(len(tokenizer))
    settings = {"fields": asdict(fields), "validation_fraction": args.validation_fraction,
                "shard_tokens": args.shard_tokens, "unit_bytes": args.unit_bytes,
                "quality": asdict(quality), "tokenizer": str(args.tokenizer),
                "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    inputs = local_inputs(files)
    if not versions:
        inputs = tuple(replace(item, version="") for item in inputs)
    return Setup(make_plan(inputs, settings, args.unit_bytes), tokenizer, fields, quality, dtype)


def prepare_dataset(args: argparse.Namespace) -> dict[str, int]:
    """Prepare the dataset; returns the tokens of each split."""
    output = Path(args.output)
    prepare_data._check_output(output)
    setup = set_up(args)
    plan, tokenizer = setup.plan, setup.tokenizer
    work = output.parent / f".{output.name}.partial"
    output.parent.mkdir(parents=True, exist_ok=True)
    _open_work(work, plan)
    jobs = [setup.job(unit, work, args) for unit in plan.units]
    pool = WorkerPool(_worker_count(args.workers, len(jobs)), str(args.tokenizer), setup.dtype)
    try:
        return _run(plan, jobs, pool, tokenizer, args, output)
    except BrokenProcessPool as error:
        done = sum(complete_manifest(job) is not None for job in jobs)
        raise DataError(f"a worker process died (killed, or out of memory) with {done} of {len(jobs)} "
                        f"work units complete in {work}: run the same command again to redo only the "
                        "rest") from error
    except KeyboardInterrupt:
        print(f"prepare_data: interrupted; run the same command again to resume from {work}",
              file=sys.stderr)
        raise


def _run(plan: Plan, jobs: list[UnitJob], pool: WorkerPool, tokenizer, args: argparse.Namespace,
         output: Path) -> dict[str, int]:
    """The steps after the plan, in the work folder; bad input (a DataError) removes it."""
    work, quality = jobs[0].work, jobs[0].quality
    try:
        if quality.dedup:
            _deduplicate(jobs, pool, work, quality.dedup)
        manifests = _tokenize(jobs, pool)
        counts = merge(plan, manifests, work, jobs[0].split_folders, dtype=jobs[0].dtype, tokenizer=tokenizer,
                       tokenizer_name=str(args.tokenizer), loss_mask=jobs[0].fields.loss_mask,
                       validation_fraction=args.validation_fraction)
        tokenizer.save_pretrained(str(work / TOKENIZER_FOLDER))
        _publish(work, output)
    except DataError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return counts


def check_inputs(files: list[Path]) -> None:
    """What would fail the preparation, found before any work: a binary format, text that is not
    UTF-8 (in its first 64 KiB; the rest is checked as it is read), input that is all empty."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in prepare_data.BINARY_SUFFIXES:
            raise DataError(f"{path}: a {suffix} file is not text; {prepare_data.CONVERT_HINT}")
        with path.open("rb") as handle:
            head = handle.read(UTF8_CHECK_BYTES)
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text (byte {error.start}); {prepare_data.CONVERT_HINT}") \
                from error
    if all(path.stat().st_size == 0 for path in files):
        raise DataError(f"no text to train on in {', '.join(map(str, files))}: every input file is "
                        "empty")


def load_tokenizer(path: str):
    if not Path(path).is_dir():
        raise DataError(f"--tokenizer {path}: no such folder (give the folder of an HF tokenizer: "
                        "tokenizer.json, tokenizer_config.json)")
    try:
        return prepare_data.load_tokenizer(path)
    except Exception as error:  # transformers raises many kinds for a folder it cannot read
        reason = " ".join(str(error).split())[:300]
        raise DataError(f"--tokenizer {path}: not a tokenizer folder transformers can load "
                        f"({type(error).__name__}: {reason}); give the folder of an HF tokenizer "
                        "(tokenizer.json, tokenizer_config.json)") from error


def _worker_count(requested: int, units: int) -> int:
    if requested > units:
        print(f"prepare_data: {units} work unit(s), so {units} worker(s) instead of --workers "
              f"{requested} (smaller units: --unit-bytes)", file=sys.stderr)
    return max(1, min(requested, units))


def _open_work(work: Path, plan: Plan) -> None:
    """The work folder of this plan: resumed when it holds the same plan, else made anew."""
    plan_path = work / PLAN_FILE
    if work.exists():
        previous = Plan.read(plan_path)
        if previous is not None and previous.fingerprint == plan.fingerprint:
            print(f"prepare_data: resuming the interrupted preparation in {work}", file=sys.stderr)
            return
        print(f"prepare_data: {work} holds an interrupted preparation of other inputs or options; "
              "starting anew", file=sys.stderr)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    plan.write(plan_path)


class WorkerPool:
    """Runs a function over jobs in N spawned processes (each loads the tokenizer once), or here
    with one worker; a worker that dies fails the call with BrokenProcessPool."""

    def __init__(self, workers: int, tokenizer: str, dtype: str) -> None:
        self.workers, self.tokenizer, self.dtype = workers, tokenizer, dtype

    def map(self, function: Callable[[UnitJob], Any], jobs: list[UnitJob],
            on_done: Callable[[UnitJob, Any], None]) -> None:
        if not jobs:
            return
        if self.workers == 1:
            prepare_data._init_worker(self.tokenizer, self.dtype)
            for job in jobs:
                on_done(job, function(job))
            return
        pool = ProcessPoolExecutor(self.workers, mp_context=_worker_context(),
                                   initializer=prepare_data._init_worker,
                                   initargs=(self.tokenizer, self.dtype))
        try:
            futures = {pool.submit(function, job): job for job in jobs}
            for future in as_completed(futures):
                on_done(futures[future], future.result())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _worker_context():
    """Workers forked from a server process that has imported transformers (and torch, which it
    imports) once, where the platform has one: N workers then start in a fraction of a second each
    instead of importing them N times. Never forked from this process, which may hold threads."""
    if os.environ.get(START_METHOD_VARIABLE) == "spawn" or "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    context = get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def _deduplicate(jobs: list[UnitJob], pool: WorkerPool, work: Path, method: str) -> None:
    """Signatures of the units that lack them, then (unless done) the duplicates across all units."""
    unsigned = [job for job in jobs if not (work / SIGNED_FOLDER / job.unit.name).exists()]
    found = work / FOUND_MARKER
    if unsigned:
        found.unlink(missing_ok=True)
        pool.map(sign_unit, unsigned, lambda job, result: None)
    if not found.exists():
        for folder in (DUPLICATES, REMOVALS):
            shutil.rmtree(work / folder, ignore_errors=True)
        (work / REMOVALS).mkdir()
        find_duplicates(method, work)
        found.touch()


def _tokenize(jobs: list[UnitJob], pool: WorkerPool) -> list[dict]:
    manifests: dict[int, dict] = {}
    for job in jobs:
        manifest = complete_manifest(job)
        if manifest is not None:
            manifests[job.unit.index] = manifest
    pending = [job for job in jobs if job.unit.index not in manifests]
    if manifests:
        print(f"prepare_data: {len(manifests)} of {len(jobs)} work units already complete; "
              f"tokenizing the other {len(pending)}", file=sys.stderr)
    with prepare_data._progress(sum(job.unit.num_bytes for job in pending)) as bar:
        def done(job: UnitJob, manifest: dict) -> None:
            manifests[job.unit.index] = manifest
            bar.update(job.unit.num_bytes)

        pool.map(run_unit, pending, done)
    return [manifests[job.unit.index] for job in jobs]


def _publish(work: Path, output: Path) -> None:
    """Remove the work files and rename the folder to the output."""
    from training_jobs.data_pipeline.quality import SIGNATURES
    from training_jobs.data_pipeline.units import UNITS_FOLDER

    for name in (UNITS_FOLDER, SIGNED_FOLDER, SIGNATURES, DUPLICATES, REMOVALS):
        shutil.rmtree(work / name, ignore_errors=True)
    for name in (PLAN_FILE, FOUND_MARKER):
        (work / name).unlink(missing_ok=True)
    if output.exists():
        output.rmdir()  # empty (prepare_data._check_output): a folder the user made for it
    work.rename(output)
