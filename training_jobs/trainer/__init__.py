"""The parts of the training program; training_jobs/train.py wires them together."""
