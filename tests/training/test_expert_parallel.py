"""Mixture-of-experts training across processes (gloo, CPU): expert parallel 2 on 2 ranks and 2 x 2
copies on 4 ranks against a single process, a checkpoint written at expert degree 2 resumed at 1
and at 4, and Hugging Face folders of each family loaded from the `model` channel, trained a step,
exported and loaded back by transformers, and a model whose routers send every token to the same
experts stopped by the router_collapse rule.

The 4-rank expert-parallel run also checkpoints its activations (the all-to-alls run again in the
recomputation), and a compiled run with selective checkpointing trains 3 steps in one process.

Every run trains the same global batch of 8 samples per step (global_batch_size): 4 micro-batches
in one process, 2 per rank on 2 ranks, 1 per rank on 4, over the same samples in the same order.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from .conftest import TOKENIZER, job_root, losses, outcome, run_jobs, train_records

pytestmark = pytest.mark.slow

STEPS = 10
MOE = {"model_preset": "qwen3-moe-tiny", "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 8,
       "max_steps": STEPS, "lr_decay_steps": STEPS, "log_every_steps": 1, "mixed_precision": "fp32",
       "checkpoint_every_steps": 0, "lr": 2e-3, "warmup_steps": 1, "max_grad_norm": 0.0,
       "parallelism": "fsdp", "moe_z_loss_coef": 0.001}
SAVED_AT = 5
FOLDER_FAMILIES = ("qwen3-moe-tiny", "mixtral-tiny", "deepseek-moe-tiny")


def _hf_folder(base, preset: str, *, collapsed: bool = False):
    """A 'pretrained' model of the preset's family saved by transformers, with its tokenizer;
    `collapsed`: its routers' weights zero, so every token's equal scores pick the first experts."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from training_jobs.contract.presets import PRESETS

    family, architecture = PRESETS[preset]
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    config = AutoConfig.for_model(family, **architecture, vocab_size=640, max_position_embeddings=64,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(7)
    folder = base / f"{preset}-folder{'-collapsed' if collapsed else ''}"
    model = AutoModelForCausalLM.from_config(config)
    if collapsed:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _with_checkpoint(root, saved_root):
    shutil.copytree(saved_root / "checkpoints", root / "checkpoints")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("experts")
    roots = {name: job_root(base / name, tiny_data) for name in ("ep2", "saved_ep2")}
    two = run_jobs(2, [(roots["ep2"], {**MOE, "expert_parallel_degree": 2}),
                       (roots["saved_ep2"], {**MOE, "expert_parallel_degree": 2, "max_steps": SAVED_AT})],
                   base)
    roots["two ranks output"] = two.output
    roots["single"] = job_root(base / "single", tiny_data)
    roots["resumed_ep1"] = _with_checkpoint(job_root(base / "resumed_ep1", tiny_data), roots["saved_ep2"])
    folders = {preset: _hf_folder(base, preset) for preset in FOLDER_FAMILIES}
    for preset, folder in folders.items():
        roots[f"folder {preset}"] = job_root(base / f"folder-{preset}", tiny_data, model=folder)
    roots["compiled"] = job_root(base / "compiled", tiny_data)
    roots["collapsed"] = job_root(base / "collapsed", tiny_data,
                                  model=_hf_folder(base, "qwen3-moe-tiny", collapsed=True))
    run_jobs(1, [(roots["single"], {**MOE, "parallelism": "single"}),
                 (roots["resumed_ep1"], MOE),
                 (roots["compiled"], {**MOE, "max_steps": 3, "compile": True,
                                      "activation_checkpointing": "selective"}),
                 (roots["collapsed"], {**MOE, "model_preset": "", "rule_warmup_steps": 0}),
                 *[(roots[f"folder {preset}"], {**MOE, "model_preset": "", "max_steps": 1,
                                                "lr_decay_steps": 0, "lr": 1e-2})
                   for preset in FOLDER_FAMILIES]], base)
    roots["folders"] = folders
    roots["ep2x2"] = job_root(base / "ep2x2", tiny_data)
    roots["resumed_ep4"] = _with_checkpoint(job_root(base / "resumed_ep4", tiny_data), roots["saved_ep2"])
    four = run_jobs(4, [(roots["ep2x2"], {**MOE, "expert_parallel_degree": 2,
                                          "activation_checkpointing": "full"}),
                        (roots["resumed_ep4"], {**MOE, "expert_parallel_degree": 4})], base)
    roots["four ranks output"] = four.output
    return roots


def test_expert_parallel_splits_the_experts(runs):
    assert "expert parallel: the 8 experts of each of 2 MoE layers split over 2 ranks (4 each), 1 copies" \
        in runs["two ranks output"]
    assert "split over 2 ranks (4 each), 2 copies" in runs["four ranks output"]
    assert "split over 4 ranks (2 each), 1 copies" in runs["four ranks output"]


@pytest.mark.parametrize("name", ["ep2", "ep2x2"])
def test_expert_parallel_gives_the_single_process_losses(runs, name):
    reference = losses(runs["single"])
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.05
    assert losses(runs[name]) == pytest.approx(reference, abs=1e-4, rel=0)


def test_compiled_and_checkpointed_moe_layers_train_the_same(runs):
    # compiled fp32 falls back to one matmul per expert (torch.compile's grouped matmul takes bf16)
    assert losses(runs["compiled"]) == pytest.approx(losses(runs["single"])[:3], abs=1e-4, rel=0)


@pytest.mark.parametrize("name", ["resumed_ep1", "resumed_ep4"])
def test_checkpoint_of_expert_degree_2_resumes_at_degrees_1_and_4(runs, name):
    records = train_records(runs[name])
    assert [r["step"] for r in records] == list(range(SAVED_AT + 1, STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(losses(runs["single"])[SAVED_AT:], abs=1e-4, rel=0)


def test_moe_lines_show_every_layers_balance_and_no_dropped_tokens(runs):
    lines = (runs["ep2"] / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    moe = [record for record in map(json.loads, lines) if record["kind"] == "moe"]
    assert [r["step"] for r in moe] == list(range(1, STEPS + 1))
    for record in moe:
        assert record["moe_dropped_tokens"] == 0
        assert 1.0 <= record["moe_load_balance"] == max(record["moe_load_balance_layer0"],
                                                        record["moe_load_balance_layer1"])
        assert 0.25 <= record["moe_max_expert_share"] < 1.0  # k / E = 0.25 when balanced
    assert "[moe] step=10 moe_aux_loss=" in runs["two ranks output"]


def test_collapsed_router_is_stopped_by_its_rule(runs):
    result = outcome(runs["collapsed"])
    assert result["error"] == "RuleTriggered"
    assert "router_collapse at step 1: one expert took 1 of a layer's tokens" in result["message"]
    assert len(train_records(runs["collapsed"])) == 1


@pytest.mark.parametrize("preset", FOLDER_FAMILIES)
def test_hugging_face_folder_round_trips(runs, preset):
    from transformers import AutoModelForCausalLM

    root = runs[f"folder {preset}"]
    assert outcome(root) == {"ok": True}
    base = AutoModelForCausalLM.from_pretrained(str(runs["folders"][preset]))
    exported, info = AutoModelForCausalLM.from_pretrained(str(root / "model"), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert exported.config.model_type == base.config.model_type
    trained = dict(exported.named_parameters())
    changed = [name for name, p in base.named_parameters() if not torch.equal(p, trained[name])]
    assert any("experts" in name for name in changed) and any("gate" in name for name in changed)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.isfinite(exported(input_ids=ids).logits).all()
