"""Training inside a rank: the loop, the mesh, the optimizer, checkpoints, evals and the metrics
journal.

Knows nothing about Ray: `workers.orchestration` runs it in rank actors, `python -m workers.train`
under torchrun.
"""
