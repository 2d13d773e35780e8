"""The ML core: datasets (data/), networks and their layers (models/),
optimization by parameter groups (optim/), the input pipeline (pipeline.py),
precision policies (precision.py), the compiled training step (steps.py)
and evaluation (eval_views.py).

It imports nothing from the run's lifecycle (training/) or the process
plumbing (process/), and no TrainConfig: it takes plain arguments and the
specs its registries declare (tests/product/test_layout.py walks the imports).
Extending it: docs/extending.md.
"""
