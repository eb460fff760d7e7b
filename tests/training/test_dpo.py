"""DPO in the training program against TRL's DPOTrainer: on the same batch and weights, the loss,
its gradients and the metrics agree, with each reference (a frozen copy, LoRA's adapters switched
off, log-probabilities precomputed) and each loss (sigmoid, robust, ipo)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from training_jobs import prepare_data
from training_jobs.contract.hyperparameters import from_hyperparameters
from training_jobs.contract.parallel_dims import resolve_cluster
from training_jobs.trainer.data import BatchLayout, TrainBatches
from training_jobs.trainer.models import model_source
from training_jobs.trainer.objectives import ObjectiveContext, build_objective
from training_jobs.trainer.preference_data import PreferencePairs
from training_jobs.trainer.strategies import SetupContext, build_strategy

from .conftest import REPO, TINY, TOKENIZER

PAIRS = REPO / "examples" / "data" / "tiny_preference" / "train.jsonl"
CPU = torch.device("cpu")
BATCH = np.array([0, 1, 2, 3])
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def pairs_folder(tmp_path_factory) -> Path:
    """The first shipped pairs prepared by the CLI, with one pair's chosen answer lengthened so
    that the rows have different lengths (padding) and different completion lengths (ipo)."""
    folder = tmp_path_factory.mktemp("pairs")
    lines = PAIRS.read_text().splitlines()[:6]
    lines[1] = lines[1].replace('"chosen": " ', '"chosen": " and so on, ')
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    code = prepare_data.main(["--input", str(folder / "pairs.jsonl"), "--tokenizer", str(TOKENIZER),
                              "--output", str(folder / "out"), "--preference", "--workers", "1"])
    assert code == 0
    return folder / "out"


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "rendezvous"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("settings, message", [
    ({"parallelism": "deepspeed"}, "'parallelism': got 'deepspeed', expected one of single, ddp, fsdp with "
                                   "objective=dpo"),
    ({"parallelism": "fsdp", "pipeline_parallel_degree": 2, "grad_accum_steps": 2},
     "'pipeline_parallel_degree': got 2, expected 1 with objective=dpo"),
    ({"parallelism": "fsdp", "context_parallel_degree": 2}, "'context_parallel_degree': got 2, expected 1"),
    ({"dpo_reference": "adapters_off"}, "copy or precomputed unless lora_r > 0"),
    ({"dpo_loss": "ipo", "dpo_label_smoothing": 0.1}, "0 with dpo_loss=ipo"),
    ({"dpo_label_smoothing": 0.5}, "'dpo_label_smoothing': got 0.5, expected a value < 0.5"),
    ({"dpo_beta": 0}, "'dpo_beta': got 0.0, expected a value > 0.0"),
    ({"objective": "next_token", "dpo_beta": 0.5}, "'dpo_beta': got 0.5, expected its default (0.1) unless "
                                                   "objective=dpo"),
])
def test_bad_dpo_settings_are_refused_naming_them(settings, message):
    import re

    from training_jobs.contract.hyperparameters import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hyperparameters({"objective": "dpo", "parallelism": "single", **settings})


def _program(pairs_folder: Path, settings: dict):
    """The program's strategy and DPO objective for `settings`, with the policy moved away from
    its initial weights (so that policy and reference differ)."""
    from transformers import AutoTokenizer

    hps = {**TINY, "parallelism": "single", "objective": "dpo", "seq_len": 64, "micro_batch_size": 4,
           "grad_accum_steps": 1, **settings}
    config, dims = resolve_cluster(from_hyperparameters(hps), 1, 1)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    source = model_source(config.model, None, tokenizer, config.data.seq_len, "eager")
    strategy = build_strategy(SetupContext(config, source, CPU, dims))
    pairs = PreferencePairs(pairs_folder, config.data.seq_len, "train", source.config.vocab_size)
    train = TrainBatches(pairs, BatchLayout(1, 0, 4, 1), config.run.seed, CPU)
    objective = build_objective(ObjectiveContext(config, strategy, train, None, CPU))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in strategy.hf_model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return strategy, objective, pairs


def _trl_batch(pairs: PreferencePairs, indices: np.ndarray, collator, swap: bool = False) -> dict:
    """The same pairs as TRL's collator batches them: prompt ids, then each completion's."""
    sequences = pairs.sequences(indices)
    half = len(indices)
    examples = []
    for (chosen, chosen_mask), (rejected, rejected_mask) in zip(sequences[:half], sequences[half:],
                                                                strict=True):
        start = int(np.argmax(chosen_mask))
        assert start == int(np.argmax(rejected_mask)) and not chosen_mask[:start].any()
        chosen_ids, rejected_ids = chosen[start:].tolist(), rejected[start:].tolist()
        if swap:
            chosen_ids, rejected_ids = rejected_ids, chosen_ids
        examples.append({"prompt_ids": chosen[:start].tolist(), "chosen_ids": chosen_ids,
                         "rejected_ids": rejected_ids})
    return collator(examples)


def _trl(policy, reference, settings: dict, tmp_path: Path, peft_config=None):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to=[],
                     use_cpu=True, bf16=False, beta=settings.get("dpo_beta", 0.1),
                     loss_type=[settings.get("dpo_loss", "sigmoid")],
                     label_smoothing=settings.get("dpo_label_smoothing", 0.0))
    data = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(str(TOKENIZER)),
                          peft_config=peft_config)


def _trl_with_lora(strategy, settings: dict, tmp_path: Path):
    """TRL training the program's adapters: TRL wraps the base model in the same LoRA config (its
    reference is then the base with the adapters disabled), then takes the program's weights."""
    from training_jobs.trainer.lora import peft_config

    base = copy.deepcopy(strategy.hf_model).unload()  # the base weights, without the adapters
    trainer = _trl(base, None, settings, tmp_path, peft_config(strategy.config.lora))
    trainer.model.load_state_dict(strategy.hf_model.state_dict(), strict=True)
    return trainer


def _trl_loss(trainer, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    trainer.model.train()
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, batch)
    return loss, {name: trainer._metrics["train"][name][-1] for name in METRICS}


def _ours(strategy, objective, pairs) -> tuple[float, dict[str, float]]:
    micro_batch = pairs.batch(BATCH, CPU)
    micro_batches, loss_fn = objective.prepare_step([micro_batch], [BATCH])
    loss = strategy.forward_backward(micro_batches, loss_fn)
    return float(loss), objective.window_metrics()


def _grads(model) -> dict[str, torch.Tensor]:
    return {name.replace("base_model.model.", ""): p.grad.clone()
            for name, p in model.named_parameters() if p.grad is not None}


REFERENCES = {
    "copy_sigmoid": {"dpo_reference": "copy"},
    "copy_robust": {"dpo_reference": "copy", "dpo_loss": "robust", "dpo_label_smoothing": 0.1},
    "copy_ipo": {"dpo_reference": "copy", "dpo_loss": "ipo", "dpo_beta": 0.5},
    "precomputed": {"dpo_reference": "precomputed", "dpo_beta": 0.3},
    "lora_adapters_off": {"dpo_reference": "adapters_off", **LORA},
    "lora_precomputed": {"dpo_reference": "precomputed", **LORA},
}


@pytest.mark.parametrize("name", REFERENCES)
def test_loss_gradients_and_metrics_equal_trl(name, pairs_folder, group_of_one, tmp_path):
    settings = REFERENCES[name]
    strategy, objective, pairs = _program(pairs_folder, settings)
    if "lora_r" in settings:  # TRL's reference: the adapters switched off
        trainer = _trl_with_lora(strategy, settings, tmp_path)
    else:  # TRL's reference: the initial model (the program's frozen copy is one)
        initial = _program(pairs_folder, {**settings, "dpo_reference": "copy"})[1].reference.model
        trainer = _trl(copy.deepcopy(strategy.hf_model), copy.deepcopy(initial), settings, tmp_path)
    expected_loss, expected = _trl_loss(trainer, _trl_batch(pairs, BATCH, trainer.data_collator))
    expected_loss.backward()
    expected_loss = expected_loss.detach()
    loss, metrics = _ours(strategy, objective, pairs)

    assert loss == pytest.approx(float(expected_loss), abs=1e-5)
    assert metrics.keys() == expected.keys()
    for key in METRICS:
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-5), key
    assert abs(metrics["rewards/margins"]) > 1e-3  # policy and reference differ: a real comparison
    ours, theirs = _grads(strategy.hf_model), _grads(trainer.model)
    assert ours.keys() == theirs.keys() and ours
    for key, grad in ours.items():
        torch.testing.assert_close(grad, theirs[key], rtol=1e-4, atol=1e-6, msg=key)


def test_label_smoothing_mixes_the_loss_of_the_flipped_preference(pairs_folder, group_of_one, tmp_path):
    """Conservative DPO: with smoothing e, the sigmoid loss is (1 - e) x DPO's on the pairs as given
    plus e x DPO's on the pairs flipped (TRL computes the e = 0 loss of each)."""
    smoothing = 0.2
    strategy, objective, pairs = _program(pairs_folder, {"dpo_reference": "copy",
                                                         "dpo_label_smoothing": smoothing})
    initial = _program(pairs_folder, {"dpo_reference": "copy"})[1].reference.model
    trainer = _trl(copy.deepcopy(strategy.hf_model), copy.deepcopy(initial), {}, tmp_path)
    as_given, _ = _trl_loss(trainer, _trl_batch(pairs, BATCH, trainer.data_collator))
    flipped, _ = _trl_loss(trainer, _trl_batch(pairs, BATCH, trainer.data_collator, swap=True))
    loss, _ = _ours(strategy, objective, pairs)
    assert loss == pytest.approx((1 - smoothing) * float(as_given) + smoothing * float(flipped), abs=1e-5)
    assert float(as_given) != pytest.approx(float(flipped), abs=1e-3)


# --- the program end to end: one process against FSDP2 (and DDP, tensor parallel) on 2 ranks -----

DPO_RUN = {**TINY, "objective": "dpo", "seq_len": 64, "micro_batch_size": 4, "grad_accum_steps": 1,
           "max_steps": 4, "lr": 1e-2, "eval_every_steps": 2, "eval_steps": 2}
ONE_PROCESS = {"single": {"parallelism": "single"},
               "single_lora": {"parallelism": "single", **LORA}}
TWO_RANKS = {"fsdp": ({"parallelism": "fsdp", "micro_batch_size": 2}, "single"),
             "fsdp_precomputed": ({"parallelism": "fsdp", "micro_batch_size": 2,
                                   "dpo_reference": "precomputed"}, "single"),
             # One pair per micro batch: the same 8 validation pairs take 4 evaluation batches.
             "ddp": ({"parallelism": "ddp", "micro_batch_size": 1, "grad_accum_steps": 2, "eval_steps": 4},
                     "single"),
             "fsdp_tensor_parallel": ({"parallelism": "fsdp", "tensor_parallel_degree": 2}, "single"),
             "fsdp_lora": ({"parallelism": "fsdp", "micro_batch_size": 2, **LORA}, "single_lora")}


@pytest.fixture(scope="module")
def shipped_pairs(tmp_path_factory) -> Path:
    """The shipped preference pairs, prepared by the CLI with a validation split."""
    output = tmp_path_factory.mktemp("shipped") / "pairs"
    code = prepare_data.main(["--input", str(PAIRS), "--tokenizer", str(TOKENIZER), "--output",
                              str(output), "--preference", "--validation-fraction", "0.1",
                              "--max-length", "64", "--workers", "1"])
    assert code == 0
    return output


@pytest.fixture(scope="module")
def dpo_runs(shipped_pairs, tmp_path_factory) -> dict[str, Path]:
    from .conftest import job_root, run_jobs

    base = tmp_path_factory.mktemp("dpo_runs")
    roots = {name: job_root(base / name, shipped_pairs, validation=True)
             for name in [*ONE_PROCESS, *TWO_RANKS]}
    run_jobs(1, [(roots[name], {**DPO_RUN, **hps}) for name, hps in ONE_PROCESS.items()], base)
    run_jobs(2, [(roots[name], {**DPO_RUN, **hps}) for name, (hps, _) in TWO_RANKS.items()], base)
    return roots


def _records(root: Path, kind: str) -> list[dict]:
    import json

    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks_train_as_one_process(name, dpo_runs):
    """The same global batch of pairs on 2 ranks (sharded, replicated, split by tensor parallel,
    or with LoRA) gives one process's loss, metrics and evaluation at every step within 1e-4."""
    reference = TWO_RANKS[name][1]
    for kind in ("train", "eval"):
        ours, expected = _records(dpo_runs[name], kind), _records(dpo_runs[reference], kind)
        assert len(ours) == len(expected) == {"train": 4, "eval": 2}[kind]
        for mine, theirs in zip(ours, expected, strict=True):
            keys = ["loss", *METRICS] if kind == "train" else ["eval_loss", *(f"eval_{m}" for m in METRICS)]
            for key in keys:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-4), (kind, key, mine["step"])
    # The policy moves away from the reference (the first step's loss is log 2, its margins 0): the
    # comparison is not one of constants.
    train = _records(dpo_runs[reference], "train")
    assert train[0]["loss"] == pytest.approx(np.log(2)) and train[0]["rewards/margins"] == 0
    assert max(abs(record["rewards/margins"]) for record in train[1:]) > 1e-3
