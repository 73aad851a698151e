"""The memory plan: what a run keeps where, and whether it fits.

Owns the decision (:mod:`.planner`: ``plan_run``, layout, placement, activations, the slot
budgets the engine enforces), the host and GPU byte counts of a run and the card and host
budgets (:mod:`.memory`), what would make a run that does not fit fit (:mod:`.suggest`), which
layers save their attention output (:mod:`.attention`), how the host buffers are laid out
(:mod:`.buffer_sizes`), what a mixture of experts' routing keeps (:mod:`.experts`), what
LoRA's adapters add (:mod:`.adapters`) and the request every count reads (:mod:`.request`). It
reads the model's layouts and compiles the step graph, and imports neither training nor the
simulator: the choices that need a prediction (micro-batch order, placement) ask the simulator
from above (:mod:`flowtrain.sim.choose_plan`).
"""
