"""Fault injection for testing the rules, only when the environment variable `LLMTRAIN_TEST_FAULTS`
is set (never in a template: it is not a hyperparameter). Its value is JSON, every key optional:

    {"loss_spike": {"steps": [12], "add": 50.0, "ranks": [1]},   # the loss's value + add (same gradient)
     "grad_explosion": {"steps": [12], "factor": 1e4},          # the gradient x factor (same loss value)
     "stall": {"steps": [20, 21], "seconds": 2.0},              # every rank sleeps before the step
     "hang": {"step": 5, "rank": 1, "seconds": 600},            # one rank sleeps before the step
     "drop_batch": {"steps": [12], "batches": 2}}               # batches drawn and thrown away

`ranks` (default: all) limits a fault to some ranks. Step numbers are the steps the loop is about to
train: a roll-back trains a step number again and meets its fault again (a persistent fault), unless
the fault says `"once": true` (a bad batch: the data moves on). `drop_batch` is the reference a
roll-back is compared with: it trains what a run that rolled back at that step trains.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .strategies.protocol import LossFn

ENVIRONMENT_VARIABLE = "LLMTRAIN_TEST_FAULTS"
_KEYS = ("loss_spike", "grad_explosion", "stall", "hang", "drop_batch")


@dataclass(frozen=True)
class Faults:
    """The faults to inject; the default injects none."""

    spec: Mapping[str, Mapping] = field(default_factory=dict)
    fired: set[tuple[str, int]] = field(default_factory=set)  # (fault, step) of the "once" faults

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Faults:
        text = environ.get(ENVIRONMENT_VARIABLE, "")
        if not text:
            return cls()
        spec = json.loads(text)
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: unknown fault(s) {unknown}; known: {_KEYS}")
        return cls(spec)

    def _at(self, kind: str, step: int, rank: int) -> Mapping | None:
        fault = self.spec.get(kind)
        if fault is None or step not in fault["steps"] or rank not in fault.get("ranks", [rank]):
            return None
        if fault.get("once"):
            if (kind, step) in self.fired:
                return None
            self.fired.add((kind, step))
        return fault

    def before_step(self, step: int, rank: int, draw_batch) -> None:
        """Stall, hang or drop a batch before training `step` (`draw_batch` draws the next one)."""
        if not self.spec:
            return
        if stall := self._at("stall", step, rank):
            time.sleep(stall["seconds"])
        hang = self.spec.get("hang")
        if hang and hang["step"] == step and hang["rank"] == rank:
            time.sleep(hang["seconds"])
        if drop := self._at("drop_batch", step, rank):
            for _ in range(drop.get("batches", 1)):
                draw_batch()

    def loss(self, step: int, rank: int, loss_fn: LossFn) -> LossFn:
        """`loss_fn`, with this step's loss or gradient fault applied."""
        spike, explosion = self._at("loss_spike", step, rank), self._at("grad_explosion", step, rank)
        if spike is None and explosion is None:
            return loss_fn
        add = spike["add"] if spike else 0.0
        factor = explosion["factor"] if explosion else 1.0

        def faulty(logits, targets):
            loss = loss_fn(logits, targets)
            # value: loss + add; gradient: factor x the loss's
            return loss * factor - (loss * (factor - 1.0)).detach() + add
        return faulty
