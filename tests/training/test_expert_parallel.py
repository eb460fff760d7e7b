"""Mixture-of-experts training across processes (gloo, CPU): expert parallel 2 on 2 ranks and 2 x 2
on 4 ranks (each expert slice FSDP-sharded over the 2 ranks holding it) against a single process,
checkpoints written at expert degree 2 (on 2 ranks, and 2 x 2 on 4) resumed at degrees 1 and 4, the
export of the 4-rank run gathering whole experts, and Hugging Face folders of each family loaded
from the `model` channel, trained a step, exported and loaded back by transformers, and a model
whose routers send every token to the same experts stopped by the router_collapse rule.

The 4-rank expert-parallel run also checkpoints its activations (the all-to-alls and the experts'
all-gathers run again in the recomputation); a 4-rank run of 2 experts (1 per expert rank, fewer
than the 2 ranks sharing it) shards its slices on their second dimension; and a compiled run with
selective checkpointing trains 3 steps in one process.

Every run trains the same global batch of 8 samples per step (global_batch_size): 4 micro-batches
in one process, 2 per rank on 2 ranks, 1 per rank on 4, over the same samples in the same order.
"""

from __future__ import annotations

import json
import math
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
# 2 experts (top-1) over 2 expert ranks of 4: each rank's 1 expert is split between the 2 ranks
# holding it on the expert weights' second dimension (fewer experts than ranks to share them).
TWO_EXPERTS = {**MOE, "max_steps": 3, "model_overrides": {"num_experts": 2, "num_experts_per_tok": 1}}
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


def _with_checkpoint(root, saved_root, step: int | None = None):
    """`root` with the checkpoints of `saved_root`'s run (only the one of `step` if given)."""
    if step is None:
        shutil.copytree(saved_root / "checkpoints", root / "checkpoints")
    else:
        name = f"step_{step:08d}"
        shutil.copytree(saved_root / "checkpoints" / name, root / "checkpoints" / name)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("experts")
    roots = {name: job_root(base / name, tiny_data) for name in ("ep2", "saved_ep2")}
    two = run_jobs(2, [(roots["ep2"], {**MOE, "expert_parallel_degree": 2}),
                       (roots["saved_ep2"], {**MOE, "expert_parallel_degree": 2, "max_steps": SAVED_AT})],
                   base)
    roots["two ranks output"] = two.output
    for name in ("ep2x2", "two_experts_ep2x2"):
        roots[name] = job_root(base / name, tiny_data)
    roots["resumed_ep4"] = _with_checkpoint(job_root(base / "resumed_ep4", tiny_data), roots["saved_ep2"])
    four = run_jobs(4, [(roots["ep2x2"], {**MOE, "expert_parallel_degree": 2,
                                          "activation_checkpointing": "full",
                                          "checkpoint_every_steps": SAVED_AT}),
                        (roots["resumed_ep4"], {**MOE, "expert_parallel_degree": 4}),
                        (roots["two_experts_ep2x2"], {**TWO_EXPERTS, "expert_parallel_degree": 2})], base)
    roots["four ranks output"] = four.output
    roots["single"] = job_root(base / "single", tiny_data)
    roots["two_experts_single"] = job_root(base / "two_experts_single", tiny_data)
    roots["resumed_ep1"] = _with_checkpoint(job_root(base / "resumed_ep1", tiny_data), roots["saved_ep2"])
    roots["resumed_from_ep2x2"] = _with_checkpoint(job_root(base / "resumed_from_ep2x2", tiny_data),
                                                   roots["ep2x2"], step=SAVED_AT)
    folders = {preset: _hf_folder(base, preset) for preset in FOLDER_FAMILIES}
    for preset, folder in folders.items():
        roots[f"folder {preset}"] = job_root(base / f"folder-{preset}", tiny_data, model=folder)
    roots["compiled"] = job_root(base / "compiled", tiny_data)
    roots["collapsed"] = job_root(base / "collapsed", tiny_data,
                                  model=_hf_folder(base, "qwen3-moe-tiny", collapsed=True))
    run_jobs(1, [(roots["single"], {**MOE, "parallelism": "single"}),
                 (roots["two_experts_single"], {**TWO_EXPERTS, "parallelism": "single"}),
                 (roots["resumed_ep1"], MOE),
                 (roots["resumed_from_ep2x2"], MOE),
                 (roots["compiled"], {**MOE, "max_steps": 3, "compile": True,
                                      "activation_checkpointing": "selective"}),
                 (roots["collapsed"], {**MOE, "model_preset": "", "rule_warmup_steps": 0}),
                 *[(roots[f"folder {preset}"], {**MOE, "model_preset": "", "max_steps": 1,
                                                "lr_decay_steps": 0, "lr": 1e-2})
                   for preset in FOLDER_FAMILIES]], base)
    roots["folders"] = folders
    return roots


def test_expert_parallel_splits_the_experts(runs):
    assert ("expert parallel: the 8 experts of each of 2 MoE layers split over 2 ranks (4 each), each "
            "slice sharded over the 1 ranks holding it") in runs["two ranks output"]
    assert "split over 2 ranks (4 each), each slice sharded over the 2 ranks holding it" \
        in runs["four ranks output"]
    assert "split over 4 ranks (2 each), each slice sharded over the 1 ranks holding it" \
        in runs["four ranks output"]


def _grad_norms(root) -> list[float]:
    return [record["grad_norm"] for record in train_records(root)]


@pytest.mark.parametrize("name", ["ep2", "ep2x2"])
def test_expert_parallel_gives_the_single_process_losses(runs, name):
    reference = losses(runs["single"])
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.05
    assert losses(runs[name]) == pytest.approx(reference, abs=1e-4, rel=0)
    # AdamW hides a constant factor on the experts' gradients from the losses; the norm does not
    assert _grad_norms(runs[name]) == pytest.approx(_grad_norms(runs["single"]), rel=1e-4)


def test_a_slice_with_fewer_experts_than_ranks_sharing_it_trains_the_same(runs):
    assert "split over 2 ranks (1 each), each slice sharded over the 2 ranks holding it" \
        in runs["four ranks output"]
    reference = losses(runs["two_experts_single"])
    assert losses(runs["two_experts_ep2x2"]) == pytest.approx(reference, abs=1e-4, rel=0)
    assert _grad_norms(runs["two_experts_ep2x2"]) == pytest.approx(_grad_norms(runs["two_experts_single"]),
                                                                 rel=1e-4)


def _stored_chunks(folder) -> dict[str, tuple[int, list[int]]]:
    """Per stored tensor of a DCP checkpoint: (its elements, the elements of each stored chunk)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {key: (math.prod(item.size), [math.prod(chunk.sizes) for chunk in item.chunks])
            for key, item in metadata.items() if isinstance(item, TensorStorageMetadata)}


@pytest.mark.parametrize(("name", "ranks"), [("ep2x2", 4), ("ep2", 2)])
def test_each_rank_keeps_one_nth_of_every_expert_weight_and_its_moments(runs, name, ranks):
    """What each rank saved (DCP stores every rank's own shard; copies of one shard once): on 4
    ranks with expert degree 2 each holds a quarter of every expert weight, exp_avg and exp_avg_sq,
    half of what the 2 ranks holding the same experts each kept whole before they sharded it."""
    chunks = _stored_chunks(runs[name] / "checkpoints" / f"step_{STEPS:08d}")
    experts = {key: value for key, value in chunks.items() if "mlp.experts." in key}
    weights = [key for key in experts if key.startswith("model.")]
    moments = [key for key in experts if key.endswith((".exp_avg", ".exp_avg_sq"))]
    assert len(weights) == 4 and len(moments) == 8  # gate_up_proj and down_proj of 2 layers
    for key in weights + moments:
        total, stored = experts[key]
        assert stored == [total // ranks] * ranks, key


def test_checkpoint_of_expert_degree_2_on_4_ranks_resumes_in_one_process(runs):
    records = train_records(runs["resumed_from_ep2x2"])
    assert [r["step"] for r in records] == list(range(SAVED_AT + 1, STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(losses(runs["single"])[SAVED_AT:], abs=1e-4, rel=0)


def test_the_export_of_sharded_experts_holds_them_whole(runs):
    """The 4-rank run's safetensors hold every expert whole: the single process's weights, within
    what 10 steps of different summation orders leave (a misplaced shard differs by the weights)."""
    from safetensors.torch import load_file

    def weights(root):
        return {name: tensor for path in sorted((root / "model").glob("*.safetensors"))
                for name, tensor in load_file(str(path)).items()}

    sharded, single = weights(runs["ep2x2"]), weights(runs["single"])
    assert sharded.keys() == single.keys()
    # in whatever layout transformers saves them: 2 layers x 8 experts x (64 x 64 + 64 x 32)
    experts = [name for name in sharded if ".experts." in name]
    assert sum(sharded[name].numel() for name in experts) == 2 * 8 * (64 * 64 + 64 * 32)
    for name, tensor in single.items():
        assert torch.allclose(sharded[name], tensor, atol=1e-3, rtol=0), name


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
