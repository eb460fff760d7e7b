"""Regenerate the tiny shipped assets: an English-like corpus and a small BPE tokenizer.

    python training_jobs/assets/make_tiny_assets.py

Writes examples/data/tiny_corpus/{train,validation}.jsonl (deterministic, a few hundred KB),
examples/data/tiny_sft/{train,validation}.jsonl (prompt/completion pairs for supervised fine-tuning:
list three things, answer with them in reverse order), examples/data/tiny_chat/{train,validation}.jsonl
(the same task as conversations, for `prepare_data --messages-key messages`),
examples/data/tiny_preference/{train,validation}.jsonl (preference pairs for DPO on the same task: the
reversed list chosen, a wrong order rejected), examples/data/tiny_grpo/{train,validation}.jsonl
(prompts of a verifiable task for GRPO: the sum of two digits, with its answer) and
training_jobs/assets/tokenizer/ (a byte-level BPE trained on the corpus, saved as an HF tokenizer
folder, with a chat template in its tokenizer_config.json). Nothing is downloaded:
the text comes from a small seeded grammar, so tests and examples run offline and the files are
reproducible byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS_DIR = REPO / "examples" / "data" / "tiny_corpus"
SFT_DIR = REPO / "examples" / "data" / "tiny_sft"
CHAT_DIR = REPO / "examples" / "data" / "tiny_chat"
PREFERENCE_DIR = REPO / "examples" / "data" / "tiny_preference"
GRPO_DIR = REPO / "examples" / "data" / "tiny_grpo"
TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
EOS = "<|endoftext|>"
VOCAB_SIZE = 1024
# Each message as `<|role|>`, a newline, its content and the end-of-sequence token; the generation
# prompt is the assistant's header. It renders turn by turn (a later message never changes the text
# of an earlier one), which prepare_data's --messages-key needs to tell the assistant's text apart.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SUBJECTS = ["the cat", "a small dog", "the old farmer", "my sister", "the teacher", "a young bird",
            "the captain", "our neighbour", "the baker", "a quiet child", "the river", "the wind",
            "the student", "a tired horse", "the doctor", "the little boat", "her brother",
            "the village", "a curious fox", "the engineer"]
VERBS = ["sees", "finds", "carries", "watches", "follows", "builds", "paints", "remembers",
         "visits", "opens", "counts", "reads", "cleans", "hears", "moves", "forgets", "helps",
         "loves", "keeps", "pulls"]
OBJECTS = ["the red door", "a wooden box", "the long road", "an apple", "the morning light",
           "a heavy stone", "the green field", "a letter", "the broken clock", "some bread",
           "the tall tree", "a blue cup", "the open window", "a map", "the warm fire",
           "the empty house", "a basket of eggs", "the old bridge", "a song", "the garden"]
ADVERBS = ["slowly", "quickly", "carefully", "again", "every day", "in the evening", "at dawn",
           "without a word", "with great care", "before the rain", "after lunch", "once more"]
CONNECTORS = ["and then", "but later", "because", "while", "so", "although", "and"]
OPENERS = ["One day", "In the spring", "Long ago", "Every morning", "That winter", "At night",
           "Near the sea", "On Sunday"]


def sentence(rng: random.Random) -> str:
    clause = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.5:
        clause += f" {rng.choice(ADVERBS)}"
    if rng.random() < 0.4:
        clause += (f" {rng.choice(CONNECTORS)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                   f"{rng.choice(OBJECTS)}")
    if rng.random() < 0.3:
        clause = f"{rng.choice(OPENERS)}, {clause}"
    return clause[0].upper() + clause[1:] + rng.choice([".", ".", ".", "!", "?"])


def document(rng: random.Random) -> str:
    paragraphs = []
    for _ in range(rng.randint(1, 3)):
        paragraphs.append(" ".join(sentence(rng) for _ in range(rng.randint(2, 7))))
    return "\n\n".join(paragraphs)


def write_corpus(path: Path, documents: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = [document(rng) for _ in range(documents)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")
    return texts


def write_sft(path: Path, examples: int, seed: int) -> None:
    """Prompt/completion pairs: three things, and the same three in reverse order."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(examples):
            things = rng.sample(OBJECTS, 3)
            out.write(json.dumps({"prompt": f"List in reverse order: {', '.join(things)}.\nAnswer:",
                                  "completion": f" {', '.join(reversed(things))}."}) + "\n")


def write_chat(path: Path, examples: int, seed: int) -> None:
    """Conversations on the SFT task: a system message, the user's list, the assistant's answer."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(examples):
            things = rng.sample(OBJECTS, 3)
            messages = [
                {"role": "system", "content": "Answer with the things listed, in reverse order."},
                {"role": "user", "content": f"List in reverse order: {', '.join(things)}."},
                {"role": "assistant", "content": f"{', '.join(reversed(things))}."},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")


def add_chat_template(tokenizer_dir: Path) -> None:
    """Write CHAT_TEMPLATE into the folder's tokenizer_config.json (where instruction-tuned checkpoints
    keep theirs, and every transformers version reads it)."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    (tokenizer_dir / "chat_template.jinja").unlink(missing_ok=True)


def write_preferences(path: Path, pairs: int, seed: int) -> None:
    """Preference pairs: three things; chosen, the three in reverse order; rejected, another order."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(pairs):
            things = rng.sample(OBJECTS, 3)
            reverse = list(reversed(things))
            wrong = rng.choice([order for order in (things, things[1:] + things[:1], things[2:] + things[:2],
                                                    [things[1], things[0], things[2]])
                                if order != reverse])
            out.write(json.dumps({"prompt": f"List in reverse order: {', '.join(things)}.\nAnswer:",
                                  "chosen": f" {', '.join(reverse)}.",
                                  "rejected": f" {', '.join(wrong)}."}) + "\n")


def write_prompts(path: Path, examples: int, seed: int) -> None:
    """Prompts of a verifiable task with their answers (GRPO): the sum of two single digits."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(examples):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            out.write(json.dumps({"prompt": f"Add: {a} + {b} =", "answer": str(a + b)}) + "\n")


def train_tokenizer(texts: list[str], output: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS,
                                      unk_token=EOS, pad_token=EOS, model_max_length=1 << 20)
    output.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(output)
    add_chat_template(output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-documents", type=int, default=500)
    parser.add_argument("--validation-documents", type=int, default=50)
    parser.add_argument("--sft-examples", type=int, default=2000)
    parser.add_argument("--chat-examples", type=int, default=200)
    parser.add_argument("--preference-pairs", type=int, default=1000)
    parser.add_argument("--grpo-prompts", type=int, default=500)
    args = parser.parse_args(argv)
    texts = write_corpus(CORPUS_DIR / "train.jsonl", args.train_documents, seed=1)
    write_corpus(CORPUS_DIR / "validation.jsonl", args.validation_documents, seed=2)
    write_sft(SFT_DIR / "train.jsonl", args.sft_examples, seed=3)
    write_sft(SFT_DIR / "validation.jsonl", args.sft_examples // 10, seed=4)
    write_preferences(PREFERENCE_DIR / "train.jsonl", args.preference_pairs, seed=5)
    write_preferences(PREFERENCE_DIR / "validation.jsonl", args.preference_pairs // 10, seed=6)
    write_prompts(GRPO_DIR / "train.jsonl", args.grpo_prompts, seed=7)
    write_prompts(GRPO_DIR / "validation.jsonl", args.grpo_prompts // 10, seed=8)
    write_chat(CHAT_DIR / "train.jsonl", args.chat_examples, seed=9)
    write_chat(CHAT_DIR / "validation.jsonl", args.chat_examples // 10, seed=10)
    train_tokenizer(texts, TOKENIZER_DIR)
    print(f"wrote {CORPUS_DIR}, {SFT_DIR}, {CHAT_DIR}, {PREFERENCE_DIR}, {GRPO_DIR} and {TOKENIZER_DIR}")


if __name__ == "__main__":
    main()
