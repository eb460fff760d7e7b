"""GRPO with verifiable rewards: the loss on fixed completions and rewards against TRL's GRPOTrainer,
the reward functions and their errors, prompts data, and a seeded run that raises its reward."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from training_jobs import prepare_data
from training_jobs.contract.hyperparameters import ConfigError, from_hyperparameters
from training_jobs.contract.parallel_dims import resolve_cluster
from training_jobs.trainer.data import BatchLayout, TrainBatches
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.models import model_source
from training_jobs.trainer.objectives import ObjectiveContext, build_objective
from training_jobs.trainer.objectives.grpo import completion_batch
from training_jobs.trainer.objectives.grpo_loss import group_advantages
from training_jobs.trainer.prompt_data import PromptSet
from training_jobs.trainer.rewards import Rewards
from training_jobs.trainer.shards import read_manifest
from training_jobs.trainer.strategies import SetupContext, build_strategy

from .conftest import REPO, TINY, TOKENIZER, child_env, torchrun

PROMPTS = REPO / "examples" / "data" / "tiny_grpo" / "train.jsonl"
CPU = torch.device("cpu")
GROUP = 4
TOY_REWARDS = '''
def digits(prompt, completion, **fields):
    """The share of a completion's characters that are digits: a dense, verifiable toy reward."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def words(prompt, completion, **fields):
    return "many"
'''


@pytest.fixture(scope="module")
def prompts_folder(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("prompts") / "out"
    code = prepare_data.main(["--input", str(PROMPTS), "--tokenizer", str(TOKENIZER), "--output",
                              str(output), "--prompts", "--workers", "1"])
    assert code == 0
    return output


@pytest.fixture(scope="module")
def rewards_module(tmp_path_factory, monkeypatch_module) -> Path:
    folder = tmp_path_factory.mktemp("code")
    (folder / "toy_rewards.py").write_text(TOY_REWARDS)
    monkeypatch_module.syspath_prepend(str(folder))
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "rendezvous"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_prompts_are_prepared_with_their_fields(prompts_folder):
    manifest = read_manifest(prompts_folder)
    assert manifest.version == 4 and manifest.kind == "prompts" and manifest.num_documents == 500
    prompts = PromptSet(prompts_folder, 64, "train", 640)
    first = json.loads(PROMPTS.read_text().splitlines()[0])
    example = prompts.examples[0]
    assert example.prompt == first["prompt"] and example.fields == {"answer": first["answer"]}
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(TOKENIZER)).decode(example.prompt_ids) == first["prompt"]


def test_builtin_rewards_and_their_errors(rewards_module):
    def rewards(**settings):
        config = from_hyperparameters({"objective": "grpo", "parallelism": "single", **settings})
        return Rewards.from_settings(config.objective)

    exact = rewards(grpo_reward="exact_match")
    assert exact.score("p", " 7 ", {"answer": "7"}, "x") == 1.0
    assert exact.score("p", "7.", {"answer": "7"}, "x") == 0.0
    numeric = rewards(grpo_reward="numeric")
    assert numeric.score("p", "It is 3, no: 1,000.0", {"answer": "1000"}, "x") == 1.0
    assert numeric.score("p", "7 or 8", {"answer": "7"}, "x") == 0.0
    both = rewards(grpo_reward="regex,numeric", grpo_reward_regex=r"^\s*\d")
    assert both.score("p", " 7", {"answer": "7"}, "x") == 2.0
    assert both.score("p", "seven, 7", {"answer": "7"}, "x") == 1.0
    assert rewards(grpo_reward="toy_rewards:digits").score("p", "a1", {}, "x") == 0.5
    with pytest.raises(DataError, match="reward function toy_rewards:words returned 'many' for the example "
                                        "data.jsonl:3: a reward must be a finite number"):
        rewards(grpo_reward="toy_rewards:words").score("p", "c", {}, "data.jsonl:3")
    with pytest.raises(DataError, match="the numeric reward compares with the example's 'solution' field"):
        rewards(grpo_reward="numeric", grpo_answer_key="solution").score("p", "1", {"answer": "1"}, "x")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module' of 'no_such_module:f'"):
        rewards(grpo_reward="no_such_module:f")
    with pytest.raises(ConfigError, match="module 'toy_rewards' has no function 'missing'"):
        rewards(grpo_reward="toy_rewards:missing")


@pytest.mark.parametrize("settings, message", [
    ({"grpo_group_size": 1}, "'grpo_group_size': got 1, expected a value >= 2"),
    ({"parallelism": "fsdp"}, "expected one of single, ddp with objective=grpo"),
    ({"grpo_reward": "length"}, "expected one of exact_match, regex, numeric or module:function"),
    ({"grpo_reward": "regex"}, "'grpo_reward_regex': got '', expected a pattern"),
])
def test_bad_grpo_settings_are_refused_naming_them(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        from_hyperparameters({"objective": "grpo", "parallelism": "single", **settings})


def _program(prompts_folder: Path, settings: dict):
    from transformers import AutoTokenizer

    hps = {**TINY, "parallelism": "single", "objective": "grpo", "seq_len": 64, "micro_batch_size": 2,
           "grad_accum_steps": 1, "grpo_group_size": GROUP, **settings}
    config, dims = resolve_cluster(from_hyperparameters(hps), 1, 1)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    source = model_source(config.model, None, tokenizer, config.data.seq_len, "eager")
    strategy = build_strategy(SetupContext(config, source, CPU, dims))
    prompts = PromptSet(prompts_folder, config.data.seq_len, "train", source.config.vocab_size)
    train = TrainBatches(prompts, BatchLayout(1, 0, 2, 1), config.run.seed, CPU)
    objective = build_objective(ObjectiveContext(config, strategy, train, None, CPU, tokenizer))
    return strategy, objective, prompts


def _trl(policy, settings: dict, tmp_path: Path):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=GROUP, report_to=[],
                      use_cpu=True, bf16=False, num_generations=GROUP, beta=0.0,
                      epsilon=settings.get("grpo_epsilon", 0.2), loss_type=settings.get("grpo_loss", "dapo"),
                      temperature=settings.get("grpo_temperature", 1.0))
    data = Dataset.from_list([{"prompt": "a"}] * GROUP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=data,
                              processing_class=AutoTokenizer.from_pretrained(str(TOKENIZER)))
    trainer.beta = settings.get("grpo_beta", 0.0)  # TRL would load its reference from the Hub: given below
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training step, which is not run here
    return trainer


CASES = {"dapo": {}, "grpo_per_completion": {"grpo_loss": "grpo"},
         "kl": {"grpo_beta": 0.05, "grpo_temperature": 1.0},
         "temperature": {"grpo_temperature": 0.7},
         "kl_and_temperature": {"grpo_beta": 0.05, "grpo_temperature": 0.7}}


@pytest.mark.parametrize("name", CASES)
def test_loss_on_fixed_completions_equals_trl(name, prompts_folder, group_of_one, tmp_path):
    """Two prompts of the same length, four completions each of different lengths (one ending at
    the end-of-sequence id), fixed rewards: TRL's loss, KL and clipped fraction, and its gradients."""
    settings = CASES[name]
    strategy, objective, prompts = _program(prompts_folder, settings)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy away from its initial weights (the KL's reference)
        for parameter in strategy.hf_model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    prompt_ids = [prompts.examples[0].prompt_ids] * GROUP + [prompts.examples[1].prompt_ids] * GROUP
    assert len(set(map(len, prompt_ids))) == 1
    completions = [torch.randint(1, 600, (length,), generator=generator).tolist()
                   for length in (5, 3, 6, 2, 6, 4, 1, 6)]
    completions[1].append(prompts.manifest.eos_token_id)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.0, 0.4])
    advantages, _ = group_advantages(rewards, GROUP)

    batch = completion_batch(prompt_ids, completions, prompts.manifest.eos_token_id, CPU)
    loss_fn = objective.rollout_loss([batch], [advantages], rewards)
    loss = float(strategy.forward_backward([batch], loss_fn))
    metrics = objective.window_metrics()

    trainer = _trl(copy.deepcopy(strategy.hf_model), settings, tmp_path)
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    prompt_tensor = torch.tensor(prompt_ids)
    inputs = {"prompt_ids": prompt_tensor, "prompt_mask": torch.ones_like(prompt_tensor),
              "completion_ids": completion_ids, "completion_mask": completion_mask,
              "advantages": advantages, "num_items_in_batch": completion_mask.sum()}
    if settings.get("grpo_beta"):
        from trl.trainer.utils import add_fused_lm_head

        initial = _program(prompts_folder, {})[0].hf_model  # the seeded initial model
        add_fused_lm_head(initial, temperature=settings["grpo_temperature"])  # as TRL's reference
        with torch.no_grad():
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                initial, torch.cat([prompt_tensor, completion_ids], 1),
                torch.cat([torch.ones_like(prompt_tensor), completion_mask], 1), width)
    trainer.model.train()
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()

    assert loss == pytest.approx(float(expected), abs=1e-5)
    trl_metrics = trainer._metrics["train"]
    expected_kl = trl_metrics["kl"][-1] if settings.get("grpo_beta") else 0.0
    assert metrics["kl"] == pytest.approx(expected_kl, abs=1e-5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][-1],
                                                              abs=1e-6)
    assert metrics["reward"] == pytest.approx(float(rewards.mean()))
    assert metrics["completions/mean_length"] == pytest.approx(sum(map(len, completions)) / 8)
    for (key, ours), (_, theirs) in zip(strategy.hf_model.named_parameters(),
                                        trainer.model.named_parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda text, key=key: f"{key}: {text}")
    assert any(p.grad.abs().sum() > 0 for p in strategy.hf_model.parameters())


def test_group_advantages_are_trls():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.0, 0.4])
    grouped = rewards.view(-1, GROUP)
    expected = (rewards - grouped.mean(1).repeat_interleave(GROUP)) / (
        nanstd(grouped, dim=1).repeat_interleave(GROUP) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, GROUP)[0], expected)


@pytest.mark.slow
def test_a_seeded_run_raises_its_reward(prompts_folder, rewards_module, tmp_path):
    """The program end to end (one process): sampling from a tiny random model, a reward function
    named by module:function, group-relative advantages; the mean reward rises within 20 steps."""
    from .conftest import MULTIRUN

    root = tmp_path / "grpo"
    (root / "input" / "data").mkdir(parents=True)
    (root / "input" / "data" / "train").symlink_to(prompts_folder, target_is_directory=True)
    hps = {**TINY, "objective": "grpo", "parallelism": "single", "seq_len": 64, "micro_batch_size": 4,
           "grad_accum_steps": 1, "max_steps": 20, "log_every_steps": 5, "lr": 1e-2, "warmup_steps": 0,
           "lr_schedule": "constant",
           "grpo_group_size": 8, "grpo_max_new_tokens": 8, "grpo_reward": "toy_rewards:digits"}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"root": str(root), "hyperparameters": hps, "environment": {}}]))
    completed = torchrun(1, MULTIRUN, [str(spec)], env=child_env(PYTHONPATH=f"{rewards_module}:{REPO}"))
    assert completed.returncode == 0, completed.output[-4000:]
    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert len(records) == 4
    assert records[-1]["reward"] > records[0]["reward"] + 0.2, [r["reward"] for r in records]
    assert all(r["completions/mean_length"] <= 8 and r["clip_ratio/region_mean"] == 0 for r in records)


def test_a_reward_that_returns_no_number_stops_the_job_before_training(prompts_folder, rewards_module,
                                                                       group_of_one):
    with pytest.raises(DataError, match=r"reward function toy_rewards:words returned 'many' for the example "
                                        r".*tiny_grpo/train.jsonl:1: a reward must be a finite number"):
        _program(prompts_folder, {"grpo_reward": "toy_rewards:words"})


def test_clipping_equals_trl_where_the_samples_came_from_older_weights(prompts_folder, group_of_one,
                                                                       tmp_path):
    """The surrogate's clipping (inactive when the program samples and trains once) against TRL with
    log-probabilities of the sampling policy that differ from the current ones."""
    from training_jobs.trainer.loss import token_cross_entropy
    from training_jobs.trainer.objectives.grpo_loss import averaged, token_loss

    strategy, _, prompts = _program(prompts_folder, {})
    generator = torch.Generator().manual_seed(5)
    prompt_ids = [prompts.examples[2].prompt_ids] * GROUP
    completions = [torch.randint(1, 600, (length,), generator=generator).tolist() for length in (4, 2, 5, 3)]
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 0.3, 0.8]), GROUP)
    inputs, targets = completion_batch(prompt_ids, completions, prompts.manifest.eos_token_id, CPU)
    mask = targets != -100
    logps = -token_cross_entropy(strategy.hf_model(input_ids=inputs).logits, targets)
    old = (logps.detach() + torch.randn(logps.shape, generator=generator) * 0.3) * mask
    terms = token_loss(logps, old, None, advantages, 0.2, 0.0)
    ours = averaged(terms.loss, mask, "dapo", mask.sum().float())
    clipped = float((terms.clipped & mask).sum() / mask.sum())

    trainer = _trl(copy.deepcopy(strategy.hf_model), {}, tmp_path)
    width = max(map(len, completions))
    start = len(prompt_ids[0]) - 1
    completion_mask = mask[:, start:start + width].long()
    prompt_tensor = torch.tensor(prompt_ids)
    expected = trainer._compute_loss(trainer.model, {
        "prompt_ids": prompt_tensor, "prompt_mask": torch.ones_like(prompt_tensor),
        "completion_ids": torch.tensor([c + [0] * (width - len(c)) for c in completions]),
        "completion_mask": completion_mask, "advantages": advantages,
        "old_per_token_logps": old[:, start:start + width], "num_items_in_batch": completion_mask.sum()})
    assert float(ours) == pytest.approx(float(expected), abs=1e-5)
    assert 0 < clipped == pytest.approx(trainer._metrics["train"]["clip_ratio/region_mean"][-1], abs=1e-6)


@pytest.mark.slow
def test_ddp_with_lora_and_a_kl_penalty_trains_resumes_and_exports(prompts_folder, tmp_path):
    """2 ranks, LoRA adapters, the KL to the base (adapters off), a built-in reward: the job runs,
    reports its KL, resumes from its checkpoint and exports the adapter."""
    from .conftest import outcome, run_jobs, train_records

    root = tmp_path / "ddp"
    (root / "input" / "data").mkdir(parents=True)
    (root / "input" / "data" / "train").symlink_to(prompts_folder, target_is_directory=True)
    hps = {**TINY, "objective": "grpo", "parallelism": "ddp", "seq_len": 64, "micro_batch_size": 2,
           "grad_accum_steps": 2, "max_steps": 2, "checkpoint_every_steps": 2, "lr": 1e-2,
           "grpo_group_size": 4, "grpo_max_new_tokens": 6, "grpo_reward": "regex",
           "grpo_reward_regex": r"\d", "grpo_beta": 0.05, "lora_r": 4, "lora_alpha": 8}
    run_jobs(2, [(root, hps)], tmp_path)
    run_jobs(2, [(root, {**hps, "max_steps": 4})], tmp_path)  # resumes at step 2
    assert outcome(root)["ok"]
    records = train_records(root)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["kl"] == 0 and records[-1]["kl"] > 0  # the adapters move the policy off the base
    assert all(r["completions/mean_length"] <= 6 for r in records)
    assert (root / "model" / "adapter_model.safetensors").is_file()
