"""Lightning's module contract: TrainingModule, hyperparameters, configure_optimizers, self.log, data hooks."""
