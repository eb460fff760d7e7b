"""llmtrain: the platform's Python package, in layers that import only downward (docs/architecture.md,
"Layers"): `core` (torch-free: the template model, rendering, validation, the environment model, the
platform context), `planner`, `lifecycle` and `operations` (the Lambda functions' work, with their
entry points in `handlers`), `local` (the local runner), `client` and `commands` (the CLI, `cli`)."""

# The distribution that installs this package (pyproject.toml).
DISTRIBUTION = "llm-sagemaker-platform"
