"""Peer training programs, each run as its own process by bench.run."""
