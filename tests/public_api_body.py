"""Run on a rank forked by ``tests.helpers.run_distributed``: a process that has imported torch but not yet
trainscale, so the subpackages' imports below are the first, as in a user's fresh interpreter. This module
imports nothing of trainscale at its top for that reason."""


def documented_calls_after_subpackage_imports(rank: int) -> str:
    import trainscale.plan, trainscale.check, trainscale.bench, trainscale.tune  # noqa: E401
    import trainscale
    from trainscale.plan import plan
    from trainscale.check import check
    from trainscale.bench import sweep
    from trainscale.tune import find_batch_size

    for name in trainscale.__all__:
        getattr(trainscale, name)
    assert callable(plan) and callable(check) and callable(sweep) and callable(find_batch_size)
    assert trainscale.plan.plan is plan and trainscale.check.check is check
    trainscale.seed_everything(3)
    w = trainscale.World()
    assert w.world_size == 1 and trainscale.Trainer and trainscale.Runtime and trainscale.TrainingModule
    return "ok"
