"""Per-target schedules of the ce_tvm compute (installed as ``ce_tvm.schedules``).

A target's module (``cpu``, ``cuda``, ``ascend``: what
``ce_tvm.compiler.build.schedule_module`` imports) takes an unscheduled
PrimFunc from ``ce_tvm.kernels`` and returns it scheduled. What the compiler
and the tuner read from it (``options`` are the schedule's own, the ascend
profile, say):

- the schedules, each ``(func, target, **options)``: ``forward`` (also of a
  vocabulary shard's statistics, of probability targets and of the
  log-probs), ``backward`` (also of their gradients), ``per_row`` (the
  shard combine), ``train`` (the one-pass training kernel; none is built
  for a module without it) and ``divergence``; a function named after an op
  comes first (ascend's ``log_probs``; ``compiler.build.SCHEDULE_OF_OP``);
- what the compute is declared with: ``forward_chunk(classes, dtype,
  target, **options)``, the chunk a row is reduced in, or ``<op>_chunk``
  for one op (the CPU's and ascend's ``train_chunk``, ascend's
  ``log_probs_chunk``); where
  defined, ``stages_chunk(op, classes, dtype, target, variant, **options)``
  (whether ``op``'s chunk is staged; a tuning record's summary may say
  otherwise: ``stage``), ``exp_scaling(target)``, ``shifts_rows(target)`` and the
  lowering choices ``EXP_NAN_TEST``, ``PEELS_LAST_CHUNK``, ``ONE_HOT_BY_CHUNK``
  and ``KEEPS_CHUNK_EXP`` (``kernels.fastmath``, ``kernels.choices``);
- how it is compiled, where defined: ``PASS_CONFIG`` (pass options) and
  ``TIR_PIPELINE`` (the name of a registered lowering pipeline);
- for the tuning search (``cpu``, ``cuda``): ``knob_space(op, classes,
  dtype, target)``, ``knob_chunk(op, classes, dtype, target, knobs)``,
  ``schedule_knobs(sch, op, target, space, decisions)`` and, where
  defined, ``finish(func)``, applied to what ``schedule_knobs`` scheduled.

``ascend_plan`` is the Ascend tiling plan and cost model (``ce-tvm plan``;
``ce-tvm tune`` searches it). Schedules know TVM primitives and the
compute's stage names (the constants of ``ce_tvm.kernels``); they never
know torch or the cache, and the target modules never know each other:
what they share is in ``_common``. ``cpu_knobs`` holds the CPU schedule's
sizes and knobs.
"""
