"""The training program: what each task kind does to tensors.

The engine decides *when* a task runs and which slot it gets; this package decides *what* it
does. :class:`StepProgram` (:mod:`.core`) is the callable the engine runs for every task; it
looks the task's kind up in one table, :data:`HANDLERS`, and calls the handler registered
there. Handlers live with their concern, one module each:

==========================  ================================================================
module                      task kinds
==========================  ================================================================
:mod:`.fetching`            ``fetch``: weights from host memory into a slot
:mod:`.layers`              ``embed``, ``forward``, ``recompute``, ``backward``, ``embed_backward``
:mod:`.head`                ``loss``, ``eval_loss``
:mod:`.gradients`           ``zero_grad``, ``reduce_grad``, ``offload_grad``, ``grad_sq_norm``,
                            ``grad_norm``, ``found_inf``
:mod:`.updates`             ``cpu_adam``, ``gpu_adam``, ``verify_step``
:mod:`.act_offload`         ``offload_act``, ``fetch_act``
:mod:`.saving`              ``save``, ``sync_step``
:mod:`.disk`                ``read_state``, ``write_state`` (optimizer state on disk)
==========================  ================================================================

Features are parts the handlers are composed with, each chosen once per run rather than
asked about in every task body: :mod:`.training` (the whole model, or LoRA's adapters over a
frozen base), :mod:`.tied` (the head's own matrix, or the embedding's), :mod:`.experts` (a
mixture of experts' load-balancing loss and idle experts), :mod:`.finiteness` (steps whose
loss or gradients are not finite), and resident units (:class:`~.slots.Slots` answers a
resident unit's own device copies where a streamed one's slot would be). Adding a task kind or
a model family: docs/concepts.md.
"""

# each handler module enters its functions into HANDLERS when imported
from . import act_offload, disk, fetching, gradients, head, layers, saving, updates  # noqa: F401
from .core import StepProgram
from .registry import HANDLERS, Handler

__all__ = ["HANDLERS", "Handler", "StepProgram"]
