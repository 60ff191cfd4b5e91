"""Lightning's ``LambdaCallback``: a callback made on the spot from functions, one per hook."""

from __future__ import annotations

from typing import Callable

from trainscale.callbacks.base import HOOKS, Callback


class LambdaCallback(Callback):
    """A callback whose hooks are the functions given by hook name; the others do nothing (Lightning's
    ``LambdaCallback``). Each is called as that hook of a :class:`Callback`: ``fn(trainer, pl_module, *args)``.

        from trainscale.callbacks import LambdaCallback

        report = LambdaCallback(on_train_epoch_end=lambda trainer, module: print(trainer.current_epoch))
        trainer = Trainer(callbacks=[report])

    Args:
        **hooks: a function per hook (``setup``, ``teardown``, ``on_fit_start``, ... every ``on_*`` hook of
            :class:`Callback`); None for a hook is as if it were not given.

    Raises:
        TypeError: a name that is not a hook of :class:`Callback` (the hooks are listed).
    """

    def __init__(self, **hooks: Callable | None) -> None:
        names = HOOKS | {"setup", "teardown"}
        unknown = sorted(set(hooks) - names)
        if unknown:
            raise TypeError(f"LambdaCallback got {unknown[0]!r}, which is not a Callback hook; the hooks: "
                            f"{', '.join(sorted(names))}")
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)
