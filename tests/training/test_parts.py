"""The parts of the training program that need no process group: schedule, optimizer groups,
metrics lines, FLOPs, the container environment, checkpoint discovery, DeepSpeed and SMP v2
configuration, model presets."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from training_jobs.contract.hyperparameters import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    from_hyperparameters,
)
from training_jobs.trainer import checkpoint, metrics, models, optim, parallel
from training_jobs.trainer.environment import read_environment
from training_jobs.trainer.errors import CheckpointError, ContainerError, TrainingError
from training_jobs.trainer.loss import causal_lm_loss
from training_jobs.trainer.strategies import smp
from training_jobs.trainer.strategies.deepspeed_zero import deepspeed_config


def _config(**hps):
    return from_hyperparameters({"model_preset": "llama-tiny", **hps})


# --- schedule and optimizer ---

def test_warmup_then_cosine_to_min_lr():
    config = _config(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    factor = optim.lr_multiplier(config, peak=1.0)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert factor(14) == pytest.approx(0.1) and factor(100) == pytest.approx(0.1)


def test_linear_constant_and_pinned_decay_horizon():
    linear = optim.lr_multiplier(_config(lr=1.0, lr_schedule="linear", max_steps=10), peak=1.0)
    assert [linear(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    constant = optim.lr_multiplier(_config(lr_schedule="constant", warmup_steps=2), peak=3e-4)
    assert constant(500) == 1.0
    staged = optim.lr_multiplier(_config(lr=1.0, lr_schedule="linear", max_steps=3, lr_decay_steps=10),
                                 peak=1.0)
    assert staged(2) == linear(2)  # the first stage of a longer run follows the long schedule


def _trained_optimization(config, steps: int):
    from training_jobs.trainer.strategies.optimization import Optimization

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimization = Optimization(config, [model], torch.device("cpu"), data_parallel_size=1)
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        optimization.step(lambda max_norm: torch.tensor(0.0))
    return optimization


def test_a_resumed_schedule_of_another_length_sets_the_optimizers_rate_from_the_new_schedule():
    """A run trained 3 steps on a 3-step schedule resumes with max_steps=10 (no lr_decay_steps): its
    first resumed step trains at the 10-step schedule's rate for step 3, as an uninterrupted 10-step
    run does, not at the rate the 3-step schedule left in the optimizer's saved state."""
    short = _config(lr=1.0, lr_schedule="linear", warmup_steps=1, max_steps=3)
    longer = _config(lr=1.0, lr_schedule="linear", warmup_steps=1, max_steps=10)
    saved = _trained_optimization(short, 3)
    resumed = _trained_optimization(longer, 0)
    resumed.optimizers[0].load_state_dict(saved.optimizers[0].state_dict())
    resumed.load_scheduler(saved.scheduler_state())
    uninterrupted = _trained_optimization(longer, 3)
    expected = optim.lr_multiplier(longer, peak=1.0)(3)
    assert saved.optimizers[0].param_groups[0]["lr"] == 0.0  # the short schedule ended its decay
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected) == pytest.approx(7 / 9)
    assert resumed.current_lr() == pytest.approx(expected)
    assert uninterrupted.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected)
    resumed.step(lambda max_norm: torch.tensor(0.0))  # the next step continues on the new schedule
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(optim.lr_multiplier(longer, 1.0)(4))


def test_lr_scales_with_global_batch_when_asked():
    assert optim.peak_lr(_config(lr=6e-4, scale_lr_by_global_batch=True), 512) == pytest.approx(1.2e-3)
    assert optim.peak_lr(_config(lr=6e-4), 512) == 6e-4


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = optim.parameter_groups(model.named_parameters(), weight_decay=0.1)
    decayed = [g for g in groups if g["weight_decay"] == 0.1]
    assert [p.shape for g in decayed for p in g["params"]] == [torch.Size([4, 4])]
    assert sum(len(g["params"]) for g in groups) == 4


# --- metrics ---

# The regexes a job template's MetricDefinitions use (docs/architecture.md, "Metric lines").
METRIC_REGEXES = {
    "loss": r"\[metrics\].* loss=([0-9.eE+-]+)",
    "lr": r"\[metrics\].* lr=([0-9.eE+-]+)",
    "grad_norm": r"grad_norm=([0-9.eE+-]+)",
    "tokens_per_sec": r"tokens_per_sec=([0-9.eE+-]+)",
    "mfu": r"mfu=([0-9.eE+-]+)",
    "step_time": r"step_time=([0-9.eE+-]+)",
    "memory_gb": r"memory_gb=([0-9.eE+-]+)",
    "eval_loss": r"\[eval\].* eval_loss=([0-9.eE+-]+)",
}


def test_metric_lines_match_the_contract_and_json_lines_agree(tmp_path, capsys):
    logger = metrics.MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    values = {"step": 10, "loss": 4.1234561, "lr": 3e-4, "grad_norm": 1.23451, "tokens_per_sec": 12345.67,
              "mfu": 0.41234, "step_time": 0.5321, "memory_gb": 1.234}
    logger.train(values)
    logger.eval({"step": 10, "eval_loss": 3.9876543})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[metrics] step=10 loss=4.123456 lr=3.000e-04 grad_norm=1.2345 "
                     "tokens_per_sec=12345.7 mfu=0.4123 step_time=0.532 memory_gb=1.23",
                     "[eval] step=10 eval_loss=3.987654"]
    text = "\n".join(lines)
    for name, regex in METRIC_REGEXES.items():
        assert re.search(regex, text), name
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"kind": "train", **values}
    assert records[1] == {"kind": "eval", "step": 10, "eval_loss": 3.9876543}
    assert list((tmp_path / "tensorboard").iterdir())  # event files


def test_compile_mode_uses_cuda_graphs_only_where_they_apply():
    def config(**raw):
        return from_hyperparameters({"model_preset": "llama-tiny", "compile": True,
                                     "parallelism": "single", "grad_accum_steps": 1, **raw})

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert parallel.compile_mode(config(), cuda) == "reduce-overhead"
    assert parallel.compile_mode(config(), cpu) is None
    assert parallel.compile_mode(config(parallelism="ddp"), cuda) is None  # DDP hooks the gradients
    assert parallel.compile_mode(config(grad_accum_steps=2), cuda) is None
    assert parallel.compile_mode(config(compile_mode="default"), cuda) is None
    with pytest.raises(ConfigError, match="compile_mode=cuda_graphs needs a CUDA GPU"):
        parallel.compile_mode(config(compile_mode="cuda_graphs"), cpu)


def test_flops_per_token_and_peaks():
    assert metrics.flops_per_token(1_000_000, num_layers=2, hidden_size=64, seq_len=128) == \
        6e6 + 12 * 2 * 64 * 128
    assert metrics.table_peak_flops("ml.p5.48xlarge") == 989e12
    assert metrics.table_peak_flops("ml.p4d.24xlarge") == 312e12
    assert metrics.table_peak_flops("local") is None
    assert metrics.device_name_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.device_name_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert metrics.device_name_peak_flops("NVIDIA L40S") == 362e12  # not L4's
    assert metrics.device_name_peak_flops("NVIDIA L4") == 121e12
    assert metrics.device_name_peak_flops("Some Future GPU") is None
    assert metrics.measured_peak_flops(torch.device("cpu"), torch.float32, size=128, repeats=2) > 1e6


def test_the_cpu_peak_measures_only_dtypes_the_cpu_has_matmul_kernels_for(monkeypatch):
    """A bf16 job on a CPU without bf16 kernels (AVX2 only) took ~8 s per rank measuring a bf16 peak
    ~50x below fp32's, which the maximum then discarded."""
    measured = []
    real = metrics.measured_peak_flops

    def spy(device, dtype, size):
        measured.append(dtype)
        return real(device, dtype, size, repeats=1)

    monkeypatch.setattr(metrics, "measured_peak_flops", spy)
    peak = metrics.measured_peak(torch.device("cpu"), {torch.float32, torch.bfloat16, torch.float16}, 128)
    expected = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        expected.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        expected.add(torch.float16)
    assert sorted(map(str, measured)) == sorted(map(str, expected)) and peak > 1e6


# --- container environment ---

def test_environment_from_sagemaker_variables(tmp_path):
    env = read_environment(["--lr", "1"], {
        "SAGEMAKER_BASE_DIR": str(tmp_path), "SM_HPS": json.dumps({"lr": 0.5, "mp_parameters": {"a": 1}}),
        "SM_CHANNEL_TRAIN": "/data/train", "SM_CHANNEL_VALIDATION": "/data/val",
        "SM_MODEL_DIR": "/m", "SM_OUTPUT_DATA_DIR": "/o", "SM_HOSTS": '["algo-1", "algo-2"]',
        "SM_CURRENT_HOST": "algo-2", "SM_CURRENT_INSTANCE_TYPE": "ml.p5.48xlarge",
        "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert env.hyperparameters == {"lr": 0.5, "mp_parameters": {"a": 1}}  # SM_HPS wins, lossless
    assert env.channels == {"train": tmp_path.__class__("/data/train"),
                            "validation": tmp_path.__class__("/data/val")}
    assert str(env.model_dir) == "/m" and str(env.output_data_dir) == "/o"
    assert env.checkpoint_dir == tmp_path / "checkpoints"
    assert (env.current_host, env.num_hosts, env.rank, env.local_rank, env.world_size) == \
        ("algo-2", 2, 9, 1, 16)
    assert not env.is_main and not env.is_local_main


def test_environment_falls_back_to_the_job_root_layout(tmp_path):
    (tmp_path / "input" / "data" / "train").mkdir(parents=True)
    env = read_environment(["--max_steps", "3"], {"SAGEMAKER_BASE_DIR": str(tmp_path)})
    assert env.hyperparameters == {"max_steps": "3"} and env.hyperparameter_source == "command line"
    assert env.channels == {"train": tmp_path / "input" / "data" / "train"}
    assert env.model_dir == tmp_path / "model" and env.output_data_dir == tmp_path / "output" / "data"
    assert env.world_size == 1 and env.is_main


def test_outside_a_container_without_a_job_root_is_a_clear_error(monkeypatch, tmp_path):
    from training_jobs.trainer import environment

    monkeypatch.setattr(environment, "DEFAULT_BASE_DIR", tmp_path / "no-opt-ml")
    with pytest.raises(ContainerError, match="set SAGEMAKER_BASE_DIR"):
        read_environment([], {})


# --- checkpoint discovery ---

def _fake_checkpoint(root, step, files, complete=True):
    folder = root / checkpoint.folder_name(step)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if complete:
        listed = {name: len(data) for name, data in files.items()}
        (folder / checkpoint.MARKER).write_text(json.dumps({"step": step, "files": listed}))
    return folder


def test_only_complete_checkpoints_are_found_newest_last(tmp_path):
    _fake_checkpoint(tmp_path, 10, {"a.distcp": b"1234"})
    _fake_checkpoint(tmp_path, 20, {"a.distcp": b"1234"})
    _fake_checkpoint(tmp_path, 30, {"a.distcp": b"1234"}, complete=False)
    damaged = _fake_checkpoint(tmp_path, 40, {"a.distcp": b"1234"})
    (damaged / "a.distcp").write_bytes(b"12")  # a partial sync: the marker lists 4 bytes
    (tmp_path / ".tmp-step_00000050").mkdir()
    (tmp_path / "unrelated").mkdir()
    found = checkpoint.scan(tmp_path)
    assert [step for step, _ in found.complete] == [10, 20]
    assert sorted(p.name for p in found.incomplete) == [".tmp-step_00000050", "step_00000030",
                                                         "step_00000040"]
    assert checkpoint.latest_complete(tmp_path).name == "step_00000020"
    store = checkpoint.CheckpointStore(tmp_path, keep=1, rank=0, local_main=True)
    store.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020", "unrelated"]


def test_a_hosts_share_of_a_committed_checkpoint_is_kept_but_not_resumed_from(tmp_path):
    """Without a shared file system each host holds its own ranks' files (SageMaker merges the
    hosts' folders in S3): pruning must keep them, resuming needs the union."""
    folder = _fake_checkpoint(tmp_path, 10, {"__0_0.distcp": b"1234", "__1_0.distcp": b"5678"})
    (folder / "__1_0.distcp").unlink()  # written by the other host
    checkpoint.CheckpointStore(tmp_path, keep=3, rank=0, local_main=True).prune()
    assert (folder / "__0_0.distcp").is_file()
    assert checkpoint.latest_complete(tmp_path) is None


class ControlledWrites:
    """A strategy whose background writes finish when the test says so (the real DCP writes are
    checked end to end in test_checkpoint_resume.py)."""

    def __init__(self):
        self.writes: dict[Path, Future] = {}

    def save_checkpoint(self, folder, background_group=None):
        (folder / "__0_0.distcp").write_bytes(b"weights")
        if background_group is None:
            return None
        self.writes[folder] = Future()
        return self.writes[folder]


def test_a_background_save_is_committed_only_once_its_writes_are_done(tmp_path, group_of_one):
    root = tmp_path / "checkpoints"
    strategy = ControlledWrites()
    store = checkpoint.CheckpointStore(root, keep=2, rank=0, local_main=True, background_writes=True)
    final = store.save(5, strategy, {"step": 5}, wait=False)
    assert not final.exists() and checkpoint.latest_complete(root) is None
    assert store.poll_pending() is None  # still writing: nothing to resume from yet
    strategy.writes[root / ".tmp-step_00000005"].set_result(None)
    assert store.poll_pending() == final and checkpoint.is_complete(final)
    assert store.pending is None

    store.save(6, strategy, {"step": 6}, wait=False)
    strategy.writes[root / ".tmp-step_00000006"].set_exception(OSError("No space left on device"))
    with pytest.raises(CheckpointError, match="step 6 .* failed on this rank: No space left"):
        store.poll_pending()
    assert checkpoint.latest_complete(root) == final  # the failed one never counts

    store.save(7, strategy, {"step": 7}, wait=False)
    strategy.writes[root / ".tmp-step_00000007"].set_result(None)
    store.save(8, strategy, {"step": 8}, wait=True)  # finishes the save in flight first
    assert [step for step, _ in checkpoint.scan(root).complete] == [7, 8]  # keep=2

    store.save(9, strategy, {"step": 9}, wait=False)
    store.abandon_pending(timeout_s=0.1)  # a job stopping with an error: never committed
    assert store.pending is None and checkpoint.latest_complete(root).name == "step_00000008"


def test_resuming_into_another_model_is_refused():
    state = {"hyperparameters": {"model_preset": "llama-1b", "lora_r": 0}}
    with pytest.raises(TrainingError, match="written with model_preset='llama-1b'"):
        checkpoint.check_resumable(state, _config(model_preset="llama-7b").flat())
    checkpoint.check_resumable(state, _config(model_preset="llama-1b", max_steps=99).flat())


# --- DeepSpeed and SMP v2 configuration ---

def test_deepspeed_config_translation():
    config = _config(parallelism="deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True,
                     micro_batch_size=2, grad_accum_steps=4, max_grad_norm=0.5)
    ds = deepspeed_config(config, data_parallel_size=8, on_gpu=True)
    assert ds["train_batch_size"] == 64 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.5
    plain = deepspeed_config(_config(parallelism="deepspeed", mixed_precision="fp32", max_grad_norm=0),
                             data_parallel_size=2, on_gpu=False)
    assert "offload_optimizer" not in plain["zero_optimization"] and plain["gradient_clipping"] == 0
    assert not plain["bf16"]["enabled"] and not plain["zero_optimization"]["overlap_comm"]


def test_smp_translation_from_named_settings_and_mp_parameters():
    par = ParallelConfig(parallelism="smp", shard_degree=8, tensor_parallel_degree=2,
                         activation_offloading=True, fsdp_sharding="hybrid",
                         activation_checkpointing="full",
                         mp_parameters={"activation_loading_horizon": 4, "tensor_parallel_degree": 2})
    plan = smp.smp_plan(par, seed=7, world_size=32)
    assert plan.init_config == {"activation_loading_horizon": 4, "tensor_parallel_degree": 2,
                                "hybrid_shard_degree": 8, "sm_activation_offloading": True,
                                "random_seed": 7}
    assert plan.sharding_strategy == "HYBRID_SHARD" and plan.activation_checkpointing == "full"
    sdk_only = smp.smp_plan(ParallelConfig(parallelism="smp", mp_parameters={"hybrid_shard_degree": 4,
                                                                              "random_seed": 1}), 7, 16)
    assert sdk_only.init_config == {"hybrid_shard_degree": 4, "random_seed": 1}


@pytest.mark.parametrize(("par", "message"), [
    (ParallelConfig(parallelism="smp", shard_degree=4, mp_parameters={"hybrid_shard_degree": 8}),
     "'shard_degree': 4 conflicts with mp_parameters hybrid_shard_degree=8"),
    (ParallelConfig(parallelism="smp", mp_parameters={"tensor_parallel_degree": "2"}), "an integer"),
    (ParallelConfig(parallelism="smp", tensor_parallel_degree=3), "must divide the world size 16"),
    (ParallelConfig(parallelism="smp", shard_degree=3), "hybrid_shard_degree 3 must divide"),
])
def test_smp_translation_rejects_inconsistent_settings(par, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        smp.smp_plan(par, seed=0, world_size=16)


def test_smp_outside_an_smp_container_is_a_clear_error():
    with pytest.raises(ContainerError, match="torch.sagemaker"):
        smp.import_smp()


# --- models ---

@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(None, None)[0]


@pytest.mark.parametrize(("preset", "billions"), [("llama-7b", 6.7), ("llama-13b", 13.0),
                                                  ("llama-70b", 69.0), ("gpt2-xl", 1.56),
                                                  ("llama3-8b", 8.03), ("llama3-70b", 70.55),
                                                  ("llama3-405b", 405.85)])
def test_large_presets_have_their_nominal_size(tokenizer, preset, billions):
    config = models.preset_config(ModelConfig(model_preset=preset), tokenizer, seq_len=2048)
    if preset.startswith("llama"):  # their own tokenizers
        config.vocab_size = 32000 if preset in ("llama-7b", "llama-13b") else 128256
    else:
        config.vocab_size = 50257
    model = models.build_model(models.ModelSource(config, None, preset), materialize=False, seed=0)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.03)


def test_presets_follow_the_tokenizer_and_overrides(tokenizer):
    config = models.preset_config(ModelConfig(model_preset="gpt2-tiny",
                                              model_overrides={"n_layer": 3}), tokenizer, seq_len=256)
    assert config.vocab_size == 640 and config.n_positions == 256 and config.n_layer == 3
    assert config.eos_token_id == tokenizer.eos_token_id and config.resid_pdrop == 0.0
    with pytest.raises(ConfigError, match="'num_layers' is not a field of GPT2Config"):
        models.preset_config(ModelConfig(model_preset="gpt2-tiny", model_overrides={"num_layers": 3}),
                             tokenizer, seq_len=256)
    # A family's alias of a field (Qwen3-MoE's num_experts is num_local_experts) is a field too.
    moe = models.preset_config(ModelConfig(model_preset="qwen3-moe-tiny", model_overrides={"num_experts": 4}),
                               tokenizer, seq_len=256)
    assert moe.num_experts == 4


def test_model_channel_without_a_config_is_refused(tokenizer, tmp_path):
    with pytest.raises(ContainerError, match="holds no config.json"):
        models.model_source(ModelConfig(), tmp_path, tokenizer, seq_len=32)


def test_decoder_layers_are_found_under_peft_and_checkpoint_wrappers(tokenizer):
    from training_jobs.contract.hyperparameters import LoraConfig
    from training_jobs.trainer import parallel
    from training_jobs.trainer.lora import apply_lora

    source = models.model_source(ModelConfig(model_preset="llama-tiny"), None, tokenizer, 32)
    model = apply_lora(models.build_model(source, materialize=True, seed=0), LoraConfig(lora_r=2))
    assert parallel.apply_activation_checkpointing(model, "full", every=2) == 1
    layers = models.decoder_layers(model)
    assert len(layers) == 2 and hasattr(layers[0], "_checkpoint_wrapped_module")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_tensor_and_context_parallel_need_the_llama_layout(tokenizer):
    from training_jobs.trainer import parallel, tensor_parallel

    source = models.model_source(ModelConfig(model_preset="gpt2-tiny"), None, tokenizer, 32)
    gpt2 = models.build_model(source, materialize=False, seed=0)
    with pytest.raises(ConfigError, match="gpt2 models have no supported tensor-parallel plan"):
        tensor_parallel.check_supported(gpt2, 2)
    with pytest.raises(ConfigError, match="'context_parallel_degree': gpt2 models cannot split"):
        parallel.check_context_parallel(gpt2)
    llama = models.build_model(models.model_source(ModelConfig(model_preset="llama-tiny"), None, tokenizer,
                                                   32), materialize=False, seed=0)
    with pytest.raises(ConfigError, match="3 does not divide the model's num_attention_heads"):
        tensor_parallel.check_supported(llama, 3)
    tensor_parallel.check_supported(llama, 2)


def test_attention_auto_is_eager_only_when_compiling_on_a_cpu():
    pick = models.attention_implementation
    assert pick("auto", compiled=True, device_type="cpu") == "eager"
    assert pick("auto", compiled=False, device_type="cpu") == "sdpa"
    assert pick("auto", compiled=True, device_type="cuda") == "sdpa"
    assert pick("sdpa", compiled=True, device_type="cpu") == "sdpa"
    assert pick("eager", compiled=False, device_type="cuda") == "eager"
    with pytest.raises(ConfigError, match="'attention'"):
        from_hyperparameters({"attention": "flash"})


def test_eager_and_sdpa_attention_compute_the_same_model(tokenizer):
    config = models.preset_config(ModelConfig(model_preset="llama-tiny"), tokenizer, seq_len=32)
    inputs = torch.randint(0, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for attention in ("eager", "sdpa"):
        source = models.ModelSource(config, None, "llama-tiny", attention)
        model = models.build_model(source, materialize=True, seed=0)
        assert model.config._attn_implementation == attention
        losses[attention] = causal_lm_loss(models.forward_logits(model, inputs), inputs)
    assert losses["eager"].item() == pytest.approx(losses["sdpa"].item(), abs=1e-5)


def test_qlora_needs_a_replicating_strategy_and_a_checkpoint_to_quantize():
    from training_jobs.trainer.lora import check_quantization

    qlora = _config(lora_r=8, quantization="nf4").lora
    with pytest.raises(ConfigError, match="nf4 runs with parallelism single or ddp, not fsdp"):
        check_quantization(qlora, "fsdp", has_checkpoint=True)
    with pytest.raises(ConfigError, match="nf4 quantizes the checkpoint in the model channel"):
        check_quantization(qlora, "ddp", has_checkpoint=False)
    check_quantization(qlora, "ddp", has_checkpoint=True)
    check_quantization(_config().lora, "fsdp", has_checkpoint=False)


def test_adamw_uses_the_fused_kernel_on_cpu():
    model = torch.nn.Linear(4, 4)
    optimizer = optim.build_optimizer(model, from_hyperparameters({}).optim, lr=1e-3)
    assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]
