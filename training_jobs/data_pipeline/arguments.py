"""prepare_data's options of the pipeline (kept apart from pipeline.py, which imports prepare_data)."""

from __future__ import annotations

import argparse

from training_jobs.data_pipeline.plan import DEFAULT_UNIT_BYTES
from training_jobs.data_pipeline.quality import DEDUP_METHODS, FILTER_NAMES

RESOURCE_CONFIG = "/opt/ml/config/resourceconfig.json"  # SageMaker Processing's, on every instance


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dedup", choices=DEDUP_METHODS, default=None,
                        help="remove duplicate documents across the whole input with HF's datatrove: "
                             "exact (identical text) or minhash (near duplicates)")
    parser.add_argument("--filter", action="append", choices=FILTER_NAMES, default=None, dest="filters",
                        help="a datatrove quality filter (repeatable); the documents it fails are left out")
    parser.add_argument("--unit-bytes", type=int, default=DEFAULT_UNIT_BYTES,
                        help="input bytes per work unit (default 64 MiB): large JSONL files are cut "
                             "into ranges of this size, smaller files grouped up to it")
    parser.add_argument("--host-config", nargs="?", const=RESOURCE_CONFIG, default=None, metavar="PATH",
                        help="run as one instance of a distributed job (SageMaker Processing): PATH is its "
                             f"resource config (default {RESOURCE_CONFIG}); this instance writes its share "
                             "of the work units to --output, and --merge-only makes the dataset after all")
    parser.add_argument("--state", default=None, metavar="DIR",
                        help="with --host-config: where plan.json and the units' manifests go (default: "
                             "--output)")
    parser.add_argument("--previous", default=None, metavar="DIR",
                        help="with --host-config: what earlier attempts wrote (plan.json, units/, the "
                             "shards or sizes.json); its complete units are not run again")
    parser.add_argument("--merge-only", action="store_true",
                        help="the dataset's manifests from the work units the instances wrote to --input "
                             "(one folder), written to --output")
    parser.add_argument("--shards", default=None, metavar="DIR",
                        help="with --merge-only of a preparation with --dedup: the instances' output (their "
                             "shards and .dedup/), whose units that lose documents to the deduplication "
                             "are rewritten to --output (default: --input)")


def check_pipeline_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.merge_only and args.host_config:
        parser.error("--merge-only runs after the instances (--host-config): give one of them")
    if args.shards and not args.merge_only:
        parser.error("--shards is the instances' output that --merge-only reads: it needs --merge-only")
    if (args.previous or args.state) and not args.host_config:
        parser.error("--previous and --state are for the instances of a distributed job: they need "
                     "--host-config")
    if (args.merge_only or args.host_config) and (args.preference or args.prompts):
        parser.error("preference pairs and prompts are prepared by one process: leave out --host-config "
                     "and --merge-only")
