"""A cloud data preparation's steps that read or write S3 (and list SageMaker's processing jobs): the
functions of a team's preparation state machine (`llmtrain.handlers.preparation`) run them with the
launcher's role, and the CLI reads the same state with the engineer's (`llmtrain.client.preparations`).

- Validate: the execution input (`llmtrain.core.preparation.PreparationInput`) checked again, as the
  CLI checked it (`check_preparation`: the team's prefix, instance types and count, options), the
  template in the launcher's registry and allowed to the team, the input listed here (its files and
  size: the volume and the estimate come from this listing, not from the client), the dataset's
  prefix (a dataset there is refused, an earlier attempt's state makes this a rerun), no preparation
  of the dataset in progress, the program's code in place, the estimate within the team's budget;
  then both CreateProcessingJob requests. Bad input ends here, before any job.
- `sizes.json`: every object of the dataset's prefix by relative key (the state and the code left
  out), written before a rerun's shards job and before the merge, which check the units' shards
  against it.
- The marker `llmtrain-dataset.json`, last, once the merge wrote the manifests: only then does
  `llmtrain data ls` list the folder as a dataset. Before it, the files the dataset does not use are
  removed (`remove_unused_files`: the shards a deduplicating merge replaced, `.dedup/`, upload
  temporaries), so the marker lists what is there; the summary gives each quality step's removals
  (the merge's `preparation.json`).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmtrain.core.catalog import Catalog
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import (
    CODE_FOLDER,
    DATASET_MANIFEST,
    DEDUP_FOLDER,
    SHARD_PREFIX,
    SIZES_FILE,
    STATE_FOLDER,
    Preparation,
    PreparationError,
    PreparationInput,
    check_preparation,
    input_files_problem,
    job_name_stem,
    merge_request,
    shards_request,
)
from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.planner import prices
from llmtrain.planner.preparation_cost import check_budget, estimate
from training_jobs.contract.token_data import MANIFEST, SPLITS

PLAN_FILE = "plan.json"
REPORT_FILE = "preparation.json"  # the merge's report: the plan, each split's totals, each step's removals
DELETE_BATCH = 1000  # S3 DeleteObjects' most keys per call
ACTIVE_JOB_STATES = ("InProgress", "Stopping")


@dataclass(frozen=True)
class InputFile:
    key: str
    size: int


def objects(s3, bucket: str, prefix: str) -> Iterable[Mapping[str, Any]]:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def input_files(s3, uri: str) -> list[InputFile]:
    """The files the instances will read, as prepare_data finds them (hidden names left out)."""
    location = parse_s3_uri(uri)
    prefix = location.key if location.key.endswith("/") or not location.key else f"{location.key}/"
    return [
        InputFile(o["Key"], o["Size"])
        for o in objects(s3, location.bucket, prefix)
        if not o["Key"].endswith("/")
        and not any(part.startswith(".") for part in o["Key"][len(prefix) :].split("/"))
    ]


def output_is_rerun(s3, preparation: Preparation, platform: PlatformContext) -> bool:
    """Whether the dataset's prefix holds an earlier attempt of this preparation (resumed); refused
    when it holds a dataset or other files."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.dataset_uri(platform)).key
    keys = {o["Key"][len(prefix) :] for o in objects(s3, bucket, prefix)}
    datasets = {DATASET_MANIFEST, MANIFEST, *(f"{split}/{MANIFEST}" for split in SPLITS)}
    if keys & datasets:
        raise PreparationError(
            f"{preparation.dataset_uri(platform)} already holds a dataset "
            f"({', '.join(sorted(keys & datasets))}): choose another --name"
        )
    if f"{STATE_FOLDER}/{PLAN_FILE}" in keys:
        return True
    others = sorted(key for key in keys if not key.startswith((f"{STATE_FOLDER}/", f"{CODE_FOLDER}/")))
    if others:
        raise PreparationError(
            f"{preparation.dataset_uri(platform)} holds {len(others)} file(s) (e.g. "
            f"{others[0]}) but no preparation: choose another --name"
        )
    return False


def write_sizes(s3, preparation: Preparation, platform: PlatformContext) -> dict[str, int]:
    """`sizes.json` in the state folder (the module says what reads it)."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.dataset_uri(platform)).key
    sizes = {
        o["Key"][len(prefix) :]: o["Size"]
        for o in objects(s3, bucket, prefix)
        if not o["Key"][len(prefix) :].startswith((f"{STATE_FOLDER}/", f"{CODE_FOLDER}/"))
    }
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}{STATE_FOLDER}/{SIZES_FILE}",
        Body=json.dumps(sizes, sort_keys=True).encode(),
        ContentType="application/json",
    )
    return sizes


def write_marker(s3, preparation: Preparation, platform: PlatformContext) -> dict[str, Any]:
    """`llmtrain-dataset.json`, last, once the merge wrote the manifests: the dataset is complete. The
    files it does not use are removed first (`remove_unused_files`), so the marker lists what is there."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.dataset_uri(platform)).key
    sizes = {o["Key"][len(prefix) :]: o["Size"] for o in objects(s3, bucket, prefix)}
    if not set(sizes) & {MANIFEST, *(f"{s}/{MANIFEST}" for s in SPLITS)}:
        raise PreparationError(
            f"{preparation.dataset_uri(platform)} has no {MANIFEST}: the merge job has not "
            "written the dataset"
        )
    removed = remove_unused_files(s3, bucket, prefix, sizes)
    files = [
        {"path": path, "size": size}
        for path, size in sizes.items()
        if path != DATASET_MANIFEST and path not in removed
    ]
    marker = {
        "format": 1,
        "name": preparation.name,
        "team": platform.team,
        "uploaded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "uploaded_by": preparation.owner,
        "prepared_by": "llmtrain data prepare --cloud",
        "bytes": sum(f["size"] for f in files),
        "files": files,
    }
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}{DATASET_MANIFEST}",
        Body=json.dumps(marker, indent=2).encode(),
        ContentType="application/json",
    )
    return marker


def remove_unused_files(s3, bucket: str, prefix: str, sizes: Mapping[str, int]) -> set[str]:
    """The preparation's files under the dataset's prefix that the finished dataset does not use: the
    shard files no split manifest lists (the instances' shards that a deduplicating merge rewrote, and
    temporaries the Continuous upload caught) and `.dedup/` (the signatures, used). The prefix held no
    other files when the preparation started (output_is_rerun), so none of them is anyone else's.
    Returns their keys relative to the prefix."""
    listed: set[str] = set()
    for folder in ("", *(f"{split}/" for split in SPLITS)):
        if f"{folder}{MANIFEST}" in sizes:
            names = _listed_files(s3, bucket, f"{prefix}{folder}{MANIFEST}")
            listed.update(f"{folder}{name}" for name in names)
    unused = sorted(
        path
        for path in sizes
        if path.startswith(f"{DEDUP_FOLDER}/") or (_is_shard_file(path) and path not in listed)
    )
    for start in range(0, len(unused), DELETE_BATCH):
        batch = unused[start : start + DELETE_BATCH]
        answer = s3.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": prefix + path} for path in batch], "Quiet": True}
        )
        if answer.get("Errors"):
            error = answer["Errors"][0]
            raise PreparationError(f"could not remove s3://{bucket}/{error['Key']}: {error.get('Message')}")
    return set(unused)


def _listed_files(s3, bucket: str, key: str) -> set[str]:
    """The shard and mask files a split's manifest lists; a manifest that lists none is refused before
    anything is removed."""
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    try:
        entries = json.loads(body)["shards"]
        return {entry[name] for entry in entries for name in ("path", "mask") if name in entry}
    except (ValueError, KeyError, TypeError) as error:
        raise PreparationError(
            f"s3://{bucket}/{key} is not the manifest of a dataset ({type(error).__name__}: {error}); "
            "nothing was removed and the dataset is not marked complete"
        ) from error


def _is_shard_file(path: str) -> bool:
    folder, _, name = path.rpartition("/")
    return folder in ("", *SPLITS) and name.startswith(SHARD_PREFIX)


def step_removals(s3, platform: PlatformContext, name: str) -> list[dict[str, Any]] | None:
    """What each quality step removed, from the merge's report (`preparation.json`); None before the
    merge wrote it."""
    key = f"{parse_s3_uri(platform.datasets_uri).key}{name}/{REPORT_FILE}"
    try:
        report = json.loads(s3.get_object(Bucket=platform.datasets_bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None
    return report.get("steps", [])


def removal_line(step: str, documents: int, tokens: int) -> str:
    """A step's removals, as prepare_data prints them locally."""
    return f"{step} removed {documents:,} document(s) ({tokens:,} tokens)"


def is_complete(s3, platform: PlatformContext, name: str) -> bool:
    key = f"{parse_s3_uri(platform.datasets_uri).key}{name}/{DATASET_MANIFEST}"
    return s3.list_objects_v2(Bucket=platform.datasets_bucket, Prefix=key, MaxKeys=1).get("KeyCount", 0) > 0


def progress(s3, preparation: Preparation, platform: PlatformContext) -> dict[str, Any]:
    """Units done of the plan's units, the tokens they wrote and what the units' quality steps removed
    (the filters': a distributed job's deduplication is its merge's), from the state folder."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.state_uri(platform)).key
    try:
        plan = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}{PLAN_FILE}")["Body"].read())
    except s3.exceptions.NoSuchKey:
        return {"units": None, "units_done": 0, "tokens": 0, "removed": {}, "dedup": None}
    tokens = 0
    removed: dict[str, Counter] = {}
    keys = [o["Key"] for o in objects(s3, bucket, f"{prefix}units/")]
    for key in keys:
        manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        tokens += sum(body["tokens"] for body in manifest["splits"].values())
        for step, counts in manifest.get("removed", {}).items():
            removed.setdefault(step, Counter()).update(counts)
    return {
        "units": len(plan["units"]),
        "units_done": len(keys),
        "tokens": tokens,
        "removed": removed,
        "dedup": plan.get("settings", {}).get("quality", {}).get("dedup"),
    }


def active_jobs(sagemaker, platform: PlatformContext, name: str) -> list[str]:
    """The dataset's preparation jobs that are still running."""
    stem = job_name_stem(platform, name)
    found = []
    for status in ACTIVE_JOB_STATES:
        pages = sagemaker.get_paginator("list_processing_jobs").paginate(
            NameContains=stem, StatusEquals=status
        )
        found += [
            job["ProcessingJobName"]
            for page in pages
            for job in page["ProcessingJobSummaries"]
            if job["ProcessingJobName"].startswith(f"{stem}-")
        ]
    return found


def job_cost(job: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """A processing job's (seconds, US dollars) once it ran: duration x instances x on-demand price."""
    cluster = (job.get("ProcessingResources") or {}).get("ClusterConfig") or {}
    start, end = (_time(job.get(key)) for key in ("ProcessingStartTime", "ProcessingEndTime"))
    if start is None or end is None or not cluster:
        return None, None
    seconds = (end - start).total_seconds()
    try:
        price = prices.load().on_demand(cluster["InstanceType"])
    except prices.PriceError:
        return seconds, None
    return seconds, seconds / 3600 * cluster["InstanceCount"] * price


def _time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):  # Step Functions passes DescribeProcessingJob's times as ISO text
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return None


# -- the state machine's steps ------------------------------------------------------------------------


def validate_preparation(
    data: object, *, platform: PlatformContext, catalog: Catalog, sagemaker, s3
) -> dict[str, Any]:
    """The execution's state for the jobs (`preparation`, `template`, `rerun`, `shards`, `merge`:
    the two CreateProcessingJob requests); PreparationError (or the planner's PlanRefused, the
    catalog's errors) naming what to fix when the preparation must not start."""
    given = PreparationInput.from_dict(data)
    template = catalog.resolve(given.template)
    if platform.allowed_templates and template.name not in platform.allowed_templates:
        raise PreparationError(f"--template {template.name} is not allowed for team {platform.team!r}")
    draft = given.preparation
    check_preparation(draft, platform)
    files = input_files(s3, draft.input_uri)
    problem = input_files_problem(len(files), draft.instance_count, draft.input_uri)
    if problem:
        raise PreparationError(problem)
    preparation = dataclasses.replace(
        draft, input_bytes=sum(f.size for f in files), rerun=output_is_rerun(s3, draft, platform)
    )
    running = active_jobs(sagemaker, platform, preparation.name)
    if running:
        raise PreparationError(
            f"job {running[0]} of this preparation is still running: follow it with `llmtrain data status "
            f"{preparation.name}`, or stop it first"
        )
    code = parse_s3_uri(preparation.code_uri(platform))
    if not s3.list_objects_v2(Bucket=code.bucket, Prefix=code.key, MaxKeys=1).get("KeyCount", 0):
        raise PreparationError(
            f"{preparation.code_uri(platform)} is missing: `llmtrain data prepare --cloud` uploads the "
            "program's code before it starts the preparation"
        )
    check_budget(
        estimate(preparation.input_bytes, preparation.instance_type, preparation.instance_count),
        platform.run_budget_usd,
        platform.team,
    )
    return {
        "preparation": preparation.to_dict(),
        "template": template.ref,
        "rerun": preparation.rerun,
        "shards": shards_request(preparation, platform, template),
        "merge": merge_request(preparation, platform, template),
    }


def completed_summary(
    preparation: Preparation, platform: PlatformContext, jobs: Iterable[Mapping[str, Any]], s3
) -> dict[str, Any]:
    """The marker written (the unused files removed first), and the summary of the complete dataset
    (the execution's output): with each quality step's removals, as the merge's report gives them."""
    marker = write_marker(s3, preparation, platform)
    removals = [
        {"step": s["step"], "documents": s["removed_documents"], "tokens": s["removed_tokens"]}
        for s in step_removals(s3, platform, preparation.name) or []
    ]
    lines = "".join(f"\n{removal_line(r['step'], r['documents'], r['tokens'])}" for r in removals)
    costs = [job_cost(job)[1] for job in jobs]
    usd = sum(c for c in costs if c is not None) if any(c is not None for c in costs) else None
    uri = preparation.dataset_uri(platform)
    cost = "-" if usd is None else f"${usd:,.2f}"
    return {
        "status": "Completed",
        "dataset": preparation.name,
        "dataset_uri": uri,
        "bytes": marker["bytes"],
        "cost_usd": usd,
        "removed": removals,
        "subject": _subject(preparation.name, "Completed"),
        "message": f"Dataset {preparation.name}: Completed\nDataset: {uri}{lines}\nCost: {cost} (the jobs' "
        f"duration x instances x on-demand price)\nUse it with --set channels.train={uri}train/",
    }


def failed_summary(preparation: Mapping[str, Any], stage: str, failure: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of a preparation whose shards or merge job failed, was stopped, or was not created:
    no marker is written, so nothing half-written is listed as a dataset; the same command resumes."""
    name = str(preparation.get("name", "?"))
    error, cause = str(failure.get("Error") or "States.TaskFailed"), str(failure.get("Cause") or "")
    try:
        described = json.loads(cause)
    except ValueError:
        described = None
    if isinstance(described, Mapping) and "ProcessingJobStatus" in described:
        reason = described.get("FailureReason") or described.get("ExitMessage") or "no reason given"
        job, status = described.get("ProcessingJobName"), described["ProcessingJobStatus"]
        what = f"processing job {job} ended {status} ({reason})"
    else:
        what = f"the {stage} job was not created or followed: {error}: {cause}"
    retry = (
        "run the same command again: it redoes only the work units whose shards are missing"
        if stage == "shard"
        else "run the same command again: the shards are kept and only the merge runs"
    )
    return {
        "status": "Failed",
        "dataset": name,
        "error": "PreparationJobFailed",
        "subject": _subject(name, "Failed"),
        "message": f"Dataset {name}: Failed\n{what}; {retry}",
    }


def rejection_summary(refusal: Exception, data: object, execution_name: str | None) -> dict[str, Any]:
    """The summary of a preparation refused before any job; the execution fails with its error."""
    raw = data.get("preparation") if isinstance(data, Mapping) else None
    name = raw.get("name") if isinstance(raw, Mapping) and isinstance(raw.get("name"), str) else None
    name = name or str(execution_name or "?")
    error = type(refusal).__name__
    return {
        "status": "Rejected",
        "dataset": name,
        "error": error,
        "subject": _subject(name, "Rejected"),
        "message": f"Dataset {name}: Rejected before any job\nError: {error}: {refusal}",
    }


def _subject(name: str, status: str) -> str:
    """An SNS subject: printable ASCII, at most 100 characters."""
    outcome = f" {status}"
    room = 100 - len("llmtrain: dataset ") - len(outcome)
    shown = "".join(c if " " <= c <= "~" else "?" for c in name)
    if len(shown) > room:
        shown = shown[: room - 3] + "..."
    return f"llmtrain: dataset {shown}{outcome}"
