"""Issue 36, item 3 (local part): a local run's name, reused with another template, is refused before
any job, naming the run's template@version and how to start fresh. (The launcher's Resolve keeps a
cloud run's template the same way: lifecycle.resolve.run_template.)"""

from __future__ import annotations

import json
from pathlib import Path

from llmtrain.cli import main
from llmtrain.core.catalog import Catalog
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import local_context


def _earlier_job(workdir: Path, ref: str) -> None:
    catalog = Catalog.load()
    template = catalog.resolve(ref)
    request = render(template, RunInput(run_name="r1", attempt=1, owner="local"), local_context(),
                     catalog.program_contract(template))
    job = workdir / "r1" / "jobs" / request["TrainingJobName"]
    job.mkdir(parents=True)
    (job / "request.json").write_text(json.dumps(request))


def test_a_run_name_of_another_template_is_refused_before_any_job(tmp_path, capsys):
    _earlier_job(tmp_path, "gpt2-ddp@1.3.0")
    code = main(["run", "--local", "llama-pretrain-fsdp", "--run-name", "r1", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"run 'r1' in {tmp_path} belongs to gpt2-ddp@1.3.0 (its earlier jobs and checkpoints), not " \
        "llama-pretrain-fsdp@" in err
    assert "continue it with gpt2-ddp@1.3.0, or start fresh with another --run-name" in err
    assert len(list((tmp_path / "r1" / "jobs").iterdir())) == 1  # no new job
    code = main(["run", "--local", "gpt2-ddp@1.2.0", "--run-name", "r1", "--workdir", str(tmp_path)])
    assert code == 2 and "belongs to gpt2-ddp@1.3.0" in capsys.readouterr().err
