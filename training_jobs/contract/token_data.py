"""The on-disk format of the token shards a run's `train` and `validation` channels hold: what
prepare_data writes, what the program loads (trainer/shards.py) and what the platform checks before a
job starts (llmtrain.core.token_data). The full description is in trainer/shards.py.
"""

FORMAT = "llmtrain-token-shards"
MANIFEST = "manifest.json"
VERSION = 1
MASKED_VERSION = 2  # loss-masked datasets (prompt/completion pairs, conversations)
PREFERENCE_VERSION = 3  # preference pairs (prompt, chosen, rejected): loss-masked, with a pair index
PROMPTS_VERSION = 4  # prompts with their fields (GRPO): PROMPTS_FILE, no token shards
PROMPTS_FILE = "prompts.jsonl"
# Manifest version -> whether the dataset is loss-masked.
LOSS_MASKED = {VERSION: False, MASKED_VERSION: True}
# Manifest version -> the kind of data (what contract/objectives.py matches objectives with). A reader
# that knows only versions 1 and 2 (template versions published before preference data) refuses 3
# by its number.
DATA_KINDS = {VERSION: "text", MASKED_VERSION: "loss_masked", PREFERENCE_VERSION: "preference",
              PROMPTS_VERSION: "prompts"}
MASK_SUFFIX = ".mask"
# A preference dataset's pair index beside each shard: int64 [pairs, 3], each row the token offsets
# of the chosen sequence's start, the rejected sequence's start and its end.
PAIRS_SUFFIX = ".pairs"
# Token id dtypes (little-endian unsigned) -> bytes per token.
DTYPE_BYTES = {"uint16": 2, "uint32": 4}
# prepare_data's split folders, and the channels the program reads them from.
SPLITS = ("train", "validation")
# The folder beside the splits that holds the tokenizer the shards were made with.
TOKENIZER_FOLDER = "tokenizer"
# The tokenizer the program uses when a run brings none (its `tokenizer` channel, its `model` channel).
SHIPPED_TOKENIZER = ("training_jobs", "assets", "tokenizer")
# Input formats prepare_data refuses (they would otherwise be read as garbled text); the platform
# refuses them by name before a cloud preparation starts.
BINARY_SUFFIXES = (".parquet", ".arrow", ".feather", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar",
                   ".npy", ".pkl", ".pt", ".bin", ".safetensors")
