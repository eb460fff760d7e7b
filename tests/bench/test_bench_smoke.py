"""The benchmark harness keeps working: a tiny end-to-end run, and its pure parts.

No timing assertions: benchmarks are not tests. The run uses the `tiny` mode (the llama-tiny preset,
a few steps) on a subset of configurations that covers every runner (our program through torchrun,
the HF Trainer, the plain loop) and every extra measurement but `cdk synth`.
It checks that the JSON has the documented keys with sane types, and that the report renders.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import report
from bench.derive import lookup
from bench.flops import model_shape
from bench.model import build_causal_lm
from bench.run import main
from bench.timing import stall_per_event, step_times

SUBSET = ["ours_bf16", "hf_trainer_bf16", "plain_loop_bf16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    assert main(["--mode", "tiny", "--out", str(out), "--only", *SUBSET]) == 0
    return json.loads(out.read_text())


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_every_selected_configuration_is_measured(results):
    assert sorted(results["configs"]) == sorted(SUBSET)
    for name, record in results["configs"].items():
        assert record["status"] == "ok", f"{name}: {record.get('error')}"
        for key in ("tokens_per_s", "step_time_s", "mfu", "peak_rss_gb"):
            assert _positive(record[key]), (name, key, record[key])
        assert record["step_times_s"] and all(_positive(t) for t in record["step_times_s"])
        assert math.isfinite(record["final_loss"])
    assert results["configs"]["hf_trainer_bf16"]["ratio_to_hf_trainer"] == 1.0


@pytest.mark.slow
def test_headline_keys_are_present(results):
    assert _positive(results["ratios"]["ours_vs_hf_trainer"])
    assert results["ratios"]["fsdp2_vs_ddp"] is None  # neither was in the subset
    assert _positive(results["mfu"]["ours_bf16"])
    checkpoint = results["checkpoint"]
    assert checkpoint["status"] == "ok", checkpoint.get("error")
    assert isinstance(checkpoint["stall_fraction"], float) and checkpoint["stall_fraction"] < 1
    assert checkpoint["checkpoints_written"], "the checkpointing run wrote no checkpoint"
    assert _positive(results["data_loader"]["ratio_to_consumption"])
    assert results["cdk_synth"]["status"] == "skipped"
    assert results["dpo"]["status"] == "ok", results["dpo"]
    assert _positive(results["dpo"]["ratio"]) and _positive(results["dpo"]["cpu_ratio"])
    for dtype in ("fp32", "bf16"):
        assert _positive(results["peak"][dtype]["peak_flops"])
    assert {"cpu", "versions", "logical_cpus"} <= set(results["machine"])
    assert results["command"].startswith("python -m bench.run --mode tiny")
    assert {t["key"] for t in results["targets"]} >= {"ratios.ours_vs_hf_trainer", "mfu.ours_bf16"}
    one_round = results["ratios_by_round"]["ours_vs_hf_trainer"]
    # One round: the same ratio, up to the 0.1 ms rounding of the recorded step times.
    assert one_round == [pytest.approx(results["ratios"]["ours_vs_hf_trainer"], rel=0.02)]


@pytest.mark.slow
def test_report_renders_table_and_plot(results, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{report.START}\nold\n{report.END}\n\nhand-written tail\n")
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps(results))
    plot = tmp_path / "img" / "plot.png"
    assert report.main([str(results_path), "--doc", str(doc), "--plot", str(plot)]) == 0
    text = doc.read_text()
    assert "old" not in text and text.endswith("hand-written tail\n")
    assert "| ours_bf16 | 1 | bf16 |" in text and "](img/plot.png)" in text
    assert "TRL's DPOTrainer" in text and "`dpo.ratio`" in text
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_step_times_and_stalls_from_line_arrivals():
    lines = [(0.0, "[train] starting"), (1.0, "[bench] step=1"), (2.0, "[bench] step=2"),
             (3.0, "[metrics] step=3 loss=1.0"), (6.5, "[metrics] step=4 loss=1.0"),
             (7.5, "[metrics] step=5 loss=1.0"), (8.5, "[metrics] step=6 loss=1.0"),
             (12.5, "[metrics] step=8 loss=1.0")]
    times = step_times(lines)
    assert times.steps == [1, 2, 3, 4, 5, 6, 8]
    assert times.intervals == [1.0, 1.0, 3.5, 1.0, 1.0, 2.0]  # the 2-step gap is split evenly
    assert times.after_warmup(3) == [3.5, 1.0, 1.0, 2.0]
    assert times.median_after_warmup(3) == 1.5
    # A save at step 4: steps 4 and 5 took 3.5 + 1.0 s where two ordinary steps take 2 x 1.0 s.
    assert stall_per_event(times, {4}, warmup_steps=1) == [pytest.approx(2.5)]


def test_step_numbers_must_increase():
    with pytest.raises(ValueError, match="must increase"):
        step_times([(0.0, "[bench] step=2"), (1.0, "[bench] step=1")])


def test_model_flops_follow_the_palm_formula():
    model = build_causal_lm("llama-tiny", seq_len=32)
    shape = model_shape(model, seq_len=32)
    config = model.config
    embedding = config.vocab_size * config.hidden_size
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.non_embedding_parameters == shape.parameters - embedding  # untied output counted
    assert (config.num_hidden_layers, config.hidden_size) == (2, 64)
    assert shape.flops_per_token == 6 * shape.non_embedding_parameters + 12 * 2 * 64 * 32


def test_targets_are_judged_per_round_as_well_as_pooled():
    from bench import derive

    def record(runner, precision, rounds):
        pooled = sorted(rounds)[len(rounds) // 2]
        return {"status": "ok", "runner": runner, "precision": precision, "step_time_s": pooled,
                "tokens_per_s": 1000 / pooled, "round_step_times_s": rounds, "mfu": 0.5 / pooled}

    configs = {"ours_bf16": record("ours", "bf16", [0.8, 1.0]),
               "hf_trainer_bf16": record("hf_trainer", "bf16", [1.0, 1.05])}
    results = {"configs": configs, "ratios": derive.ratios(configs),
               "ratios_by_round": derive.ratios_by_round(configs), "mfu": derive.mfu_table(configs)}
    assert results["ratios_by_round"]["ours_vs_hf_trainer"] == [pytest.approx(1.25), pytest.approx(1.05)]
    assert results["ratios_by_round"]["fsdp2_vs_ddp"] is None
    by_key = {t["key"]: t for t in derive.targets(results)}
    ratio = by_key["ratios.ours_vs_hf_trainer"]
    assert ratio["met"] is False and ratio["met_every_round"] is False  # 1.05 pooled; 1.25 then 1.05
    mfu = by_key["mfu.ours_bf16"]
    assert mfu["by_round"] == [pytest.approx(0.625), pytest.approx(0.5)]
    assert mfu["met_every_round"] is False
    assert by_key["ratios.fsdp2_vs_ddp"]["met"] is None and by_key["ratios.fsdp2_vs_ddp"]["by_round"] is None


@pytest.mark.slow
def test_the_dpo_side_by_side_is_well_formed(results):
    """bench.run's DPO part (bench.dpo.side_by_side, as `python -m bench.dpo` runs it): both sides
    trained DPO and the ratio and its report line follow from their step times."""
    result = results["dpo"]
    for side in ("ours", "trl"):
        record = result[side]
        assert record["status"] == "ok", record.get("error")
        assert _positive(record["step_time_s"]) and _positive(record["pairs_per_s"])
        assert record["step_times_s"] and all(_positive(t) for t in record["step_times_s"])
        assert len(record["cpu_step_times_s"]) == len(record["step_times_s"])
        assert all(_positive(t) for t in record["cpu_step_times_s"])
        assert math.isfinite(record["final_loss"])
    # each side trained DPO: its loss starts at log 2 (policy = reference) and is a DPO loss, not LM's
    assert 0 < result["ours"]["final_loss"] < 2 and 0 < result["trl"]["final_loss"] < 2
    assert result["ratio"] == pytest.approx(result["trl"]["step_time_s"] / result["ours"]["step_time_s"])
    assert result["ratio_by_round"] and lookup(result, "ratio") == result["ratio"]
    ours_cpu, trl_cpu = result["ours"]["cpu_step_time_s"], result["trl"]["cpu_step_time_s"]
    assert result["cpu_ratio"] == pytest.approx(trl_cpu / ours_cpu)
    line = report.dpo_line(result)
    assert "TRL's DPOTrainer" in line and f"{result['ratio']:.2f}x" in line
    assert f"{result['cpu_ratio']:.2f}x" in line
