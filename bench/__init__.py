"""Side-by-side training benchmarks: our program against the HF Trainer, a plain loop and the machine."""
