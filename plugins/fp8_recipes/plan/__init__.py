"""The PrecisionPlan: what runs in which precision, per step, module and GEMM role (``precision``), its legalization
for Transformer Engine (``te``), its printing for plan.txt and ``explain`` (``format``) and the memory estimate it
implies (``memory``). Pure: nothing here executes a GEMM."""
