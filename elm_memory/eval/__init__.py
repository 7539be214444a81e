"""Evaluation: benchmark data, ELM and its baselines as methods, the paper's online
(``online.run_stream``) and offline (``offline.run_offline``) protocols, metrics and reports."""
