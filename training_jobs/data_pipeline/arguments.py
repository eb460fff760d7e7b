"""prepare_data's options of the pipeline (kept apart from pipeline.py, which imports prepare_data)."""

from __future__ import annotations

import argparse

from training_jobs.data_pipeline.plan import DEFAULT_UNIT_BYTES
from training_jobs.data_pipeline.quality import DEDUP_METHODS, FILTER_NAMES


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dedup", choices=DEDUP_METHODS, default=None,
                        help="remove duplicate documents across the whole input with HF's datatrove: "
                             "exact (identical text) or minhash (near duplicates)")
    parser.add_argument("--filter", action="append", choices=FILTER_NAMES, default=None, dest="filters",
                        help="a datatrove quality filter (repeatable); the documents it fails are left out")
    parser.add_argument("--unit-bytes", type=int, default=DEFAULT_UNIT_BYTES,
                        help="input bytes per work unit (default 64 MiB): large JSONL files are cut "
                             "into ranges of this size, smaller files grouped up to it")
