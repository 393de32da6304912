"""Training: the one ``trainer`` for every task (optimiser, schedule, precision, validation, exact resume),
``distributed`` (DDP under torchrun), ``runtime`` (threads, bf16 autocast) and ``progress`` (a progress
bar, or plain lines when standard error is not a terminal)."""
