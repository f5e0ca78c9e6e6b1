"""The research harness: what the experiments measure with the core library.

Timers, probes and byte / FLOP models (`benchmarking`); long-stream NLL
through a cache policy (`streaming`); published models' KV footprint
(`published`); the attention-variant ablation (`ablation`); the main job
behind `experiments/generate.py` (`job`); the synthetic long-context tasks
and their evaluation (`tasks`, `task_eval`); serving traces and
measurements (`serving`); where attention goes per layer and head, against
uniform attention (`attention_stats`).

The core (`kvjax.*`) never imports from here; `experiments/*.py` are short
mains over these modules.
"""
