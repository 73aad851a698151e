"""The generic layer path: any Hugging Face decoder-only model, run by transformers' own modules.

flowtrain's native layer math (:mod:`flowtrain.model.functional`) is the fast path for the
families it has. Any other decoder-only model transformers ships runs here: the model is built
once on the meta device (:mod:`.skeleton`), described to the rest of flowtrain as units of named
tensors (:mod:`.describe`), and its modules are called over the streamed weights with
``torch.func.functional_call`` (:mod:`.calls`), in the same forward, recompute and backward
tasks as a native layer. Importing this package needs torch; building a skeleton needs
transformers.
"""
