#!/usr/bin/env bash
# Every GPU check redline has, in one run, for a machine with an NVIDIA GPU.
#
#   bash scripts/gpu-check.sh            # results in ./gpu-check-out/ (or $OUT when set)
#
# It runs the product (probe, doctor: terminal, JSON, HTML) against the real driver, records what
# nvidia-smi says for comparison, and runs the tests marked `gpu`. It changes nothing on the GPU:
# no clocks, power limits, modes or resets. Each issue that adds a GPU path adds its check here.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=0

step() {  # step NAME CMD...: run one check, keep its output, remember a failure, go on
    local name=$1; shift
    echo "== $name"
    if "$@" >"$out/$name.txt" 2>&1; then echo "   ok"; else echo "   FAILED (exit $?), see $out/$name.txt"; status=1; fi
}

step nvidia-smi nvidia-smi -q
step topology nvidia-smi topo -m
step probe "$py" -m redline probe -o "$out/probe.json"
step doctor bash -c '"$0" -m redline doctor --json --html "$1/doctor.html" >"$1/doctor.json"' "$py" "$out"
step doctor-terminal env COLUMNS=120 "$py" -m redline doctor
step pytest-gpu "$py" -m pytest -q -m gpu tests/gpu -p no:cacheprovider

echo
echo "== summary"
"$py" - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    snap = json.loads((out / "probe.json").read_text())
    for g in snap["gpu"]["gpus"]:
        print(f"GPU {g['index']}: {g['name']} cc {g['compute_capability']} "
              f"PCIe Gen{g['pcie']['gen_current']}/{g['pcie']['gen_max']} x{g['pcie']['width_current']}/{g['pcie']['width_max']} "
              f"power {g['power']['draw_w']}/{g['power']['enforced_limit_w']} W  reasons {g['clock_event_reasons']}")
    doc = json.loads((out / "doctor.json").read_text())
    print("doctor:", doc["counts"], "from", doc["rules_checked"], "rules")
    for f in doc["findings"]:
        print(f"  {f['severity']:4} {f['rule']}: {f['title']}")
except Exception as exc:  # the step logs above say what broke
    print("summary unavailable:", exc)
PY
tail -3 "$out/pytest-gpu.txt"
find "$out" -type f -empty -delete  # keep what comes back small
exit $status
