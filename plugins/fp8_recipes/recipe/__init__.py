"""The typed recipe: its schema (``schema``), the guarded YAML reader every recipe file goes through (``yaml_guard``)
and the shipped pack with its search path (``pack``). First step of the flow YAML -> Recipe -> PrecisionPlan."""
