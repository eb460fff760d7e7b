"""`python -m bench.prepare_data` keeps working: a tiny corpus, one worker (no timing assertions)."""

from __future__ import annotations

import json

from bench.prepare_data import main


def test_tiny_run_reports_the_bare_tokenizer_and_each_worker_count(tmp_path, capsys):
    out = tmp_path / "prepare.json"
    assert main(["--megabytes", "0.05", "--workers", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    bare, prepared = report["runs"]
    assert bare["what"].startswith("tokenizers encode_batch") and prepared["workers"] == 1
    # The same corpus: the dataset holds the bare tokens plus one end-of-sequence id per document.
    assert prepared["tokens"] == bare["tokens"] + report["documents"]
    assert report["machine"]["cpu"] and prepared["tokens_per_s"] > 0 and bare["vs_bare_tokenizer"] == 1.0
