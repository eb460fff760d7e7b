"""Supervised fine-tuning examples as token ids plus a loss mask (used by prepare_data).

An example is a prompt/completion pair or a conversation (a list of {"role", "content"} messages).
Both become segments of text, each either context (mask 0) or trained (mask 1); the joined text
is tokenized once and each token takes the flag of the segment its first character is in. A
conversation is rendered with the tokenizer's own chat template, turn by
turn: every assistant message, with the tokens the template puts around it up to the next turn, is
trained; everything before it is context. The end-of-sequence id that closes an example is trained
when its last segment is (the model learns to stop).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from training_jobs.trainer.errors import DataError

Segments = list[tuple[str, bool]]
# A prompt/completion pair, or a conversation's messages.
Example = tuple[str, str] | list[dict[str, str]]


def check_messages(where: str, messages: Any, key: str) -> list[dict[str, str]]:
    """The messages of a conversation, or a DataError that says what is wrong with them."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of messages "
                        "({\"role\": ..., \"content\": ...} objects)")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {index} of {key!r} is not an object with string "
                            "'role' and 'content'")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: no 'assistant' message in {key!r}: nothing to train on")
    return messages


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template (chat_template in tokenizer_config.json), "
                        "so conversations cannot be rendered: use a tokenizer that has one, or "
                        "format the text yourself and use --completion-key")


def chat_segments(where: str, messages: list[dict[str, str]], tokenizer) -> Segments:
    """Context and trained text of a conversation, rendered by the tokenizer's chat template."""
    require_chat_template(tokenizer)
    segments: Segments = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False,
                                               add_generation_prompt=True)
        after = tokenizer.apply_chat_template(messages[:index + 1], tokenize=False)
        if not (before.startswith(rendered) and after.startswith(before)):
            raise DataError(f"{where}: the tokenizer's chat template does not render this "
                            "conversation turn by turn (an earlier turn changes when a later one is "
                            "added), so the assistant's text cannot be told apart: format the "
                            "examples yourself and use --completion-key")
        segments += [(before[len(rendered):], False), (after[len(before):], True)]
        rendered = after
    return segments


def example_segments(where: str, example: Example, tokenizer) -> Segments:
    if isinstance(example, tuple):
        prompt, completion = example
        return [(prompt, False), (completion, True)]
    return chat_segments(where, example, tokenizer)


def document_separators(tokenizer) -> tuple[list[int], int]:
    """The ids that open a document (bos, where the tokenizer has one distinct from eos) and the
    id that closes it (eos), for plain documents and examples alike."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None and bos != eos else []), eos


def tokenize_examples(examples: list[tuple[str, Example]], tokenizer,
                      dtype: np.dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, loss mask) of each example, each closed by the end-of-sequence id (and opened
    by the begin-of-sequence id where the tokenizer has a distinct one).

    An example's segments are tokenized as one text, as the model will read it (tokenizing them
    apart would add a word-start token to each segment with SentencePiece-style tokenizers); a
    token is trained when the segment holding its first character is."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("prompt/completion and chat examples need a fast tokenizer (a tokenizer.json) "
                        "to map the loss mask onto tokens: convert the tokenizer or use plain text")
    prefix, eos = document_separators(tokenizer)
    split = [example_segments(where, example, tokenizer) for where, example in examples]
    encoded = tokenizer(["".join(text for text, _ in segments) for segments in split],
                        add_special_tokens=False, return_offsets_mapping=True)
    tokenized = []
    for segments, ids, offsets in zip(split, encoded["input_ids"], encoded["offset_mapping"],
                                      strict=True):
        starts = np.cumsum([0] + [len(text) for text, _ in segments[:-1]])
        trained = np.array([flag for _, flag in segments], dtype=np.uint8)
        token_segment = np.searchsorted(starts, [start for start, _ in offsets], side="right") - 1
        mask = np.concatenate([np.zeros(len(prefix), np.uint8), trained[token_segment],
                               trained[-1:]])
        tokenized.append((np.asarray(prefix + list(ids) + [eos], dtype=dtype), mask))
    return tokenized
