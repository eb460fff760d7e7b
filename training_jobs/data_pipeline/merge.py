"""The one step after every unit: the units' manifests merged into the dataset's.

Each split's manifest.json lists every unit's shards in unit order (each with its SHA-256), so the
token stream of the dataset is the units' streams back to back, whatever worker wrote which unit.
`preparation.json` beside the splits records the plan's fingerprint, the units, the documents and
tokens of each split and what each quality step removed. The checks prepare_data makes of a whole
dataset (no text at all, an empty split, examples without answers) run here, on the totals.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from training_jobs import prepare_data
from training_jobs.data_pipeline.plan import Plan, write_json_atomically
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import write_manifest

REPORT = "preparation.json"


@dataclass
class SplitTotals:
    """A split's totals across units (what prepare_data's checks read of a shard writer)."""

    split: str
    loss_mask: bool
    documents: int = 0
    answer_tokens: int = 0


def merge(plan: Plan, manifests: list[dict], root: Path, folders: dict[str, Path], *, dtype: str, tokenizer,
          tokenizer_name: str, loss_mask: bool, validation_fraction: float) -> dict[str, int]:
    """Write each split's manifest and the preparation report; returns the tokens of each split."""
    totals = {split: SplitTotals(split, loss_mask) for split in folders}
    shards: dict[str, list[dict]] = {split: [] for split in folders}
    removed: dict[str, Counter] = {}
    blank, blank_example, read = 0, None, 0
    too_short = []
    for manifest in manifests:
        read += manifest["documents_read"]
        blank += manifest["blank"]
        blank_example = blank_example or manifest["blank_example"]
        too_short += [(Path(path), needed) for path, needed in manifest["too_short"]]
        for step, counts in manifest["removed"].items():
            removed.setdefault(step, Counter()).update(counts)
        for split, body in manifest["splits"].items():
            totals[split].documents += body["documents"]
            totals[split].answer_tokens += body["answer_tokens"]
            shards[split] += body["shards"]
    for step, c in removed.items():
        print(f"prepare_data: {step} removed {c['documents']} document(s) ({c['tokens']} tokens)",
              file=sys.stderr)
    kept = sum(t.documents for t in totals.values())
    inputs = prepare_data.Inputs([Path(f.path) for f in plan.files], documents=kept,
                                 too_short=too_short)
    _check_text(inputs, blank, blank_example, read)
    for split_totals in totals.values():
        prepare_data._check_filled(split_totals, inputs, validation_fraction)
    counts = {}
    for split, folder in folders.items():
        entries = shards[split]
        write_manifest(folder, dtype=dtype, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       num_documents=totals[split].documents,
                       shards=[(e["path"], e["num_tokens"]) for e in entries], tokenizer=tokenizer_name,
                       loss_mask=loss_mask, checksums=_checksums(entries),
                       answer_tokens=totals[split].answer_tokens)
        counts[split] = sum(e["num_tokens"] for e in entries)
    report = {"plan": plan.fingerprint, "units": len(plan.units), "input_bytes": plan.num_bytes,
              "documents_read": read, "blank_documents": blank,
              "steps": [{"step": step, "removed_documents": c["documents"], "removed_tokens": c["tokens"]}
                        for step, c in removed.items()],
              "splits": {split: {"documents": totals[split].documents, "tokens": counts[split],
                                 "shards": len(shards[split])} for split in folders}}
    write_json_atomically(root / REPORT, report)
    return counts


def _checksums(entries: list[dict]) -> dict[str, str]:
    sums = {e["path"]: e["sha256"] for e in entries}
    sums.update({e["mask"]: e["mask_sha256"] for e in entries if "mask" in e})
    return sums


def _check_text(inputs: prepare_data.Inputs, blank: int, example: str | None, read: int) -> None:
    """prepare_data's check that there is text to train on, on the units' totals."""
    files = ", ".join(map(str, inputs.files))
    if read == 0:
        what = f"{blank} empty document(s), e.g. {example}" if blank else "no documents"
        raise DataError(f"no text to train on in {files}: the input holds {what}; check the file, or "
                        "--text-key if the text is in another field")
    if inputs.documents == 0:
        raise DataError(f"no document of {files} is left after the quality steps (see what each "
                        "removed above): loosen --filter or --dedup, or add data")
    if blank:
        print(f"prepare_data: left out {blank} empty document(s), e.g. {example}", file=sys.stderr)
