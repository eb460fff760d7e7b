"""The platform's torch-free core: what a job template is and what it becomes.

The template model (`spec`), the catalog and its lock (`catalog`), the request a run renders to
(`render`, checked by `validate`), the training program's contract as the platform reads it
(`program_contract`, `token_data`), the environment configuration model (`environments`), the platform
context a team's functions and the CLI receive (`platform`, with `queue_context` and `queue_policy`),
instance and image facts (`instances`, `images`), run records (`runs`), the Lambda functions' settings
(`function_settings`), the deployed environment's record (`deployed`), failure classes (`failures`) and
errors (`errors`).

Imports only the standard library, pyyaml, botocore/boto3 and `training_jobs.contract`; every other
layer of llmtrain builds on it, and the construct library imports nothing else of llmtrain
(docs/architecture.md, "Layers"; import-linter checks both).
"""
