"""The operations functions' work, as a library: what the account's training fleet holds (`fleet`),
usage against Service Quotas (`quotas`, also `llmtrain quotas`), the warm-pool reaper
(`warm_pools`), job outcomes (`job_events`), and publishing metrics (`metrics`). Their entry points
are `llmtrain.handlers.quotas|warm_pools|job_events`, their settings
`llmtrain.core.function_settings`. Pure Python plus botocore: no compiled packages (the functions' code
ships none)."""
