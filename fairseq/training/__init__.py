"""Training: the trainer (orchestration), one update, precision, preemption, the batch iterators, and the epoch
loop that fairseq-train runs (loop.py)."""
