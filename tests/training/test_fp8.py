"""FP8 (torchao float8) up to the GPU: the conversion of the decoder layers, and on two CPU processes
(FP8 matmuls have a CPU kernel in torch 2.13) FSDP2 with FP8 all-gathers and precomputed scales
training like bf16, and the tensor-parallel plan with torchao's float8 styles. torchao lives in a
virtual environment of the tests' own (conftest.torchao_python). The program refuses fp8 on a CPU;
its settings' rules are in test_pipeline_parts.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import NEEDS_TORCHAO, REPO, child_env

pytestmark = [pytest.mark.slow, NEEDS_TORCHAO]

FP8_CONVERSION = """
from transformers import AutoConfig, AutoModelForCausalLM
from torchao.float8.float8_linear import Float8Linear
from training_jobs.trainer.float8 import convert_to_float8
config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(config)
count = convert_to_float8(model, "rowwise")
kv = model.model.layers[0].self_attn.k_proj
print(count, isinstance(model.lm_head, Float8Linear), isinstance(kv, Float8Linear), kv.out_features)
"""
WORKER = Path(__file__).resolve().parent / "fp8_worker.py"


def test_fp8_converts_the_decoder_layers_linear_layers_only(torchao_python):
    result = subprocess.run([str(torchao_python), "-c", FP8_CONVERSION], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # 3 layers x 7 linear layers (q, k, v, o, gate, up, down); the head stays; k_proj is 2 x 8 wide.
    assert result.stdout.split()[-4:] == ["21", "False", "True", "16"]


@pytest.fixture(scope="module")
def distributed(torchao_python, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fp8")
    command = [str(torchao_python), "-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER),
               str(out)]
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "fp8.json").read_text())


def test_fsdp_all_gathers_fp8_weights_and_trains_like_bf16(distributed):
    fp8, bf16 = distributed["fp8"], distributed["bf16"]
    assert fp8["converted"] == 14  # 2 layers x 7 projections
    # the shard FSDP2 all-gathers casts itself to float8 first (torchao's FP8 all-gather)
    assert fp8["sharded weight"] == "WeightWithDynamicFloat8CastTensor"
    assert bf16["sharded weight"] == "Tensor"
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.2
    assert fp8["losses"] == pytest.approx(bf16["losses"], abs=0.01)


def test_tensor_parallel_takes_torchaos_float8_styles(distributed):
    assert distributed["tensor parallel"] == {"q_proj": "Float8Linear", "float8": True,
                                              "q_proj placements": "(Shard(dim=0),)"}
