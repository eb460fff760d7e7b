"""Prompts with reference answers for GRPO: JSONL records prepared by prepare_data with --prompts into a
prompts dataset (manifest version 4): `prompts.jsonl`, one line per example with its prompt's token
ids, its prompt text and every other field of the record (the answer and whatever a reward function
reads), beside the manifest.

A prompt is plain text, or chat messages rendered with the tokenizer's chat template and its
generation prompt. Token ids start with the begin-of-sequence id where the tokenizer has a distinct
one; a prompt longer than --max-length tokens keeps its end (the part next to the answer) and is
counted in the report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from training_jobs.contract.token_data import PROMPTS_FILE, SPLITS
from training_jobs.preference_examples import iter_lines
from training_jobs.sft_examples import document_separators, require_chat_template
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import write_prompts_manifest


def prompt_text(where: str, record: dict, key: str, tokenizer) -> str:
    if key not in record:
        raise DataError(f"{where}: no field {key!r} (choose it with --prompt-key)")
    prompt = record[key]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        require_chat_template(tokenizer)
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    raise DataError(f"{where}: field {key!r} must be a string or a non-empty list of messages "
                    "({\"role\": ..., \"content\": ...} objects)")


def write_prompt_dataset(args, files: list[Path], tokenizer, folder: Path, is_validation) -> dict[str, int]:
    """The prompts dataset of `files` in `folder` (split like prepare_data's documents); returns the
    prompt tokens of each split."""
    fraction = args.validation_fraction
    splits = {name: folder / name for name in SPLITS} if fraction > 0 else {"train": folder}
    lines: dict[str, list[str]] = {name: [] for name in splits}
    tokens = dict.fromkeys(splits, 0)
    prefix, _ = document_separators(tokenizer)
    cut = 0
    for index, (where, line) in enumerate(iter_lines(files)):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not a JSON object ({error})") from error
        if not isinstance(record, dict):
            raise DataError(f"{where}: not a JSON object")
        text = prompt_text(where, record, args.prompt_key, tokenizer)
        ids = prefix + tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > args.max_length:
            ids, cut = ids[-args.max_length:], cut + 1
        fields = {name: value for name, value in record.items() if name != args.prompt_key}
        split = "validation" if is_validation(index, fraction) else "train"
        lines[split].append(json.dumps({"where": where, "prompt": text, "prompt_ids": ids,
                                        "fields": fields}))
        tokens[split] += len(ids)
    for name, path in splits.items():
        if not lines[name]:
            raise DataError(f"no prompt went to the {name} split of {', '.join(map(str, files))}: add "
                            "prompts or change --validation-fraction")
        path.mkdir(parents=True, exist_ok=True)
        (path / PROMPTS_FILE).write_text("\n".join(lines[name]) + "\n")
        write_prompts_manifest(path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                               num_documents=len(lines[name]), num_tokens=tokens[name],
                               tokenizer=str(args.tokenizer))
    if cut:
        print(f"prepare_data: cut {cut} prompt(s) longer than --max-length {args.max_length} tokens to "
              "their last tokens", file=sys.stderr)
    return tokens
