"""llmtrain: job templates, rendering, validation, the launcher functions, the CLI and the local runner."""
