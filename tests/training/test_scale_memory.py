"""What a tensor-parallel rank holds (2 ranks, one launch of scale_memory_worker.py): with sequence
parallel the residual stream between decoder layers is a sequence shard, and with loss parallel no
rank holds or saves the whole vocabulary's logits. Measured with saved-tensor hooks and the layers'
inputs, as bench/workers/plan_memory.py measures memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import torchrun

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "scale_memory_worker.py"
BATCH, SEQ, HIDDEN, VOCAB = 2, 32, 64, 256


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale_memory")
    completed = torchrun(2, WORKER, [str(out)])
    assert completed.returncode == 0, completed.output[-6000:]
    return {(rank, sp): json.loads((out / f"rank{rank}_sp{int(sp)}.json").read_text())
            for rank in range(2) for sp in (True, False)}


@pytest.mark.parametrize("rank", [0, 1])
def test_sequence_parallel_keeps_a_sequence_shard_between_layers(measured, rank):
    assert measured[rank, True]["layer_inputs"] == [[BATCH, SEQ // 2, HIDDEN]] * 2
    assert measured[rank, False]["layer_inputs"] == [[BATCH, SEQ, HIDDEN]] * 2


@pytest.mark.parametrize(("rank", "sequence_parallel"), [(0, True), (1, True), (0, False)])
def test_no_rank_holds_or_saves_the_whole_vocabularys_logits(measured, rank, sequence_parallel):
    result = measured[rank, sequence_parallel]
    assert result["logits"] == [BATCH, SEQ, VOCAB // 2]
    saved = result["saved"]
    assert {"shape": [BATCH * SEQ, VOCAB // 2], "dtype": "torch.float32"} in saved  # the loss's input
    assert not [tensor for tensor in saved if VOCAB in tensor["shape"]]
    largest = max(_numel(tensor["shape"]) for tensor in saved)
    assert largest == BATCH * SEQ * VOCAB // 2


def test_both_layouts_compute_the_same_loss(measured):
    assert measured[0, True]["loss"] == pytest.approx(measured[0, False]["loss"], rel=1e-6)
    assert measured[0, True]["loss"] == measured[1, True]["loss"]  # every rank has the whole loss


def _numel(shape: list[int]) -> int:
    product = 1
    for size in shape:
        product *= size
    return product
