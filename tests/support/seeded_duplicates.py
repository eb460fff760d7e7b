"""A seeded corpus with known duplicates across files, work units and instances, for the tests of the
deduplication of a distributed preparation (tests/training/test_data_pipeline_instances.py,
tests/llmtrain/test_preparation_cloud.py).

Six JSONL files of four documents each; at `unit_bytes` each file is one work unit, so unit k is file
k, and an instance of a distributed job of N instances runs the units k with k mod N its number:
- exact copies: of a unit 0 document in unit 1, of a unit 2 document in unit 5, and one within unit 2;
- one-word variants (near duplicates): of a unit 0 document in unit 3, of a unit 1 document in unit 5;
- a short document first in unit 1, which Gopher's quality filter removes (so, with the filter, the
  documents the deduplication numbers are not the unit's).
With 2 instances the copies 0->1 and 2->5 and the variant 0->3 cross instances; with 3, the copy 0->1
and the variant 1->5.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "the and of to that with have be river stone garden window morning letter bridge music quiet "
    "bright small green open old long road house light water paper table story night walks finds "
    "keeps builds reads writes carries opens follows remembers across under over near beside slowly "
    "often never always almost gently"
).split()


@dataclass(frozen=True)
class SeededDuplicates:
    files: list[Path]
    unit_bytes: int  # each file one work unit
    texts: list[str]  # every document, in input order
    copies: list[str]  # the exact copies: the exact deduplication removes one document per entry
    variants: dict[str, str]  # near duplicate -> its original: MinHash keeps one of each pair
    short: str  # fewer than Gopher's 50 words: its quality filter removes it

    @property
    def distinct(self) -> list[str]:
        """The texts once each: what the exact deduplication keeps (as a multiset)."""
        return list(dict.fromkeys(self.texts))


def _document(rng: random.Random) -> str:
    """150 words: a one-word change keeps MinHash's 5-gram similarity near 0.92, found all but surely."""
    return " ".join(
        " ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + "." for _ in range(15)
    )


def _variant(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    at = rng.randrange(20, len(words) - 20)
    words[at] = "zebra" if words[at] != "zebra" else "lantern"
    return " ".join(words)


def write_seeded_duplicates(folder: Path, seed: int = 11) -> SeededDuplicates:
    rng = random.Random(seed)
    a, b, c, d, e, f, g, h, i, j, k, m, n, o, p, q, r, s, t = (_document(rng) for _ in range(19))
    near_b, near_e = _variant(rng, b), _variant(rng, e)
    short = "A short note about the river and the old bridge."
    units = [
        [a, b, c, d],
        [short, e, a, f, g],  # a: an exact copy of unit 0's
        [h, i, i, j],  # i: a copy within the unit
        [k, near_b, m, n],  # near_b: a variant of unit 0's b
        [o, p, q, r],
        [s, h, near_e, t],  # h: a copy of unit 2's; near_e: a variant of unit 1's e
    ]
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for number, texts in enumerate(units):
        path = folder / f"part{number}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        files.append(path)
    return SeededDuplicates(
        files=files,
        unit_bytes=max(path.stat().st_size for path in files),
        texts=[text for texts in units for text in texts],
        copies=[a, i, h],
        variants={near_b: b, near_e: e},
        short=short,
    )
