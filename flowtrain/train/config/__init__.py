"""A training run's settings, in one place: declared, defaulted, checked, then made into flags.

Read it in this order:

1. **Declaration** (:mod:`.run_config`): :class:`~.run_config.TrainConfig` declares every
   setting of ``flowtrain train`` once, each field annotated with a
   :class:`~.settings.Setting` (its ``--help`` text, its bounds, how the command line spells
   it). :mod:`.settings` is the machinery that reads those annotations back
   (:func:`~.settings.fields_of`) and checks values against them. The module also turns the
   settings into what the run needs: the model (``load_model_config``), the LoRA spec
   (``lora_spec``), the compute dtype's size (``precision_bytes``).
2. **Defaults** (:mod:`.defaults`): the numbers a user looks up (``STEPS``, ``BATCH_SIZE``,
   ``SEQ_LEN``, ...), in a module that imports nothing so that ``--help`` stays light; the
   field defaults are taken from it. Fields left ``None`` are decided by the run: the
   optimizer's by where the weights come from (``optimizer_defaults``, applied by
   ``flowtrain.train.prepare.resolve_defaults``), ``seq_len`` by the data (``SeqLenDefault``).
3. **Checks** (:mod:`.checks`): ``check_fields`` refuses a value its declaration does not
   accept (:func:`~.settings.check_values`) and what a declaration cannot say (upper bounds,
   the seed's range, a micro-batch that does not divide the batch); ``check_compile_backend``,
   ``check_inputs_kept`` (no output on an input) and ``check_output_paths`` come before anything
   is read; ``check_with_model`` checks how the fields go together and with the model. Each
   refusal is one
   :class:`~flowtrain.errors.ConfigError` line that names the field in braces (``{lr}``):
   ``lr`` in Python, ``--lr`` on the command line.
4. **Flags** (``flowtrain/cli/flags.py``): argparse flags generated from the fields; the
   command line's job, so it lives in ``flowtrain.cli`` (which may import this package; this
   package imports nothing of the command line).

The path a run's settings take::

    flowtrain train --lr 1e-4 ...    cli/train.py       config_from_args: TrainConfig(**flag values)
    train(cfg) -> prepare(cfg)       train/prepare.py   check_compile_backend, check_inputs_kept,
                                                        check_output_paths, load_model_config,
                                                        resolve_defaults,
                                                        check_fields, check_with_model
    flowtrain plan / simulate        cli/plan.py        checked_request: the same TrainConfig and
                                                        checks, so they accept what train does

None of these modules imports torch (``check_compile_backend`` asks torch.compile only about
a backend other than auto, none or eager, and ``check_output_paths`` the checkpoint module only
about a non-empty ``--out``): ``flowtrain plan``, ``simulate`` and every
``--help`` read them without it.
"""
