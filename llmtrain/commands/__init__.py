"""Command groups of the `llmtrain` CLI: one module per group, each with `register(subparsers)`."""
