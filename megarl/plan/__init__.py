"""The planner: where a run's ranks and engines go and what each GPU holds, before anything is placed.

Pure arithmetic on the config and the model's sizes (no GPU; Ray only where :mod:`megarl.plan.placement` reserves
the pools and :mod:`megarl.plan.engine_gpus` probes their GPUs). ``megarl-plan`` prints the plan, and the trainer
refuses a run that does not fit (:func:`megarl.plan.preflight.preflight`). Modules, each importing only those
listed before it:

- :mod:`~megarl.plan.placement`: the placement plan (roles and engines on pool bundles), Ray's resource pools and
  the ranks' groups.
- :mod:`~megarl.plan.engine_gpus`: each engine server's GPUs and its SGLang launch command.
- :mod:`~megarl.plan.activations`: activation and micro-batch formulas.
- :mod:`~megarl.plan.memory`: the memory model, what each GPU holds in each phase.
- :mod:`~megarl.plan.all_to_all`: the expert-parallel all-to-all per step.
- :mod:`~megarl.plan.judge`: a generative judge's engines and their memory.
- :mod:`~megarl.plan.weight_sync`: the weight sync per step, its buckets and buffers as the transports
  (:mod:`megarl.sync`) report them.
- :mod:`~megarl.plan.run_plan`: the plan's figures as data.
- :mod:`~megarl.plan.report`: the printable plan and its refusal messages.
- :mod:`~megarl.plan.preflight`: the plan of a run (:func:`~megarl.plan.preflight.plan_run`) and the trainer's
  check.
"""
