"""LoRA on a pretrained model from the `model` channel: the base stays frozen, the adapter is
exported (or merged into a full model) and reloads with peft / transformers to the same outputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from .conftest import TINY, job_root, losses, outcome, run_jobs

pytestmark = pytest.mark.slow

LORA = {**TINY, "lora_r": 4, "lora_alpha": 8, "lr": 1e-2, "lora_target_modules": ["q_proj", "v_proj"]}
PROMPT = "The captain opens the old bridge at dawn."


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_data, base_model):
    base = tmp_path_factory.mktemp("lora")
    jobs = {"fsdp_adapter": {"parallelism": "fsdp"},
            "ddp_merged": {"parallelism": "ddp", "merge_lora": True},
            "zero2_adapter": {"parallelism": "deepspeed", "zero_stage": 2},
            # QLoRA on bitsandbytes' CPU path: the llama-finetune-qlora template's settings
            "ddp_qlora": {"parallelism": "ddp", "quantization": "nf4", "mixed_precision": "bf16"}}
    roots = {name: job_root(base / name, tiny_data, model=base_model) for name in jobs}
    run_jobs(2, [(roots[name], {**LORA, **hps}) for name, hps in jobs.items()], base)
    return roots


def _final_checkpoint_model(root, tmp_path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{root.name}.pt"
    dcp_to_torch_save(str(root / "checkpoints" / "step_00000004"), str(target))
    return torch.load(target, weights_only=False)["model"]


def _base_name(peft_key: str) -> str:
    return peft_key.removeprefix("base_model.model.").replace(".base_layer", "")


def _logits(model, tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(**tokenizer([PROMPT], return_tensors="pt")).logits


def test_lora_jobs_train(lora_runs):
    for name, root in lora_runs.items():
        assert outcome(root) == {"ok": True}, name
        curve = losses(root)
        assert curve[-1] < curve[0], name


def test_base_weights_unchanged_and_adapters_trained(lora_runs, base_model, tmp_path):
    from safetensors.torch import load_file

    original = load_file(str(base_model / "model.safetensors"))
    trained = _final_checkpoint_model(lora_runs["fsdp_adapter"], tmp_path)
    base_keys = {k: v for k, v in trained.items() if "lora_" not in k}
    assert {_base_name(k) for k in base_keys} == set(original)
    for key, tensor in base_keys.items():
        assert torch.equal(tensor, original[_base_name(key)]), key
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert len(lora_b) == 2 * 2 and all(v.abs().sum() > 0 for v in lora_b)  # 2 layers x q, v


@pytest.mark.parametrize("name", ["fsdp_adapter", "zero2_adapter", "ddp_qlora"])
def test_adapter_export_reloads_with_peft(lora_runs, base_model, name, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = lora_runs[name] / "model"
    assert (exported / "adapter_model.safetensors").is_file()
    assert not (exported / "model.safetensors").exists()
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    base = AutoModelForCausalLM.from_pretrained(str(base_model)).eval()
    before = _logits(base, tokenizer)
    adapted = PeftModel.from_pretrained(base, str(exported)).eval()
    assert not torch.allclose(_logits(adapted, tokenizer), before)
    if name == "fsdp_adapter":  # the exported adapter is the trained one
        trained = _final_checkpoint_model(lora_runs[name], tmp_path)
        for key, value in adapted.state_dict().items():
            if "lora_" in key:
                assert torch.equal(value, trained[key]), key


def test_qlora_trains_adapters_on_a_4bit_base(lora_runs, tmp_path):
    trained = _final_checkpoint_model(lora_runs["ddp_qlora"], tmp_path)
    packed = {k: v for k, v in trained.items() if k.endswith("q_proj.base_layer.weight")}
    assert packed and all(v.dtype == torch.uint8 for v in packed.values())  # NF4, two per byte
    assert all(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)


def test_merged_export_is_a_plain_model_with_the_adapter_folded_in(lora_runs, base_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = lora_runs["ddp_merged"]
    merged = AutoModelForCausalLM.from_pretrained(str(root / "model")).eval()
    assert not (root / "model" / "adapter_config.json").exists()
    adapter_dir = tmp_path / "adapter"
    shutil.copytree(lora_runs["fsdp_adapter"] / "model", adapter_dir)  # same LoRA config
    trained = _final_checkpoint_model(root, tmp_path)
    base = AutoModelForCausalLM.from_pretrained(str(base_model)).eval()
    adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    loaded = adapted.load_state_dict({k: v for k, v in trained.items() if "lora_" in k}, strict=False)
    assert loaded.unexpected_keys == []
    tokenizer = AutoTokenizer.from_pretrained(str(root / "model"))
    torch.testing.assert_close(_logits(merged, tokenizer), _logits(adapted, tokenizer),
                               atol=1e-5, rtol=1e-5)
