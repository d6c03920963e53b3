"""Observers: numerics statistics and tensor dumps (``debug:`` config), hooked into a precision backend.

Importing this package has no side effects; the submodules are imported where used:
``observe.config`` (the typed ``debug:`` section), ``observe.stats`` (pure torch: per-operand statistics),
``observe.recorder`` (attaches to either backend: the emulated one's states, or TE's through
``backends.te_observe``; writes numerics.jsonl, TensorBoard, the heat map, dumps), ``observe.routing`` (an MoE
run's routing.jsonl), ``observe.heatmap`` (the heat maps, by module and by expert), the doctor
(``observe.doctor`` and its ``doctor_*`` modules, pure functions over the run's rows) and the autopilot
(``observe.autopilot_config``, the typed ``autopilot:`` section; ``observe.autopilot`` and its ``autopilot_*``
modules, pure decisions over one statistics step's rows).
"""
