"""The global batch size of a fit and the learning rate scaled to it (pure rules)."""
