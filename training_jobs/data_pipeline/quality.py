"""Quality steps, with HF's datatrove: quality filters per document, and deduplication across the
whole input.

Filters (`--filter NAME`, repeatable) decide each document alone, in the unit that reads it.
Deduplication needs every unit's documents, so it runs as datatrove's own stages do in a
distributed job: each unit writes the signatures of its documents (stage 1, in the workers), one
step finds the duplicates across all units' signatures (datatrove's MinHash buckets and clusters, or
its exact-duplicate finder), and each unit then drops the documents datatrove's filter stage removes
from it (while tokenizing). Which copy of a duplicate survives is datatrove's choice, made from the
signatures alone, so it is the same whatever the number of workers. The instances of a distributed
job write the same signatures, and their merge takes the same step over them (dedup_merge.py).

The steps run offline: datatrove's English word splitting is spaCy's (and NLTK's for other
languages), which are not installed, so filters and MinHash split words with WORD_PATTERN (runs of
letters and digits, and runs of punctuation as their own words, as spaCy splits English). The
language filter is not offered: datatrove's downloads a fastText model at first use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from training_jobs.trainer.errors import DataError

DEDUP_METHODS = ("exact", "minhash")
WORD_PATTERN = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]+")
SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)]*(?:\s+|$)|\n+")
SIGNATURES, DUPLICATES, REMOVALS = "signatures", "duplicates", "removals"


@dataclass(frozen=True)
class QualitySettings:
    filters: tuple[str, ...] = ()
    dedup: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.filters or self.dedup)

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps that may remove documents, in the order they run."""
        return (*self.filters, *((f"dedup-{self.dedup}",) if self.dedup else ()))


def content_text(content) -> str:
    """The text the quality steps judge: a document's text, an example's prompt and completion, a
    conversation's messages."""
    if isinstance(content, str):
        return content
    if isinstance(content, tuple):
        return "\n".join(content)
    if isinstance(content, list):
        return "\n".join(f"{m['role']}: {m['content']}" for m in content)
    return json.dumps(content, sort_keys=True, default=str)


def _datatrove():
    try:
        import datatrove  # noqa: F401
    except ImportError as error:
        raise DataError("--dedup and --filter need HF's datatrove (pip install datatrove==0.10.1, as "
                        "requirements.txt pins it)") from error
    from loguru import logger

    logger.disable("datatrove")  # its stage logs are noise here; each step's count is reported


def _word_tokenizer():
    from datatrove.utils.word_tokenizers import WordTokenizer

    class PatternWords(WordTokenizer):
        """Words and punctuation by WORD_PATTERN, sentences at terminal punctuation or newlines."""

        def word_tokenize(self, text: str) -> list[str]:
            return WORD_PATTERN.findall(text)

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            spans, start = [], 0
            for match in SENTENCE_END.finditer(text):
                if text[start:match.end()].strip():
                    spans.append((start, match.end()))
                start = match.end()
            if text[start:].strip():
                spans.append((start, len(text)))
            return spans

        def sent_tokenize(self, text: str) -> list[str]:
            return [text[a:b].strip() for a, b in self.span_tokenize(text)]

    return PatternWords("en")


def _filter_factories() -> dict[str, Callable]:
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    return {"gopher-quality": GopherQualityFilter, "gopher-repetition": GopherRepetitionFilter,
            "c4-quality": C4QualityFilter, "fineweb-quality": FineWebQualityFilter}


FILTER_NAMES = ("gopher-quality", "gopher-repetition", "c4-quality", "fineweb-quality")


class Judge:
    """A unit's quality decisions: the first filter that removes a document, and which documents
    the deduplication removes (by their position among the documents the filters kept)."""

    def __init__(self, settings: QualitySettings, work: Path, unit: int) -> None:
        self.settings, self.work, self.unit = settings, work, unit
        self.filters = []
        if settings.active:
            _datatrove()
            words = _word_tokenizer()
            factories = _filter_factories()
            self.filters = [(name, factories[name](language=words)) for name in settings.filters]

    def failed_filter(self, text: str) -> str | None:
        if not self.filters:
            return None
        from datatrove.data import Document

        document = Document(text=text, id="")
        for name, step in self.filters:
            verdict = step.filter(document)
            kept = verdict[0] if isinstance(verdict, tuple) else verdict
            if not kept:
                return name
        return None

    def duplicates(self, count: int) -> set[int]:
        """Which of the unit's `count` filtered documents the deduplication removes: datatrove's
        filter stage run over stand-ins for them (it decides by position alone)."""
        if not self.settings.dedup or count == 0:
            return set()
        from datatrove.data import Document

        stand_ins = (Document(text="", id=str(i)) for i in range(count))
        step = _dedup_filter(self.settings.dedup, self.work)
        with _quiet():
            kept = {int(d.id) for d in step.run(stand_ins, self.unit)}
        return set(range(count)) - kept


def write_signatures(method: str, work: Path, unit: int, texts: Iterable[str]) -> None:
    """Stage 1 of the deduplication, for one unit: its documents' signatures."""
    from datatrove.data import Document

    _datatrove()
    documents = (Document(text=text, id=str(i)) for i, text in enumerate(texts))
    with _quiet():
        if method == "minhash":
            from datatrove.pipeline.dedup import MinhashDedupSignature

            MinhashDedupSignature(str(work / SIGNATURES), _minhash_config(),
                                  language=_word_tokenizer()).run(documents, unit)
        else:
            from datatrove.pipeline.dedup.exact_dedup import ExactDedupSignature

            ExactDedupSignature(str(work / SIGNATURES), _exact_config()).run(documents, unit)


def find_duplicates(method: str, work: Path, signatures: Path | None = None) -> None:
    """The step across all units: duplicates found from every unit's signatures (`signatures`, by
    default work/signatures), written to work as each unit's removals for datatrove's filter stage."""
    _datatrove()
    signatures = signatures or work / SIGNATURES
    with _quiet():
        if method == "minhash":
            from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster

            config = _minhash_config()
            for bucket in range(config.num_buckets):
                MinhashDedupBuckets(str(signatures), str(work / DUPLICATES), config=config).run(
                    None, bucket, config.num_buckets)
            MinhashDedupCluster(str(work / DUPLICATES), str(work / REMOVALS), config=config).run()
        else:
            from datatrove.pipeline.dedup.exact_dedup import ExactFindDedups

            ExactFindDedups(str(signatures), str(work / REMOVALS), _exact_config()).run()


def _dedup_filter(method: str, work: Path):
    if method == "minhash":
        from datatrove.pipeline.dedup import MinhashDedupFilter

        return MinhashDedupFilter(str(work / REMOVALS))
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupFilter

    return ExactDedupFilter(str(work / REMOVALS), _exact_config())


def _minhash_config():
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    # datatrove's defaults (5-grams, 14 buckets of 8 hashes: pairs above ~0.72 similarity found), with
    # SHA-1 shingles instead of xxhash (not a dependency here).
    return MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"))


def _text_of(document) -> str:
    return document.text


def _exact_config():
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig
    from datatrove.utils.hashing import HashConfig

    return ExactDedupConfig(content_getter=_text_of, hash_config=HashConfig(precision=64, hash_fc="sha1"))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without datatrove's progress bars (each step's count is reported instead)."""
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before
