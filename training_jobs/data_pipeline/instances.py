"""prepare_data as the instances of a distributed job (SageMaker Processing), and the merge after them.

Every instance is given every input file (the job's input replicated to each instance), makes the
same plan from their names and sizes (plan.py: the plan never depends on the number of instances),
and runs the units assigned to it: unit k to instance k mod N, N and the instance's number read from
SageMaker's resource config. It writes to --output (the job's output folder, uploaded to the
dataset's prefix) its units' shards in the split folders, and to --state (default: --output)
`plan.json` and each unit's manifest (`units/UUUUU.json`): the files a local preparation writes to its
work folder. The instances' file names never collide, so their uploads make one work folder.

`--previous DIR`: what earlier attempts left (their `plan.json`, `units/`, and either the shards or
`sizes.json`, every object's size by its key relative to the dataset's prefix, which the launcher
writes from a listing): the units complete there are not run again.

`--merge-only`: once every instance is done, one step reads that folder (again `plan.json`, `units/`
and the shards or `sizes.json`), checks every unit is complete, and writes the dataset's manifests,
`preparation.json` and the tokenizer to --output, exactly as the local merge does. Before it, the
prefix holds no manifest: nothing half-written is ever a dataset.

With --dedup, each instance writes its units' signatures and every document the filters kept (to
`.dedup/` beside its shards); the merge then finds the duplicates across all units, as the local step
does on the same signatures, and rewrites the units that lose documents (dedup_merge.py): it reads the
instances' shards and `.dedup/` from `--shards` (default: --input).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training_jobs import prepare_data
from training_jobs.contract.token_data import SPLITS, TOKENIZER_FOLDER
from training_jobs.data_pipeline.dedup_merge import deduplicate_units
from training_jobs.data_pipeline.merge import merge
from training_jobs.data_pipeline.pipeline import PLAN_FILE, WorkerPool, load_tokenizer, set_up
from training_jobs.data_pipeline.plan import Plan, WorkUnit
from training_jobs.data_pipeline.quality import QualitySettings
from training_jobs.data_pipeline.units import DEDUP_FOLDER, UnitJob, complete_manifest, file_size, run_unit
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import MANIFEST, dtype_for_vocab

SIZES_FILE = "sizes.json"


@dataclass(frozen=True)
class Host:
    """This instance's number among the job's instances."""

    index: int
    count: int

    @classmethod
    def read(cls, path: Path) -> Host:
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise DataError(f"--host-config {path}: cannot read SageMaker's resource config ({error})") \
                from error
        hosts, current = body.get("hosts"), body.get("current_host")
        if not isinstance(hosts, list) or current not in hosts:
            raise DataError(f"--host-config {path}: its current_host {current!r} is not one of its hosts "
                            f"{hosts!r}")
        return cls(hosts.index(current), len(hosts))

    def owns(self, unit: WorkUnit) -> bool:
        return unit.index % self.count == self.index


class Written:
    """A copy of a distributed preparation's work folder: plan.json, units/, and the shards
    themselves or their sizes (sizes.json)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        sizes = folder / SIZES_FILE
        self.sizes: dict[str, int] | None = json.loads(sizes.read_text()) if sizes.is_file() else None

    def plan(self) -> Plan | None:
        return Plan.read(self.folder / PLAN_FILE)

    def complete(self, job: UnitJob) -> dict | None:
        """The unit's manifest when it is complete here (its job's work folder stands for this one)."""
        manifest = job.manifest_path.relative_to(job.state or job.work)
        return complete_manifest(job, self.folder / manifest, self._size_of(job.work))

    def _size_of(self, work: Path) -> Callable[[Path], int | None]:
        if self.sizes is None:
            return lambda path: file_size(self.folder / path.relative_to(work))
        sizes = self.sizes
        return lambda path: sizes.get(path.relative_to(work).as_posix())


def prepare_share(args: argparse.Namespace) -> dict[str, int]:
    """This instance's units; returns the tokens it wrote to each split."""
    host = Host.read(Path(args.host_config))
    setup = set_up(args, versions=False)
    output = Path(args.output)
    state = Path(args.state) if args.state else output
    for folder in (output, state):
        folder.mkdir(parents=True, exist_ok=True)
    written = Written(Path(args.previous)) if args.previous else None
    if written is not None:
        _check_same_plan(written, setup.plan)
    setup.plan.write(state / PLAN_FILE)
    # The instances cannot see each other's signatures: with --dedup the merge removes the duplicates.
    mine = [setup.job(unit, output, args, state, dedup_at_merge=bool(setup.quality.dedup))
            for unit in setup.plan.units if host.owns(unit)]
    pending = [job for job in mine if written is None or written.complete(job) is None]
    print(f"prepare_data: instance {host.index + 1} of {host.count}: {len(mine)} of "
          f"{len(setup.plan.units)} work units, {len(mine) - len(pending)} complete already; "
          f"tokenizing {len(pending)}", file=sys.stderr)
    tokens: Counter = Counter()
    pool = WorkerPool(max(1, min(args.workers, len(pending))), str(args.tokenizer), setup.dtype)
    pool.map(run_unit, pending, lambda job, manifest: tokens.update(
        {split: body["tokens"] for split, body in manifest["splits"].items()}))
    return dict(tokens)


def _check_same_plan(written: Written, plan: Plan) -> None:
    previous = written.plan()
    if previous is not None and previous.fingerprint != plan.fingerprint:
        raise DataError(f"--previous {written.folder} holds the work units of another plan (the input files "
                        "or the options changed since): rerun with the same inputs and options, or "
                        "prepare a dataset of another name")


def merge_written(args: argparse.Namespace) -> dict[str, int]:
    """The dataset's manifests from every instance's units; returns the tokens of each split."""
    if len(args.input) != 1:
        raise DataError("--merge-only reads one --input: the folder the instances' outputs make")
    written = Written(Path(args.input[0]))
    plan = written.plan()
    if plan is None:
        raise DataError(f"--input {written.folder}: no {PLAN_FILE}, so not the output of the instances of "
                        "a distributed preparation (prepare_data --host-config)")
    output = Path(args.output)
    _check_no_dataset(output)
    settings = plan.settings
    tokenizer = load_tokenizer(args.tokenizer)
    if (len(tokenizer), tokenizer.eos_token_id) != (settings["vocab_size"], settings["eos_token_id"]):
        raise DataError(f"--tokenizer {args.tokenizer}: not the tokenizer the units were tokenized with "
                        f"({settings['tokenizer']}: {settings['vocab_size']} tokens, end-of-sequence id "
                        f"{settings['eos_token_id']}); give that one")
    fields = prepare_data.Fields(**settings["fields"])
    quality = QualitySettings(tuple(settings["quality"]["filters"]), settings["quality"]["dedup"])
    shards = _shards_folder(args) if quality.dedup else None
    dtype = dtype_for_vocab(settings["vocab_size"])
    jobs = [UnitJob(unit, tuple(plan.paths(unit)), output, fields, settings["validation_fraction"],
                    settings["shard_tokens"], dtype, quality) for unit in plan.units]
    manifests = _complete_manifests(written, jobs)
    folders = jobs[0].split_folders
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    if shards is not None:
        with tempfile.TemporaryDirectory(prefix=".dedup-", dir=output.parent) as scratch:
            manifests = deduplicate_units(jobs, manifests, shards, Path(scratch))
    counts = merge(plan, manifests, output, folders, dtype=dtype, tokenizer=tokenizer,
                   tokenizer_name=settings["tokenizer"], loss_mask=fields.loss_mask,
                   validation_fraction=settings["validation_fraction"])
    tokenizer.save_pretrained(str(output / TOKENIZER_FOLDER))
    return counts


def _shards_folder(args: argparse.Namespace) -> Path:
    """Where a deduplicating merge reads the instances' shards and signatures."""
    shards = Path(args.shards or args.input[0])
    if not (shards / DEDUP_FOLDER).is_dir():
        raise DataError(f"--shards {shards}: no {DEDUP_FOLDER}/ there; the merge of a preparation with "
                        f"--dedup reads the instances' output (their shards and {DEDUP_FOLDER}/): give "
                        "that folder as --shards")
    return shards


def _complete_manifests(written: Written, jobs: list[UnitJob]) -> list[dict]:
    manifests = [written.complete(job) for job in jobs]
    missing = [job.unit.index for job, manifest in zip(jobs, manifests, strict=True) if manifest is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise DataError(f"{len(missing)} of {len(jobs)} work units are not complete in {written.folder} "
                        f"(units {shown}): run the preparation again, which redoes only these, then merge")
    return manifests


def _check_no_dataset(output: Path) -> None:
    if any((folder / MANIFEST).is_file() for folder in (output, *(output / s for s in SPLITS))):
        raise DataError(f"--output {output} already holds a dataset ({MANIFEST}): it was merged already, "
                        "or choose another --output")
