#!/usr/bin/env bash
# The whole GPU check, the same way every time: unit tests, lessons executed and checked under nbval,
# benchmarks. Run from the repository root on a machine with an NVIDIA GPU, torch with CUDA and numba-cuda.
#
#   scripts/gpu_check.sh [STEP ...]      steps: env tests notebooks bench tune (default: env tests notebooks bench)
#
# Wheels for packages the machine lacks may wait in .whl/ (README, "Checking on a GPU"); they are
# installed into a private folder first. Everything the run produces is collected into one tarball,
# $OUT/gpu_results.tgz (OUT defaults to ./gpu-out): logs, executed notebooks, results files and figures.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT" logs
export PYTHONUNBUFFERED=1 WB_BACKEND=gpu
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests notebooks bench)
has() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true

status=0
run_step() {  # name, command...: log to logs/<name>.log, remember failures, go on with the next step
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "logs/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 25 "logs/$name.log"
  [ $rc -eq 0 ] || status=1
}

if has env; then
  { nvidia-smi; python3 -c "import sys, torch, numpy, numba; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('numpy', numpy.__version__, 'numba', numba.__version__)"; \
    python3 -c "import wb_kernels as wb; print(wb.banner())"; } > logs/env.log 2>&1
  cat logs/env.log
fi
if has tests; then
  run_step tests python3 -m pytest -q -p no:cacheprovider tests -x --timeout=900 -o addopts=""
fi
if has notebooks; then
  run_step execute python3 scripts/execute_notebooks.py
  run_step nbval python3 -m pytest -q -p no:cacheprovider notebooks --nbval --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg
fi
if has bench && python3 -c "import wb_kernels.bench" 2>/dev/null; then
  run_step bench python3 -m wb_kernels.bench --preset all --out results/ --figures
fi
if has tune; then
  for script in scripts/tune_*.py; do
    [ -e "$script" ] && run_step "$(basename "$script" .py)" python3 "$script" --out results/
  done
fi

tar czf "$OUT/gpu_results.tgz" logs notebooks $(ls -d results figures 2>/dev/null)
echo "== collected into $OUT/gpu_results.tgz; overall status $status"
exit $status
