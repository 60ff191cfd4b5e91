"""Lightning's ``PossibleUserWarning`` (``lightning.fabric.utilities.warnings``, re-exported by
``lightning.pytorch.utilities.warnings``): the class of the warnings that may be false positives, so that a script
can silence them as a group, as Lightning's users do::

    from trainscale.utilities.warnings import PossibleUserWarning
    warnings.filterwarnings("ignore", category=PossibleUserWarning)

trainscale warns with it where Lightning does: ``max_epochs`` left unset, modules in eval mode when ``fit`` starts.
"""

import warnings

__all__ = ["PossibleUserWarning", "disable_possible_user_warnings"]


class PossibleUserWarning(UserWarning):
    """Warnings that could be false positives (Lightning's class of the same name)."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore :class:`PossibleUserWarning` warnings (``warnings.filterwarnings``), as Lightning's function of the
    same name: from the modules whose name matches ``module`` (a regular expression), or from all ("")."""
    warnings.filterwarnings("ignore", module=module, category=PossibleUserWarning)
