"""The high-level loop (Trainer), built on Runtime."""
