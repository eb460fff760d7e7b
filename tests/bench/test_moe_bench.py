"""The mixture-of-experts part of the benchmark runs end to end (tiny mode, a few steps): our
program on one process and with expert parallelism over 2, and transformers' Qwen3MoeForCausalLM
under the HF Trainer, on the same model. No timing assertions: benchmarks are not tests."""

from __future__ import annotations

import json
import math

import pytest

from bench import report
from bench.flops import model_shape
from bench.model import build_causal_lm
from bench.modes import MODES, configurations
from bench.run import main

MOE = ["moe_ours_fp32", "moe_ours_ep2", "moe_hf_trainer_fp32"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    assert main(["--mode", "tiny", "--out", str(out), "--skip-extras", "--only", *MOE]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_moe_runner_trains_the_mixture_of_experts(results):
    for name in MOE:
        record = results["configs"][name]
        assert record["status"] == "ok", f"{name}: {record.get('error')}"
        assert record["moe"] is True and record["tokens_per_s"] > 0 and 0 < record["mfu"] < 1
        assert math.isfinite(record["final_loss"])
    ours, hf = results["configs"]["moe_ours_fp32"], results["configs"]["moe_hf_trainer_fp32"]
    assert '"model_preset": "qwen3-moe-tiny"' in ours["command"]
    assert '"expert_parallel_degree": 2' in results["configs"]["moe_ours_ep2"]["command"]
    assert "Qwen3MoeForCausalLM" not in ours["command"] and '"output_router_logits": true' in hf["command"]
    # Both start from the same loss scale: ln(vocab) at initialisation, the balance loss ~0.001 x k.
    assert abs(ours["final_loss"] - hf["final_loss"]) < 1.0
    assert results["ratios"]["moe_ours_vs_hf_trainer"] > 0 and results["ratios"]["moe_ep2_vs_single"] > 0
    assert hf["ratio_to_hf_trainer"] == 1.0


@pytest.mark.slow
def test_report_names_the_moe_model(results, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"{report.START}\n{report.END}\n")
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps(results))
    assert report.main([str(results_path), "--doc", str(doc), "--plot", str(tmp_path / "plot.png")]) == 0
    text = doc.read_text()
    assert "Mixture of experts (`moe_*`): `qwen3-moe-tiny`" in text
    assert "| `moe_ours_vs_hf_trainer` | moe_ours_fp32 / moe_hf_trainer_fp32 |" in text


def test_moe_flops_count_only_each_tokens_top_k_experts():
    mode = MODES["tiny"]
    model = build_causal_lm(mode.moe_model.preset, mode.seq_len)
    config = model.config
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert experts == config.num_hidden_layers * config.num_experts * 3 * config.hidden_size \
        * config.moe_intermediate_size
    dense_count = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    shape = model_shape(model, mode.seq_len)
    inactive = experts * (config.num_experts - config.num_experts_per_tok) // config.num_experts
    assert shape.non_embedding_parameters == dense_count - inactive


def test_every_mode_benchmarks_the_mixture_of_experts_beside_the_dense_model():
    for mode in MODES.values():
        by_name = {c.name: c for c in configurations(mode)}
        assert {name for name, c in by_name.items() if c.moe} == set(MOE)
        assert by_name["moe_ours_fp32"].model(mode) == by_name["moe_hf_trainer_fp32"].model(mode)
        assert by_name["ours_fp32"].model(mode).preset == mode.model_preset
