"""Supervised fine-tuning data: prompt/completion examples, their loss mask from prepare_data to the
loss, and a training job on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from training_jobs import prepare_data
from training_jobs.trainer.data import IGNORE_INDEX, BatchLayout, EvalBatches, TokenSamples
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.loss import causal_lm_loss
from training_jobs.trainer.shards import read_manifest

from .conftest import REPO, TINY, TOKENIZER, child_env, job_root, losses, run_jobs

SFT = REPO / "examples" / "data" / "tiny_sft"
CPU = torch.device("cpu")
EXAMPLES = [{"prompt": f"Question {i}: what is {i} and {i}?\nAnswer:", "completion": f" {2 * i}."}
            for i in range(40)]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _prepare_here(capsys, *args: str) -> tuple[int, str]:
    code = prepare_data.main([*args, "--workers", "1"])
    return code, capsys.readouterr().err


def _refused(capsys, source: Path, tokenizer: Path, output: Path, *options: str) -> str:
    """prepare_data's error output for an input it must refuse (exit code 2)."""
    code, err = _prepare_here(capsys, "--input", str(source), "--tokenizer", str(tokenizer),
                              "--output", str(output), *options)
    assert code == 2, err
    return err


def _prepared(capsys, folder: Path, records: list[dict], tokenizer: Path, *options: str):
    """`records` prepared by the CLI: (manifest, tokens, mask as bools) of its one shard."""
    source = _write_jsonl(folder / "records.jsonl", records)
    code, err = _prepare_here(capsys, "--input", str(source), "--tokenizer", str(tokenizer),
                              "--output", str(folder / "out"), *options)
    assert code == 0, err
    manifest = read_manifest(folder / "out")
    assert manifest.loss_mask and len(manifest.shards) == 1
    return (manifest, np.fromfile(manifest.shards[0].path, dtype="<u2"),
            np.fromfile(manifest.shards[0].mask_path, dtype=np.uint8).astype(bool))


@pytest.fixture(scope="module")
def examples_data(tmp_path_factory) -> Path:
    """EXAMPLES prepared with a loss mask, in shards of 100 tokens (so samples meet shard ends)."""
    folder = tmp_path_factory.mktemp("sft")
    source = _write_jsonl(folder / "examples.jsonl", EXAMPLES)
    assert prepare_data.main(["--input", str(source), "--tokenizer", str(TOKENIZER), "--output",
                              str(folder / "out"), "--completion-key", "completion",
                              "--shard-tokens", "100", "--workers", "1"]) == 0
    return folder / "out"


def test_examples_are_packed_with_a_mask_on_their_completions(examples_data):
    manifest = read_manifest(examples_data)
    assert manifest.loss_mask and manifest.num_documents == len(EXAMPLES)
    assert json.loads((examples_data / "manifest.json").read_text())["version"] == 2
    tokens = np.concatenate([np.fromfile(s.path, dtype="<u2") for s in manifest.shards])
    mask = np.concatenate([np.fromfile(s.mask_path, dtype=np.uint8) for s in manifest.shards])
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    eos = tokenizer.eos_token_id
    expected_tokens, expected_mask = [], []
    for example in EXAMPLES:  # the shipped tokenizer's bos is its eos: no prefix
        prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
        expected_tokens += prompt + answer + [eos]
        expected_mask += [0] * len(prompt) + [1] * (len(answer) + 1)
    assert tokens.tolist() == expected_tokens
    assert mask.tolist() == expected_mask
    assert tokenizer.decode(tokens[mask == 1]) == "".join(e["completion"] + tokenizer.eos_token
                                                          for e in EXAMPLES)


def test_targets_outside_the_mask_are_ignored_and_inputs_keep_every_token(examples_data):
    samples = TokenSamples(examples_data, seq_len=24, channel="train", model_vocab_size=640)
    assert samples.num_samples > 1
    indices = np.arange(samples.num_samples)
    inputs, targets = samples.batch(indices, CPU)
    tokens = samples.gather(indices)
    starts = [0, *np.cumsum([s.num_tokens for s in samples.manifest.shards])]
    stream_mask = [np.fromfile(s.mask_path, dtype=np.uint8) for s in samples.manifest.shards]
    assert torch.equal(inputs, torch.from_numpy(tokens[:, :-1]))
    for row, index in enumerate(indices):
        shard = int(np.searchsorted(samples.starts, index, side="right") - 1)
        first = (index - samples.starts[shard]) * 24
        window = stream_mask[shard][first + 1:first + 25].astype(bool)
        want = np.where(window, tokens[row, 1:], IGNORE_INDEX)
        assert targets[row].tolist() == want.tolist(), (row, starts)
    assert (targets == IGNORE_INDEX).any() and (targets != IGNORE_INDEX).any()
    # Evaluation reads the same masked targets.
    layout = BatchLayout(1, 0, 2, 1)
    eval_inputs, eval_targets = next(iter(EvalBatches(samples, layout, 1, CPU)))
    assert torch.equal(eval_targets, targets[:2]) and torch.equal(eval_inputs, inputs[:2])


def test_the_loss_averages_only_the_trained_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.tensor([[1, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 6, 0, 2, 5]])
    kept = targets != IGNORE_INDEX
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.clamp(min=0).reshape(-1),
                                                  reduction="none").reshape(2, 5)
    assert torch.allclose(causal_lm_loss(logits, targets), per_token[kept].mean())
    # Changing the logits of an ignored position changes nothing.
    loss = causal_lm_loss(logits, targets)
    loss.backward()
    assert torch.count_nonzero(logits.grad[~kept]) == 0
    # A micro batch without any trained target contributes zero, not NaN.
    empty = torch.full_like(targets, IGNORE_INDEX)
    logits.grad = None
    nothing = causal_lm_loss(logits, empty)
    nothing.backward()
    assert nothing.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    # Unmasked targets: the plain mean over every position, as before.
    full = torch.randint(0, 7, (2, 5))
    assert torch.allclose(causal_lm_loss(logits, full),
                          torch.nn.functional.cross_entropy(logits.reshape(-1, 7), full.reshape(-1)))


def test_bad_examples_and_options_are_refused_naming_the_fix(tmp_path, capsys):
    missing = _write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "a", "answer": "b"}])
    err = _refused(capsys, missing, TOKENIZER, tmp_path / "o1", "--completion-key", "completion")
    assert "missing.jsonl:1: no string field 'completion' (choose it with " \
        "--completion-key)" in err
    err = _refused(capsys, missing, TOKENIZER, tmp_path / "o2", "--completion-key", "answer",
                   "--prompt-key", "question")
    assert "no string field 'question' (choose it with --prompt-key)" in err
    text = tmp_path / "notes.txt"
    text.write_text("just text")
    err = _refused(capsys, text, TOKENIZER, tmp_path / "o3", "--completion-key", "completion")
    assert "notes.txt: a plain text file holds no examples" in err
    table = tmp_path / "pairs.csv"
    table.write_text("question,answer\nWhat?,This.\n")
    err = _refused(capsys, table, TOKENIZER, tmp_path / "o4", "--completion-key", "answer")
    assert "no column 'prompt' in the header (columns: question, answer); choose it " \
        "with --prompt-key" in err
    code, _ = _prepare_here(capsys, "--input", str(table), "--tokenizer", str(TOKENIZER), "--output",
                            str(tmp_path / "o5"), "--completion-key", "answer", "--prompt-key",
                            "question")
    assert code == 0 and read_manifest(tmp_path / "o5").loss_mask
    for extra, message in ((["--prompt-key", "p"], "--prompt-key needs --completion-key"),
                           (["--completion-key", "c", "--text-key", "body"], "--text-key is for plain"),
                           (["--completion-key", "x", "--prompt-key", "x"], "name the same field")):
        with pytest.raises(SystemExit) as exit_info:
            prepare_data.parse_args(["--input", "i", "--tokenizer", "t", "--output", "o", *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def word_start_tokenizer(tmp_path_factory) -> Path:
    """A Llama-2-style tokenizer: SentencePiece's word-start marker prepended and replacing spaces,
    so a string tokenized on its own starts with a word-start token."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                             normalizers.Replace(" ", "\u2581")])
    # Pieces never span words, as in SentencePiece.
    model.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    corpus = [e["prompt"] + e["completion"] for e in EXAMPLES] * 5
    model.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200,
                                                          special_tokens=["<unk>", "</s>"]))
    folder = tmp_path_factory.mktemp("word-start") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(str(folder))
    return folder


def test_examples_are_tokenized_as_the_model_reads_them(word_start_tokenizer, tmp_path, capsys):
    _, tokens, mask = _prepared(capsys, tmp_path, EXAMPLES, word_start_tokenizer,
                                "--completion-key", "completion")
    tokenizer = AutoTokenizer.from_pretrained(str(word_start_tokenizer))
    apart = tokenizer(EXAMPLES[0]["completion"], add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(apart)[0] == "\u2581"  # the stray token apart gives
    expected_tokens, expected_mask = [], []
    for example in EXAMPLES:
        joint = tokenizer(example["prompt"] + example["completion"], add_special_tokens=False)["input_ids"]
        prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
        assert joint[:len(prompt)] == prompt  # the boundary is a word boundary here
        expected_tokens += joint + [tokenizer.eos_token_id]
        expected_mask += [0] * len(prompt) + [1] * (len(joint) - len(prompt) + 1)
    assert tokens.tolist() == expected_tokens and mask.astype(int).tolist() == expected_mask


CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Red."},
                  {"role": "user", "content": "Another one?"},
                  {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Count to two."},
                  {"role": "assistant", "content": "One, two."},
                  {"role": "user", "content": "Thanks!"}]},  # a last user turn trains nothing
]


@pytest.fixture(scope="module")
def chat_tokenizer() -> Path:
    """The shipped tokenizer: it has a chat template, as instruction-tuned models ship theirs."""
    return TOKENIZER


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory) -> Path:
    """The shipped tokenizer without its chat template, as base checkpoints ship theirs."""
    folder = tmp_path_factory.mktemp("plain") / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config.get("chat_template") is None and not (folder / "chat_template.jinja").exists()
    return folder


def test_conversations_train_on_every_assistant_turn(chat_tokenizer, tmp_path, capsys):
    manifest, tokens, mask = _prepared(capsys, tmp_path, CONVERSATIONS, chat_tokenizer,
                                       "--messages-key", "messages")
    assert manifest.num_documents == 2
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    eos = tokenizer.eos_token
    # Trained: each assistant turn with the template's end of turn, and each conversation's closing
    # end-of-sequence id after an assistant turn; context: everything else, rendered by the template.
    assert tokenizer.decode(tokens[mask]) == f"Red.{eos}\nBlue.{eos}\n{eos}One, two.{eos}\n{eos}"
    context = tokenizer.decode(tokens[~mask])
    assert context == (f"<|system|>\nBe brief.{eos}\n<|user|>\nName a colour.{eos}\n<|assistant|>\n"
                       f"<|user|>\nAnother one?{eos}\n<|assistant|>\n"
                       f"<|user|>\nCount to two.{eos}\n<|assistant|>\n")
    # The whole stream is the template's own rendering of each conversation, then end-of-sequence.
    rendered = "".join(tokenizer.apply_chat_template(c["messages"][:len(c["messages"]) - i], tokenize=False)
                       + eos for c, i in zip(CONVERSATIONS, (0, 1), strict=True))
    assert tokenizer.decode(tokens) == rendered


def test_bad_conversations_are_refused_naming_the_fix(chat_tokenizer, plain_tokenizer, tmp_path, capsys):
    cases = [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no 'assistant' message in 'messages'"),
        ({"messages": "hi"}, "field 'messages' must be a non-empty list of messages"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
         "message 0 of 'messages' is not an object with string 'role' and 'content'"),
        ({"chat": []}, "no field 'messages' (choose it with --messages-key)"),
    ]
    for index, (record, message) in enumerate(cases):
        source = _write_jsonl(tmp_path / f"bad{index}.jsonl", [record])
        err = _refused(capsys, source, chat_tokenizer, tmp_path / f"o{index}", "--messages-key",
                       "messages")
        assert f"bad{index}.jsonl:1: {message}" in err, err
    good = _write_jsonl(tmp_path / "good.jsonl", CONVERSATIONS)
    err = _refused(capsys, good, plain_tokenizer, tmp_path / "plain", "--messages-key", "messages")
    assert "the tokenizer has no chat template" in err
    table = tmp_path / "chats.csv"
    table.write_text("messages\nhi\n")
    err = _refused(capsys, table, chat_tokenizer, tmp_path / "csv", "--messages-key", "messages")
    assert "chats.csv: a .csv file holds no conversations" in err
    with pytest.raises(SystemExit):
        prepare_data.parse_args(["--input", "i", "--tokenizer", "t", "--output", "o",
                                 "--messages-key", "m", "--completion-key", "c"])
    assert "choose one" in capsys.readouterr().err


def test_a_masked_dataset_with_a_missing_or_short_mask_is_refused(examples_data, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(examples_data, broken)
    mask = read_manifest(broken).shards[1].mask_path.name
    (broken / mask).write_bytes(b"\x01" * 10)
    with pytest.raises(DataError, match=rf"mask {mask} has 10 bytes but the manifest says "
                                        r"100 tokens of 1 bytes"):
        read_manifest(broken)
    (broken / mask).unlink()
    with pytest.raises(DataError, match=f"mask {mask} listed in the manifest does not exist"):
        read_manifest(broken)


def test_template_code_from_before_masks_refuses_a_masked_dataset(examples_data, tmp_path):
    """Version 2 manifests exist so that a reader without masks (code frozen in an older template
    version) stops instead of training on the prompts: run the 1.0.0 snapshot's reader on one."""
    import tarfile

    lock = json.loads((REPO / "templates" / "catalog.lock").read_text())
    code = lock["templates"]["llama-pretrain-fsdp"]["1.0.0"]["code"].removeprefix("sha256:")
    with tarfile.open(REPO / "templates" / "_code" / f"{code}.tar.gz") as archive:
        archive.extractall(tmp_path / "old", filter="data")
    assert "MASKED_VERSION" not in (tmp_path / "old/training_jobs/trainer/shards.py").read_text()
    probe = ("import pathlib, sys; from training_jobs.trainer.shards import read_manifest; "
             "read_manifest(pathlib.Path(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", probe, str(examples_data)], capture_output=True,
                            text=True, env=child_env(PYTHONPATH=str(tmp_path / "old")),
                            cwd=tmp_path, timeout=60)
    assert result.returncode != 0 and "manifest version 2 is not supported" in result.stderr


@pytest.fixture(scope="module")
def shipped_sft(tmp_path_factory) -> Path:
    """The shipped prompt/completion examples, prepared by the CLI like a user would."""
    output = tmp_path_factory.mktemp("shipped") / "sft"
    for split in ("train", "validation"):
        result = subprocess.run(
            [sys.executable, "-m", "training_jobs.prepare_data", "--input", str(SFT / f"{split}.jsonl"),
             "--tokenizer", str(TOKENIZER), "--output", str(output / split), "--completion-key",
             "completion", "--workers", "1"],
            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    return output


def test_a_job_fine_tunes_on_completions_with_ddp(shipped_sft, tmp_path):
    """The program end to end on a masked dataset, 2 processes: the loss falls as the model learns
    to answer, and it is the mean over the step's trained tokens, so splitting the same global
    batch differently (2 samples per rank at once, or 1 sample in each of 2 micro steps) trains the
    same model: answers have different lengths, and a mean of micro-batch means would differ."""
    common = {**TINY, "parallelism": "ddp", "max_steps": 30, "lr": 3e-3, "warmup_steps": 3,
              "eval_every_steps": 30, "seq_len": 64}
    # Evaluation batches are micro_batch_size per rank: the same 16 samples in 4 or 8 batches.
    splits = {"whole": {"micro_batch_size": 2, "grad_accum_steps": 1, "eval_steps": 4},
              "accumulated": {"micro_batch_size": 1, "grad_accum_steps": 2, "eval_steps": 8}}
    roots = {name: job_root(tmp_path / name, shipped_sft, validation=True) for name in splits}
    run_jobs(2, [(roots[name], {**common, **split}) for name, split in splits.items()], tmp_path)
    trained = {name: losses(root) for name, root in roots.items()}
    whole = trained["whole"]
    assert len(whole) == 30 and all(np.isfinite(whole))
    assert np.mean(whole[-5:]) < 0.6 * np.mean(whole[:5]), whole
    np.testing.assert_allclose(trained["accumulated"], whole, rtol=2e-4)
    evaluations = {}
    for name, root in roots.items():
        records = [json.loads(line) for line in
                   (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()]
        evaluations[name] = [r["eval_loss"] for r in records if r["kind"] == "eval"]
    assert len(evaluations["whole"]) == 1 and np.isfinite(evaluations["whole"][0])
    np.testing.assert_allclose(evaluations["accumulated"], evaluations["whole"], rtol=2e-4)


def test_examples_without_an_answer_to_train_are_refused_when_prepared(tmp_path, capsys):
    """Every completion empty (e.g. --completion-key names a field the records leave blank): the mask
    would train nothing but the end-of-sequence token, and the job would reach a loss near 0."""
    blank = _write_jsonl(tmp_path / "blank.jsonl", [{**e, "completion": ""} for e in EXAMPLES])
    err = _refused(capsys, blank, TOKENIZER, tmp_path / "out", "--completion-key", "completion")
    assert f"no example in {blank} has an answer to train on" in err
    assert "check --completion-key" in err
    assert not (tmp_path / "out").exists()


def test_a_masked_dataset_that_trains_no_token_is_refused_when_loaded(examples_data, tmp_path):
    """Shards whose masks mark no answer token (written by another tool, or a bug) are refused by the
    job before it trains at loss 0 and exports a model."""
    import shutil

    folder = shutil.copytree(examples_data, tmp_path / "masked")
    manifest = read_manifest(folder)
    for shard in manifest.shards:
        tokens = np.fromfile(shard.path, dtype="<u2")
        # only the end-of-sequence ids stay trained: an answer-less dataset
        (tokens == manifest.eos_token_id).astype(np.uint8).tofile(shard.mask_path)
    with pytest.raises(DataError, match=r"the train channel \(.*masked\) trains no answer token"):
        TokenSamples(folder, seq_len=16, channel="train", model_vocab_size=640)
    for shard in manifest.shards:
        np.zeros(shard.num_tokens, np.uint8).tofile(shard.mask_path)
    with pytest.raises(DataError, match="--completion-key"):
        TokenSamples(folder, seq_len=16, channel="train", model_vocab_size=640)
