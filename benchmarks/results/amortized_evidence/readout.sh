#!/usr/bin/env bash
# Copies one finished evidence run into its folder here and writes what READOUT.md reads from it, with the
# commands users run (nothing is recomputed by hand). Run from the repository root:
#   bash benchmarks/results/amortized_evidence/readout.sh RUN_DIR DATASET SEED [PYTHON] [OUT_DIR]
# (OUT_DIR: a pilot's folder elsewhere in benchmarks/results; default: this folder's DATASET_SEED)
set -euo pipefail
run=${1:?run directory}; dataset=${2:?dataset}; seed=${3:?seed}; py=${4:-.venv/bin/python}
out=${5:-benchmarks/results/amortized_evidence/${dataset}_${seed}}
[[ -s $run/records.jsonl ]] || { echo "no records in $run" >&2; exit 1; }
mkdir -p "$out"
for f in records.jsonl run.json results.md summary.json comparisons.json accuracy_over_stream.png amortized.png; do
  if [[ -e $run/$f ]]; then cp "$run/$f" "$out/"; else echo "missing: $run/$f" >&2; fi
done
"$py" -m elm_memory.cli report "$run" > "$out/report.txt"
"$py" -m benchmarks.amortized_readings "$run" > "$out/readings.txt"
"$py" -m benchmarks.gate_share_replay "$run" --shares 1.0 --test non_inferiority > "$out/gate_replay_non_inferiority.json"
# the stream memory's own log and gate (one namespace per run), and the summary the run wrote at its end
ns=$(find "$run/stream/amortized" -mindepth 1 -maxdepth 1 -type d | head -1)
cp "$ns/history.jsonl" "$ns/gate.json" "$out/"
cp "$run/stream/amortized/summary.json" "$out/stream_summary.json"
echo "wrote $out"
