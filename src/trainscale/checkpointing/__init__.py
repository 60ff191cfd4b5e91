"""Checkpoints: run directories and "last", the checkpointer, background writes, RNG states."""
