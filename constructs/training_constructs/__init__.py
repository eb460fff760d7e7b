"""Reusable AWS CDK constructs for training LLMs on Amazon SageMaker."""
