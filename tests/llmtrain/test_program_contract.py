"""The training program's contract as the platform uses it: one copy, imported and never repeated,
loaded from the code a template version runs (its frozen code's), and checked before any job
exists: by `llmtrain render` (exit 2) and by the launcher's Resolve (no CreateTrainingJob)."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import aws_cdk as cdk
import pytest
import yaml
from launcher_harness import ACCOUNT, launcher_in_moto
from templates_support import REPO_ROOT, copy_catalog, platform_context

import llmtrain
import training_jobs.contract
from llmtrain.cli import main
from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import load_environment
from llmtrain.core.errors import ProgramSettingError
from llmtrain.core.instances import GPU_MODELS, INSTANCE_TYPES
from llmtrain.core.program_contract import archive_contract, folder_contract, installed_contract
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.planner import pipeline_memory, shapes, workload
from training_jobs.contract import hardware, hyperparameters, parallel_dims, presets, stage_split

CONTRACT = Path(training_jobs.contract.__file__).parent
CATALOG = Catalog.load()
PLATFORM = platform_context()
# The code the 1.0.0 versions froze: before the contract package, FP8 and pipeline stages.
CODE_1_0_0 = "sha256:fb7b3fcbeb931f91ab79279ec9acf67e34adea28796091ca6348017b348ce8f5"


# --- one copy: the contract, imported -------------------------------------------------------------


def test_the_contract_imports_only_the_standard_library_and_itself():
    for path in sorted(CONTRACT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue  # relative imports stay inside the package
            outside = [n for n in names if n.split(".")[0] not in sys.stdlib_module_names]
            assert not outside, f"{path.name} imports {outside}: the contract is standard library only"


def test_llmtrain_and_the_contract_load_without_torch():
    probe = (
        "import sys, training_jobs.contract, llmtrain.core.render, llmtrain.planner.plan, "
        "llmtrain.handlers.launcher, llmtrain.cli\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers'))\n"
        "assert not heavy, heavy\n"
        "assert 'training_jobs.trainer' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr


def test_llmtrain_holds_the_programs_tables_not_copies():
    """Identity, not equality: each of these is the contract's own object."""
    assert shapes.PRESETS is presets.PRESETS
    assert shapes.padded_vocab_size is presets.padded_vocab_size
    assert pipeline_memory.balanced_split is stage_split.balanced_split
    assert pipeline_memory.stage_indices is stage_split.stage_indices
    assert workload.resolve_cluster is parallel_dims.resolve_cluster
    assert {f.type for f in dataclasses.fields(workload.Layout) if f.name == "dims"} == {"ParallelDims"}
    assert llmtrain.core.distribution.PARALLELISMS is hyperparameters.PARALLELISMS
    assert llmtrain.core.distribution.PIPELINE_STRATEGIES is parallel_dims.PIPELINE_DATA_PARALLELISMS
    assert llmtrain.core.validate.QUANTIZED_PARALLELISMS is hyperparameters.QUANTIZED_PARALLELISMS
    for kind in INSTANCE_TYPES.values():
        if kind.gpu is not None:
            assert kind.gpu_model.peak_flops == hardware.instance_peak_tflops(kind.name) * 1e12, kind.name
    assert {gpu.peak_flops for gpu in GPU_MODELS.values()} <= {
        tflops * 1e12 for _, tflops in hardware.PEAK_TFLOPS_BY_DEVICE_NAME
    }


def _first_party_imports(path: Path, package: str) -> set[str]:
    """The first-party modules (or submodules named in `from package import module`) a module
    imports at its top level."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            found |= {source} | {f"{source}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] in ("llmtrain", "training_jobs")}


def test_no_import_circles_among_llmtrain_and_the_contract():
    modules = {}
    for root, package in ((Path(llmtrain.__file__).parent, "llmtrain"), (CONTRACT, "training_jobs.contract")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            own_package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
            modules[name] = _first_party_imports(path, own_package)
    # A package is imported before its modules: a module's import of its own package adds no edge.
    graph = {
        name: {m for m in imports if m in modules and m != name and not name.startswith(m + ".")}
        for name, imports in modules.items()
    }
    done, path = set(), []

    def visit(node: str) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node):], node]))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not {m for m in graph["training_jobs.contract.hyperparameters"] if m.startswith("llmtrain")}


# --- the contract of the code a version runs ------------------------------------------------------


PLATFORM_CODES = sorted({CATALOG.published_entry(s).code for s in CATALOG.all()
                         if s.code.is_platform and CATALOG.published_entry(s)})  # unpublished: none yet


@pytest.mark.parametrize("code", PLATFORM_CODES)
def test_every_published_program_has_its_contract(code):
    contract = archive_contract(CATALOG.snapshot_path(code).read_bytes(), code)
    assert contract.code_hash == code
    contract.check({"model_preset": "llama-tiny"}, world_size=8, num_hosts=1)
    with pytest.raises(ProgramSettingError, match="'lr': got -1.0, expected a value > 0"):
        contract.check({"lr": -1}, world_size=8, num_hosts=1)
    # Loaded in isolation: under a private name per code hash, never as the installed program.
    private_root = f"_llmtrain_program_{code.removeprefix('sha256:')[:16]}."
    assert contract.error_type.__module__.startswith(private_root)


def test_a_frozen_contract_keeps_its_own_rules():
    """The 1.0.0 versions' program knows no FP8 and no pipeline stages: it refuses the names that
    today's program accepts, and render checks those versions with their own rules."""
    frozen = archive_contract(CATALOG.snapshot_path(CODE_1_0_0).read_bytes(), CODE_1_0_0)
    for setting in ({"fp8": True}, {"pipeline_parallel_degree": 2, "grad_accum_steps": 4}):
        installed_contract().check({"parallelism": "fsdp", **setting}, world_size=8, num_hosts=1)
        with pytest.raises(ProgramSettingError, match=f"unknown hyperparameter '{next(iter(setting))}'"):
            frozen.check({"parallelism": "fsdp", **setting}, world_size=8, num_hosts=1)
    assert CATALOG.program_contract(CATALOG.get("llama-pretrain-fsdp", "1.0.0")) is frozen
    assert CATALOG.program_contract(CATALOG.get("byo-script", "1.0.0")) is None


def test_the_working_trees_contract_loaded_in_isolation_checks_as_the_installed_one():
    isolated = folder_contract(REPO_ROOT / "training_jobs")
    assert isolated.check_run is not installed_contract().check_run
    for bad in ({"lerning_rate": 0.1}, {"adam_beta2": 1.5}, {"parallelism": "fsdp", "shard_degree": 3}):
        messages = []
        for contract in (isolated, installed_contract()):
            with pytest.raises(ProgramSettingError) as error:
                contract.check(bad, world_size=8, num_hosts=1)
            messages.append(str(error.value))
        assert messages[0] == messages[1]


# --- refused before any job: llmtrain render ---------------------------------------------------------


def _own_template(folder: Path, name: str, **hyperparameters) -> None:
    """A new, unpublished version in a copy of the catalog: llama-pretrain-fsdp@1.2.0 renamed, its
    hyperparameters changed, and two settings a run may override that the program disagrees with:
    a name it does not know, and adam_beta2 up to 2 (the program's bound is below 1)."""
    data = CATALOG.get("llama-pretrain-fsdp", "1.2.0").to_dict()
    data.update(name=name, version="1.0.0")
    data["hyperparameters"].update(hyperparameters)
    data["overridable"].update(lerning_rate={"type": "float", "min": 0.0, "max": 1.0},
                               adam_beta2={"type": "float", "min": 0.0, "max": 2.0})
    (folder / name).mkdir()
    (folder / name / "1.0.0.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _dev_enabling(folder: Path, template: str) -> Path:
    """A config folder whose dev environment enables only `template`."""
    dev = yaml.safe_load((REPO_ROOT / "config" / "dev.yaml").read_text())
    dev["job_templates"]["enabled"] = [template]
    folder.mkdir(exist_ok=True)
    (folder / "dev.yaml").write_text(yaml.safe_dump(dev))
    return folder


def _cli(catalog: Path, *argv: str) -> int:
    """llmtrain with this catalog and a dev environment that enables its own-check."""
    config = _dev_enabling(catalog.parent / "config", "own-check")
    return main([*argv, "--catalog", str(catalog), "--config-dir", str(config)])


@pytest.mark.parametrize(
    ("hyperparameters", "message"),
    [
        ({"lerning_rate": 0.001}, "unknown hyperparameter 'lerning_rate'"),
        ({"max_step": 100}, "unknown hyperparameter 'max_step'; did you mean 'max_steps'?"),
        ({"adam_beta2": 1.5}, "invalid hyperparameter 'adam_beta2': got 1.5, expected a value <= 0.999999"),
        ({"warmup_steps": 30000}, "invalid hyperparameter 'warmup_steps': got 30000, expected at most the "
                                  "decay horizon (20000 steps"),
    ],
)
def test_a_template_the_program_would_refuse_fails_render_with_exit_2(
    tmp_path, capsys, hyperparameters, message
):
    folder = copy_catalog(tmp_path, ("llama-pretrain-fsdp",))
    _own_template(folder, "own-check", **hyperparameters)
    status = _cli(folder, "render", "own-check", "--run-name", "r1")
    captured = capsys.readouterr()
    assert status == 2
    assert f"llmtrain render: error: the training program refuses this run: {message}" in captured.err
    assert captured.out == ""


def test_a_run_setting_the_program_refuses_fails_render_and_plan_with_exit_2(tmp_path, capsys):
    folder = copy_catalog(tmp_path, ("llama-pretrain-fsdp",))
    _own_template(folder, "own-check")
    assert _cli(folder, "render", "own-check", "--run-name", "r1") == 0
    capsys.readouterr()
    assert _cli(folder, "render", "own-check", "--run-name", "r1", "--set", "adam_beta2=1.5") == 2
    assert "invalid hyperparameter 'adam_beta2': got 1.5" in capsys.readouterr().err
    assert main(["plan", "own-check", "--catalog", str(folder), "--set", "adam_beta2=1.5"]) == 2
    assert "invalid hyperparameter 'adam_beta2': got 1.5" in capsys.readouterr().err


# --- refused before any job: the launcher -----------------------------------------------------------


@pytest.fixture(scope="module")
def own_launcher(tmp_path_factory):
    """The dev stage synthesized with a catalog of one published version of our own, whose runs may
    override settings the program refuses; its Resolve function bundles the version's frozen code."""
    folder = copy_catalog(tmp_path_factory.mktemp("catalog"), ())
    _own_template(folder, "own-check")
    catalog = Catalog.load(root=folder, repo_root=REPO_ROOT)
    assert catalog.lock_new_versions() == ["own-check@1.0.0"]
    from stacks.platform import PlatformStage

    environment_file = _dev_enabling(tmp_path_factory.mktemp("config"), "own-check") / "dev.yaml"
    config = dataclasses.replace(load_environment(environment_file), account=ACCOUNT)
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stage = PlatformStage(app, config=config, catalog=catalog)
    assembly = app.synth().get_nested_assembly(stage.artifact_id)
    templates = {stack.stack_name: stack.template for stack in assembly.stacks}
    return Path(assembly.directory), stage.launcher.stack_name, templates


@pytest.mark.slow
def test_a_run_the_program_would_refuse_creates_no_job_through_the_launcher(own_launcher):
    assembly_dir, stack, templates = own_launcher
    with launcher_in_moto(assembly_dir, stack, templates, []) as harness:
        misspelled = harness.run({"template": "own-check", "run_name": "typo",
                                  "overrides": {"lerning_rate": 0.1}})
        out_of_bounds = harness.run({"template": "own-check", "run_name": "beta",
                                     "overrides": {"adam_beta2": 1.5}})
        function = next(iter(harness.launcher.functions.values()))
    for run, message in ((misspelled, "unknown hyperparameter 'lerning_rate'"),
                         (out_of_bounds, "invalid hyperparameter 'adam_beta2': got 1.5")):
        assert run.status == "FAILED" and run.error == "InvalidRunInput", (run.error, run.cause)
        assert f"the training program refuses this run: {message}" in run.cause
    assert harness.jobs.requests == []
    # The function checked with the contract of the frozen code it bundles, beside the registry.
    bundled = json.loads((function.code_dir / "templates" / "catalog.lock").read_text())["templates"]
    code = bundled["own-check"]["1.0.0"]["code"]
    assert (function.code_dir / "templates" / "_code" / f"{code.removeprefix('sha256:')}.tar.gz").is_file()
    assert (function.code_dir / "training_jobs" / "contract" / "hyperparameters.py").is_file()
    assert not (function.code_dir / "training_jobs" / "trainer").exists()


def test_render_checks_with_the_contract_it_is_given():
    spec = CATALOG.get("llama-pretrain-fsdp", "1.2.0")
    frozen = archive_contract(CATALOG.snapshot_path(CODE_1_0_0).read_bytes(), CODE_1_0_0)
    run = RunInput(run_name="r1", overrides={"checkpoint_async": False})
    with pytest.raises(ProgramSettingError, match="unknown hyperparameter 'checkpoint_async'"):
        render(spec, run, PLATFORM, frozen)  # 1.0.0's program wrote its checkpoints synchronously
    request = render(spec, run, PLATFORM, CATALOG.program_contract(spec))
    assert request["HyperParameters"]["checkpoint_async"] == "false"
