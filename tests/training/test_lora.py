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
FULL_AC = {"activation_checkpointing": "full"}
# QLoRA on bitsandbytes' CPU path: the llama-finetune-qlora template's settings.
QLORA = {"parallelism": "ddp", "quantization": "nf4", "mixed_precision": "bf16"}
# Every combination the fine-tune templates use (their activation checkpointing on, and off).
ADAPTER_JOBS = {"fsdp_adapter": {"parallelism": "fsdp"},
                "fsdp_adapter_ac": {"parallelism": "fsdp", **FULL_AC},
                "ddp_adapter": {"parallelism": "ddp"},
                "ddp_adapter_ac": {"parallelism": "ddp", **FULL_AC},
                "ddp_qlora": QLORA,
                "ddp_qlora_ac": {**QLORA, **FULL_AC}}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_data, base_model):
    base = tmp_path_factory.mktemp("lora")
    jobs = {**ADAPTER_JOBS,
            "ddp_merged": {"parallelism": "ddp", "merge_lora": True, **FULL_AC},
            "zero2_adapter": {"parallelism": "deepspeed", "zero_stage": 2}}
    roots = {name: job_root(base / name, tiny_data, model=base_model) for name in jobs}
    run_jobs(2, [(roots[name], {**LORA, **hps}) for name, hps in jobs.items()], base)
    return roots


def _final_checkpoint_model(root, tmp_path) -> dict[str, torch.Tensor]:
    """The model state of the job's last checkpoint (DCP, or DeepSpeed's module states, which
    ZeRO-1/2 keep whole)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = root / "checkpoints" / "step_00000004"
    if (folder / "deepspeed").is_dir():
        return torch.load(folder / "deepspeed" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    target = tmp_path / f"{root.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
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


def _base(base_model, quantized: bool):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not quantized:
        return AutoModelForCausalLM.from_pretrained(str(base_model)).eval()
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    return AutoModelForCausalLM.from_pretrained(str(base_model), quantization_config=nf4).eval()


@pytest.mark.parametrize("name", [*ADAPTER_JOBS, "zero2_adapter"])
def test_adapter_export_reloads_with_peft_as_trained(lora_runs, base_model, name, tmp_path):
    """The exported adapter holds every trained LoRA tensor: loaded with peft on the base it gives
    the trained model's outputs, which differ from the base's."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    exported = lora_runs[name] / "model"
    assert not (exported / "model.safetensors").exists()
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    trained = {k: v for k, v in _final_checkpoint_model(lora_runs[name], tmp_path).items() if "lora_" in k}
    assert len(load_file(str(exported / "adapter_model.safetensors"))) == len(trained) == 2 * 2 * 2
    quantized = "qlora" in name
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    before = _logits(_base(base_model, quantized), tokenizer)
    adapted = PeftModel.from_pretrained(_base(base_model, quantized), str(exported)).eval()
    reference = PeftModel.from_pretrained(_base(base_model, quantized), str(exported)).eval()
    assert reference.load_state_dict(trained, strict=False).unexpected_keys == []
    after = _logits(adapted, tokenizer)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, _logits(reference, tokenizer), atol=0, rtol=0)
    for key, value in adapted.state_dict().items():
        if "lora_" in key:
            assert torch.equal(value, trained[key].to(value.dtype)), key


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
