"""Datasets: the packaged benchmark problems (their files stay under ``elm_memory/eval/data``)."""
