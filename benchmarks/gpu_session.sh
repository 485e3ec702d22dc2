#!/usr/bin/env bash
# What a session with one lent GPU runs first (docs/development.md, "When a GPU is lent"), in one call:
# `fived calibrate` on the GPU, the acceptance checks (compiled runs last), and the planner against
# fived's measured steps for one-GPU layouts of a 1B model, priced by the catalogue and by the profile.
# Everything lands in $OUT (default ./gpu-out): gpu.json (the profile), session.log, and each
# script's .json/.md. BUDGET_S bounds the whole run (default 540 s): the compiled checks get what is left.
# Runs from a source tree without installing fived (PYTHONPATH), as on a machine with no package index.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# (the scripts below refuse to write over reports they did not write; the log is checked here)
if [ -e "$OUT/session.log" ] || [ -L "$OUT/session.log" ]; then
  echo "gpu_session: $OUT/session.log exists; name a new OUT" >&2
  exit 2
fi
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT/session.log") 2>&1
start=$SECONDS
left() { echo $(( ${BUDGET_S:-540} - (SECONDS - start) )); }
upto() { local t; t=$(left); echo $(( t < $1 ? (t > 1 ? t : 1) : $1 )); }  # a step's cap, within what is left
nvidia-smi -L
python3 -c "import torch, fived; print('torch', torch.__version__, torch.cuda.get_device_name(), 'fived', fived.__file__)" || exit 1
echo "== fived calibrate ($(left) s left)"
timeout "$(upto 150)" python3 -m fived calibrate --output "$OUT/gpu.json" --minutes "${CAL_MIN:-2}"
echo "== gpu_acceptance, compiled runs skipped ($(left) s left)"
timeout "$(upto 200)" python3 benchmarks/gpu_acceptance.py --out "$OUT" --skip compiled
echo "== gpu_layouts ($(left) s left)"
machine=()
[ -f "$OUT/gpu.json" ] && machine=(--machine "$OUT/gpu.json")
timeout "$(upto 300)" python3 benchmarks/gpu_layouts.py "${machine[@]}" --out "$OUT"
echo "== gpu_acceptance, compiled runs ($(left) s left)"
[ "$(left)" -gt 60 ] && timeout "$(left)" python3 benchmarks/gpu_acceptance.py --out "$OUT" --only compiled \
  --name gpu_acceptance_compiled
echo "== done in $((SECONDS - start)) s"
