"""The training program that runs inside the SageMaker PyTorch container (see docs/training.md)."""
