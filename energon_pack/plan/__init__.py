"""Whole-dataset plans: every pack of a dataset fixed before training, on Ray Data.

:func:`plan_dataset` measures each row exactly as the loaders will see it (the same encoder,
media probed from their headers), packs all rows at once (first fit decreasing within the row
and the vision caps) and lays the packs out as optimizer steps over the data-parallel ranks,
balanced for the vision encoder on request; :class:`Plan` reads the result back. The exact
number of packs and steps of an epoch is known before the first one is trained.
:class:`PlannedDataset` trains from it (item ``i`` is pack ``i``, read by random access) and
:class:`PlanSampler` gives each rank its packs, resumable on any number of ranks and workers
from the packs consumed.

One module per concern: ``spec`` (:class:`PlanSpec`), ``measure`` (a row's counts, on Ray
Data), ``first_fit`` (first fit decreasing by runs), ``pack`` (packs and steps), ``store``
(the plan directory), ``build`` (:func:`plan_dataset`), ``dataset``
(:class:`PlannedDataset`), ``sampler`` (:class:`PlanSampler`). The sources and the engine that reads
them live in :mod:`energon_pack.sources`.
"""

from typing import TYPE_CHECKING

from energon_pack._moved import lazy

if TYPE_CHECKING:  # the public names, for type checkers (read lazily below)
    from energon_pack.plan.build import plan_dataset
    from energon_pack.plan.dataset import PlannedDataset, PlanOrder
    from energon_pack.plan.sampler import PlanSampler
    from energon_pack.plan.spec import PlanSpec
    from energon_pack.plan.store import Plan

_HOMES: dict[str, str] = {
    "plan_dataset": "energon_pack.plan.build",
    "PlannedDataset": "energon_pack.plan.dataset",
    "PlanOrder": "energon_pack.plan.dataset",
    "PlanSampler": "energon_pack.plan.sampler",
    "PlanSpec": "energon_pack.plan.spec",
    "Plan": "energon_pack.plan.store",
}
"""Public name -> the module it is imported from on its first read (PEP 562)."""

__all__ = ["Plan", "PlanOrder", "PlanSampler", "PlanSpec", "PlannedDataset", "plan_dataset"]

if not TYPE_CHECKING:  # every public name on its first read
    __getattr__, __dir__ = lazy(__name__, _HOMES)
