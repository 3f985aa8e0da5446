"""What a layer costs and does, beside running it: the analytic cost model (costs.py; the GPU +
host split's: costs_hybrid.py, at the rates of gpu_figures.py where none is measured), measured
stages joined with it (profile.py), the dual map (mapplot.py: layer_map), tokens per expert
(routing.py: routing_summary) and the three rulers of `python -m qwen3layer check` (rulers.py).

This package imports none of its modules: importing one of them loads only what that one needs
(qwen3layer's own imports and what tests/tools/test_import_graph.py reads stay the same)."""
