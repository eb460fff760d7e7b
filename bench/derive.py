"""Figures computed from the measured records: MFU, ratios, and the issue's targets."""

from __future__ import annotations

from bench.flops import mfu

# name -> (numerator configuration, denominator configuration)
RATIOS = {
    "ours_vs_hf_trainer": ("ours_bf16", "hf_trainer_bf16"),
    "ours_fp32_vs_hf_trainer_fp32": ("ours_fp32", "hf_trainer_fp32"),
    "ours_vs_plain_loop": ("ours_bf16", "plain_loop_bf16"),
    "ours_fp32_vs_plain_loop_fp32": ("ours_fp32", "plain_loop_fp32"),
    "fsdp2_vs_ddp": ("ours_fsdp2", "ours_ddp"),
    "fsdp2_grad_op_vs_ddp": ("ours_fsdp2_grad_op", "ours_ddp"),
    "fsdp2_bf16_vs_ddp_bf16": ("ours_fsdp2_bf16", "ours_ddp_bf16"),
    "ours_vs_hf_trainer_compiled": ("ours_bf16", "hf_trainer_bf16_compile"),
    "ours_no_compile_vs_hf_trainer": ("ours_bf16_no_compile", "hf_trainer_bf16"),
    "pipeline_1f1b_vs_ddp": ("ours_pp2_1f1b", "ours_ddp"),
    "pipeline_gpipe_vs_ddp": ("ours_pp2_gpipe", "ours_ddp"),
    "pipeline_interleaved_vs_ddp": ("ours_pp2_interleaved", "ours_ddp"),
    "zero2_vs_ddp": ("ours_zero2", "ours_ddp"),
    "zero3_vs_ddp": ("ours_zero3", "ours_ddp"),
    "moe_ours_vs_hf_trainer": ("moe_ours_fp32", "moe_hf_trainer_fp32"),
    "moe_ep2_vs_single": ("moe_ours_ep2", "moe_ours_fp32"),
}

# The targets on the CPU machine: (key in the results, comparison, threshold).
TARGETS = (
    ("ratios.ours_vs_hf_trainer", ">=", 1.1),
    ("mfu.ours_bf16", ">=", 0.70),
    ("ratios.fsdp2_vs_ddp", ">=", 0.95),
    ("ratios.pipeline_1f1b_vs_ddp", ">=", 0.8),
    ("checkpoint.stall_fraction", "<=", 0.05),
    ("data_loader.ratio_to_consumption", ">=", 50.0),
    ("dpo.ratio", ">=", 1.2),  # TRL's DPOTrainer's step time over ours (bench.dpo)
    ("ratios.moe_ours_vs_hf_trainer", ">=", 1.5),  # issue 33
)


def _tokens_per_s(configs: dict, name: str) -> float | None:
    record = configs.get(name)
    return record.get("tokens_per_s") if record and record.get("status") == "ok" else None


def add_mfu_and_hf_ratio(configs: dict, peaks: dict, flops_per_token: int, moe_flops_per_token: int) -> None:
    """Per configuration: MFU against the peak of its own precision (a mixture of experts: of its
    active parameters), and the ratio to the HF Trainer on the same model at the same precision."""
    for record in configs.values():
        if record.get("status") != "ok":
            continue
        moe = record.get("moe", False)
        peak = peaks[record["precision"]]["peak_flops"]
        record["mfu"] = mfu(record["tokens_per_s"], moe_flops_per_token if moe else flops_per_token, peak)
        hf = _tokens_per_s(configs, f"{'moe_' if moe else ''}hf_trainer_{record['precision']}")
        record["ratio_to_hf_trainer"] = record["tokens_per_s"] / hf if hf else None


def ratios(configs: dict) -> dict:
    found = {}
    for name, (numerator, denominator) in RATIOS.items():
        top, bottom = _tokens_per_s(configs, numerator), _tokens_per_s(configs, denominator)
        found[name] = top / bottom if top and bottom else None
    return found


def ratios_by_round(configs: dict) -> dict:
    """Each ratio per round (the rounds run interleaved, so round i of both sides ran close in
    time): how much of a ratio is the machine's drift."""
    found = {}
    for name, (numerator, denominator) in RATIOS.items():
        top, bottom = _round_times(configs, numerator), _round_times(configs, denominator)
        found[name] = [b / t for t, b in zip(top, bottom, strict=True)] \
            if top and bottom and len(top) == len(bottom) else None
    return found


def _round_times(configs: dict, name: str) -> list[float] | None:
    record = configs.get(name)
    if not record or record.get("status") != "ok":
        return None
    return record.get("round_step_times_s") or [record["step_time_s"]]


def _mfu_by_round(configs: dict, name: str) -> list[float] | None:
    times, record = _round_times(configs, name), configs.get(name, {})
    if not times or record.get("mfu") is None:
        return None
    return [record["mfu"] * record["step_time_s"] / seconds for seconds in times]


def mfu_table(configs: dict) -> dict:
    return {name: record.get("mfu") for name, record in configs.items()}


def consumption(configs: dict) -> float | None:
    """The fastest rate at which any of our configurations consumes tokens."""
    rates = [r["tokens_per_s"] for r in configs.values() if r["runner"] == "ours" and r.get("status") == "ok"]
    return max(rates) if rates else None


def lookup(results: dict, dotted: str):
    value = results
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def targets(results: dict) -> list[dict]:
    """Each target against the pooled measurement, and against every round on its own."""
    checked = []
    for key, comparison, threshold in TARGETS:
        measured = lookup(results, key)
        by_round = _target_by_round(results, key)
        checked.append({"key": key, "target": f"{comparison} {threshold}", "measured": measured,
                        "met": None if measured is None else _meets(measured, comparison, threshold),
                        "by_round": by_round,
                        "met_every_round": None if not by_round else
                        all(_meets(value, comparison, threshold) for value in by_round)})
    return checked


def _meets(value: float, comparison: str, threshold: float) -> bool:
    return value >= threshold if comparison == ">=" else value <= threshold


def _target_by_round(results: dict, key: str) -> list[float] | None:
    section, _, name = key.partition(".")
    if section == "ratios":
        return (results.get("ratios_by_round") or {}).get(name)
    if section == "mfu":
        return _mfu_by_round(results.get("configs", {}), name)
    if section == "dpo":
        return (results.get("dpo") or {}).get("ratio_by_round")
    return None
