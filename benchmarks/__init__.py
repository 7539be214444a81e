"""On-demand measurements of elm-memory: ``python -m benchmarks.NAME --help`` from the repository root.

Each module writes its results under ``benchmarks/results/`` (JSON, or a run folder); what they measured
is in docs/results/. The package is not installed with elm-memory: it runs from a checkout.
"""
