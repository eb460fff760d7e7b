"""The training program's rules for a run, from the code the run's template version runs.

The training program checks its hyperparameters with its torch-free contract (training_jobs/contract:
types, bounds, unknown names, combinations, and the degrees and global batch against the cluster)
before it builds anything. The platform runs the same checks before it creates a job, with the code
the version runs, not today's: a published version runs its frozen code
(templates/_code/<code hash>.tar.gz), whose rules may differ from the working tree's.

The contract is standard-library Python that imports only itself, so `load_contract` executes its
modules from the code's files in isolation: under a private package name per code hash
(`_llmtrain_program_<hash>`), never as `training_jobs`, and never anything else of the program
(which imports torch). Two layouts exist:

- code with the contract package: `training_jobs/contract/*.py`, checked with `check_run`;
- code frozen before it: `training_jobs/trainer/config.py` and `errors.py`, with `parallel_dims.py`
  (ParallelDims.resolve and with_global_batch) where the code has it, else `config.resolve_mesh`
  (which that code's strategies called for every parallelism but smp).

Each contract also says what its program does (`capabilities`: the contract's capability table,
training_jobs/contract/capabilities.py), which the planner plans a version's run with; code frozen
before the table gets `LEGACY_CAPABILITIES`, the program as it was then.

Loaded contracts are cached by code hash (a launcher function loads each version's once per
container).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.abc
import importlib.util
import io
import json
import sys
import tarfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from llmtrain.core.errors import ProgramSettingError, SourceDirError

CONTRACT_FOLDER = "training_jobs/contract/"
LEGACY_FILES = ("training_jobs/trainer/config.py", "training_jobs/trainer/errors.py",
                "training_jobs/trainer/parallel_dims.py")
# Where a version's code names the token-shard manifest versions it reads (`VERSION`, and
# `MASKED_VERSION` once it reads loss-masked data): read as text, never executed (the shard reader
# imports numpy).
TOKEN_FORMAT_FILES = ("training_jobs/contract/token_data.py", "training_jobs/trainer/shards.py")
_PACKAGE_PREFIX = "_llmtrain_program_"
# What the training program did before its contract had a capability table (code frozen up to
# template release 1.2.0): tensor parallel with a replicated residual stream, a replicated output
# head and an fp32 log-softmax as large as the logits, a selective policy that kept every matmul's
# output, no context parallel, and no torchao in its requirements (so no FP8); it had no experts
# ("replicated": what the first expert-parallel code did with the copies of an expert slice).
LEGACY_CAPABILITIES: Mapping[str, object] = MappingProxyType({
    "sequence_parallel": False,
    "loss_parallel": False,
    "chunked_loss": False,
    "context_parallel": False,
    "selective_policy": "every_matmul",
    "fp8": None,
    "fp8_min_torch": None,
    "model_archive": False,
    "expert_copies": "replicated",
})


@dataclass(frozen=True)
class ProgramContract:
    """The hyperparameter rules of one version of the training program's code."""

    code_hash: str
    check_run: Callable[[dict[str, Any], int, int], object]
    error_type: type[Exception]
    # What the program does (its contract's capability table; LEGACY_CAPABILITIES without one).
    capabilities: Mapping[str, object] = field(default_factory=lambda: LEGACY_CAPABILITIES)
    # The token-shard manifest versions the program loads (1: plain; 2: loss-masked).
    manifest_versions: tuple[int, ...] = (1,)

    def check(self, hyperparameters: Mapping[str, Any], *, world_size: int, num_hosts: int) -> None:
        """ProgramSettingError, with the program's own message, when the program would refuse these
        hyperparameters (as SM_HPS holds them) on `num_hosts` hosts of `world_size` processes."""
        try:
            self.check_run(dict(hyperparameters), world_size, num_hosts)
        except self.error_type as error:
            raise ProgramSettingError(str(error)) from None


def installed_contract() -> ProgramContract:
    """The contract of the training program installed beside llmtrain (this checkout's, or the one
    in llmtrain's wheel): the rules of code that is not frozen."""
    from training_jobs import contract
    from training_jobs.contract.capabilities import CAPABILITIES
    from training_jobs.contract.token_data import LOSS_MASKED

    return ProgramContract("installed", contract.check_run, contract.ConfigError,
                           MappingProxyType(dict(CAPABILITIES)), tuple(sorted(LOSS_MASKED)))


_LOADED: dict[str, ProgramContract] = {}
_LOCK = threading.Lock()


def load_contract(files: Mapping[str, bytes], code_hash: str) -> ProgramContract:
    """The contract in `files` (archive path -> content: a sourcedir's files, or only its contract
    ones) of the code with this hash; SourceDirError when the code holds no contract."""
    return _cached(code_hash, lambda: files)


def archive_contract(archive: bytes, code_hash: str) -> ProgramContract:
    """The contract of a sourcedir archive (a published version's frozen code) with this code hash."""
    return _cached(code_hash, lambda: contract_files_of_archive(archive))


def folder_contract(code_folder: Path) -> ProgramContract:
    """The contract of a working tree's `training_jobs/` folder (code that is not frozen)."""
    base = code_folder.parent
    paths = (sorted((code_folder / "contract").glob("*.py")) or [base / name for name in LEGACY_FILES]) + [
        base / TOKEN_FORMAT_FILES[1]]
    files = {path.relative_to(base).as_posix(): path.read_bytes() for path in paths if path.is_file()}
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return load_contract(files, "sha256:" + digest.hexdigest())


def _cached(code_hash: str, files: Callable[[], Mapping[str, bytes]]) -> ProgramContract:
    with _LOCK:
        if code_hash not in _LOADED:
            _LOADED[code_hash] = _load(files(), code_hash)
        return _LOADED[code_hash]


def contract_files_of_archive(archive: bytes) -> dict[str, bytes]:
    """The contract's files in a sourcedir archive (the contract package, or the legacy files)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            return {member.name: tar.extractfile(member).read() for member in tar.getmembers()
                    if member.isfile() and _is_contract_file(member.name)}
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise SourceDirError(f"not a sourcedir archive: {exc}") from exc


def _is_contract_file(name: str) -> bool:
    folder, _, file = name.rpartition("/")
    return (folder + "/" == CONTRACT_FOLDER and file.endswith(".py")) or name in LEGACY_FILES \
        or name in TOKEN_FORMAT_FILES


def manifest_versions(files: Mapping[str, bytes]) -> tuple[int, ...]:
    """The token-shard manifest versions the code in `files` loads: the integer `VERSION` and
    `MASKED_VERSION` its shard format module assigns (the contract's, else the older shard reader's)."""
    for path in TOKEN_FORMAT_FILES:
        if path in files:
            names = _integer_constants(files[path])
            versions = {names[name] for name in ("VERSION", "MASKED_VERSION") if name in names}
            if versions:
                return tuple(sorted(versions))
    return (1,)


def _integer_constants(source: bytes) -> dict[str, int]:
    constants = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and type(node.value.value) is int:
            constants.update({target.id: node.value.value for target in node.targets
                              if isinstance(target, ast.Name)})
    return constants


# --- loading in isolation -----------------------------------------------------------------------


def _load(files: Mapping[str, bytes], code_hash: str) -> ProgramContract:
    contract = _load_rules(files, code_hash)
    return dataclasses.replace(contract, manifest_versions=manifest_versions(files))


def _load_rules(files: Mapping[str, bytes], code_hash: str) -> ProgramContract:
    root = _PACKAGE_PREFIX + code_hash.removeprefix("sha256:")[:16]
    # The shard reader is read as text only (manifest_versions): it imports numpy.
    sources = {_module_name(root, path): content for path, content in files.items()
               if path != TOKEN_FORMAT_FILES[1]}
    if f"{root}.contract" in sources or f"{root}.trainer.config" in sources:
        # Stays installed: it answers only for its own private root, which a function of the
        # contract may still import from later.
        sys.meta_path.append(_SourceFinder(root, sources))
    if f"{root}.contract" in sources:
        contract = importlib.import_module(f"{root}.contract")
        capabilities = LEGACY_CAPABILITIES
        if f"{root}.contract.capabilities" in sources:
            table = importlib.import_module(f"{root}.contract.capabilities").CAPABILITIES
            capabilities = MappingProxyType(dict(table))
        return ProgramContract(code_hash, contract.check_run, contract.ConfigError, capabilities)
    if f"{root}.trainer.config" in sources:
        return _legacy_contract(root, sources, code_hash)
    raise SourceDirError(f"the code {code_hash} holds no training program contract "
                         f"({CONTRACT_FOLDER} or {LEGACY_FILES[0]})")


def _legacy_contract(root: str, sources: Mapping[str, bytes], code_hash: str) -> ProgramContract:
    """Code frozen before training_jobs/contract: trainer/config.py, with the mesh in parallel_dims.py
    or (older still) in config.resolve_mesh."""
    config = importlib.import_module(f"{root}.trainer.config")
    errors = importlib.import_module(f"{root}.trainer.errors")
    if f"{root}.trainer.parallel_dims" in sources:
        dims = importlib.import_module(f"{root}.trainer.parallel_dims")

        def resolve(parsed: Any, world_size: int, num_hosts: int) -> None:
            dims.with_global_batch(parsed, dims.ParallelDims.resolve(parsed.parallel, world_size, num_hosts))
    else:
        def resolve(parsed: Any, world_size: int, num_hosts: int) -> None:
            # Its torch and DeepSpeed strategies resolved the mesh; SMP resolved its own.
            if parsed.parallel.parallelism != "smp":
                config.resolve_mesh(parsed.parallel, world_size, num_hosts)

    def check_run(hyperparameters: dict[str, Any], world_size: int, num_hosts: int) -> None:
        resolve(config.from_hyperparameters(hyperparameters), world_size, num_hosts)

    return ProgramContract(code_hash, check_run, errors.ConfigError)


def _module_name(root: str, path: str) -> str:
    """training_jobs/contract/__init__.py -> <root>.contract; training_jobs/trainer/config.py ->
    <root>.trainer.config (the private root stands for training_jobs)."""
    parts = path.removesuffix(".py").split("/")[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([root, *parts])


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the modules under `root` from source text; the packages between (the private root,
    `trainer`) are empty, so nothing outside the given files runs."""

    def __init__(self, root: str, sources: Mapping[str, bytes]) -> None:
        self.root = root
        self.sources = dict(sources)
        self.packages = {root} | {name.rsplit(".", 1)[0] for name in self.sources}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != self.root and not fullname.startswith(self.root + "."):
            return None
        if fullname not in self.sources and fullname not in self.packages:
            return None
        is_package = fullname in self.packages
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        source = self.sources.get(module.__name__)
        if source is not None:
            exec(compile(source, f"<{module.__name__}>", "exec"), module.__dict__)


def request_hyperparameters(request: Mapping[str, Any]) -> dict[str, Any]:
    """The training program's hyperparameters in a rendered request (JSON-encoded, as SageMaker
    passes them), without the container's own sagemaker_* ones."""
    decoded = {}
    for name, value in (request.get("HyperParameters") or {}).items():
        if name.startswith("sagemaker_") or name == "mp_parameters":
            continue
        try:
            decoded[name] = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            decoded[name] = value
    return decoded
