"""The training loop: Trainer, its configuration, evaluation, records and progress."""
