"""The byo-script template's example folder runs on CPU and speaks the platform's contract:
it reads the train channel, prints metric lines the template's own definitions parse, checkpoints,
and writes a safetensors model to SM_MODEL_DIR. One real (tiny) training run, ~15 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from templates_support import REPO_ROOT, catalog

SCRIPT = REPO_ROOT / "examples" / "byo_script" / "train_clm.py"


def test_example_script_trains_and_reports_the_templates_metrics(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    (train / "part-0.txt").write_text("the platform trains language models on sagemaker. " * 60)
    validation = tmp_path / "validation"
    validation.mkdir()
    (validation / "part-0.txt").write_text("models are trained on the platform. " * 40)
    env = {
        **os.environ,
        "SM_CHANNEL_TRAIN": str(train),
        "SM_CHANNEL_VALIDATION": str(validation),
        "SM_MODEL_DIR": str(tmp_path / "model"),
        "SAGEMAKER_BASE_DIR": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
    }
    # Hyperparameters arrive as --name value, the way the SageMaker toolkit passes them.
    args = [
        "--max_steps",
        "4",
        "--n_layer",
        "1",
        "--n_embd",
        "32",
        "--n_head",
        "2",
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "2",
        "--save_steps",
        "2",
    ]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    definitions = catalog().resolve("byo-script").metrics
    values = {m.name: [float(x) for x in re.findall(m.regex, result.stdout)] for m in definitions}
    assert len(values["train:loss"]) == 2 and all(v > 0 for v in values["train:loss"])
    assert len(values["train:lr"]) == 2 and len(values["train:grad_norm"]) == 2
    assert len(values["eval:loss"]) >= 1
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
