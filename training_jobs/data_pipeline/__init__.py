"""prepare_data's pipeline: a plan of work units, N workers, quality steps, and one merge.

    plan.py      the inputs cut into work units (whole files, or byte ranges of large JSONL files),
                 written to the work folder before any work
    units.py     one unit: read, filter, deduplicate, tokenize, write its shards and its manifest
    quality.py   datatrove's quality filters and its exact / MinHash deduplication across all units
    merge.py     the dataset's manifests from the units' manifests, once every unit is complete
    instances.py the units of one instance of a distributed job, and the merge after all of them
    dedup_merge.py  that merge's deduplication across every instance's units, from their signatures
    pipeline.py  the order of the steps, the worker processes, resuming an interrupted preparation

The unit is the unit of work of any worker: local processes here, or the instances of a distributed
job, which run the same unit code on their share of the plan and leave the merge to one step. This
package imports nothing at import time (prepare_data imports plan.py; pipeline.py imports
prepare_data).
"""
