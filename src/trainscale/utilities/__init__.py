"""Lightning's ``lightning.pytorch.utilities`` names that training scripts use, under the same names:
``from trainscale.utilities import rank_zero_only`` (also ``trainscale.utilities.rank_zero``, as
``lightning.pytorch.utilities.rank_zero``), ``is_picklable``; ``trainscale.utilities.model_helpers.is_overridden``,
``trainscale.utilities.types.LRSchedulerConfig`` and ``trainscale.utilities.exceptions.SIGTERMException`` as
Lightning's. Imports nothing of trainscale's other packages, nor torch.
"""

from trainscale.utilities.parsing import is_picklable
from trainscale.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["is_picklable", "rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]
