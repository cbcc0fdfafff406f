"""Training: the trainer (orchestration), one update, precision, preemption, the batch iterators."""
