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
# a resume must not read a question twice in the gate (208d937): its readings against the records' (on stderr only)
"$py" - "$ns/gate.json" "$run/records.jsonl" >&2 <<'PY'
import json, sys
from elm_memory.eval.methods.amortized_method import recorded_gate_readings
from elm_memory.eval.records import RecordLog
held = json.load(open(sys.argv[1])).get("total_readings", 0)
read = recorded_gate_readings(RecordLog(sys.argv[2]).read())
print(f"gate readings {held}, records with a reading {read}: " + ("consistent" if held == read else "NOT CONSISTENT"))
PY
echo "wrote $out"
