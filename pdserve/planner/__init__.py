"""The planner: `pdserve profile` measures a machine's step costs, `pdserve plan` searches P:D splits
and per-role settings on them with the PD simulator (planner/pd_simulate.py)."""
