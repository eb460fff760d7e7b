#!/usr/bin/env bash
# `make demo`: the platform end to end on this machine, no AWS account needed.
# make has already set up the environment and synthesized every environment's stacks (make synth).
# Here: run the default template locally, then run it again with more steps to show it resumes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
WORKDIR=${WORKDIR:-runs}
RUN=demo
TEMPLATE=llama-pretrain-fsdp
# One emulated host with two CPU processes (FSDP shards the model over both), a log line per step,
# a checkpoint and an eval loss every 10 steps (a local run evaluates on the shipped corpus's
# validation split), and the same warm-up in both runs (so the schedule continues).
SETTINGS=(--set instance_count=1 --set log_every_steps=1 --set checkpoint_every_steps=10 --set warmup_steps=3
          --set eval_every_steps=10)

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# Idempotent: every `make demo` starts the demo run from scratch (the prepared data stays cached).
rm -rf "${WORKDIR:?}/$RUN"

step "Synthesized every environment (make synth): CloudFormation templates in cdk.out/"
for assembly in cdk.out/assembly-*/; do
    echo "  $(basename "$assembly"): $(find "$assembly" -name '*.template.json' | wc -l) stack template(s)"
done

step "1/2 A short local run of $TEMPLATE: 30 steps of FSDP over 2 processes on the tiny corpus"
"$PY" -m llmtrain.cli run --local "$TEMPLATE" --run-name "$RUN" --workdir "$WORKDIR" \
    "${SETTINGS[@]}" --set max_steps=30

step "2/2 The same run again with more steps: it resumes from its checkpoint at step 30"
"$PY" -m llmtrain.cli run --local "$TEMPLATE" --run-name "$RUN" --workdir "$WORKDIR" \
    "${SETTINGS[@]}" --set max_steps=60

step "Done"
echo "  summary: $WORKDIR/$RUN/summary.json"
echo "  plot:    $WORKDIR/$RUN/metrics.png (both jobs: the second continues the first)"
echo "  events:  $WORKDIR/$RUN/tensorboard/ (tensorboard --logdir $WORKDIR/$RUN/tensorboard)"
