#!/usr/bin/env bash
# The whole GPU check, the same way every time: unit tests, lessons executed and checked under nbval,
# benchmarks. Run from the repository root on a machine with an NVIDIA GPU, torch with CUDA and numba-cuda.
#
#   scripts/gpu_check.sh [STEP ...]      steps: env build traffic tests properties accuracy bench notebooks tune
#                                        tokens distributed
#                                        (notebooks = execute, then nbval; each may be named alone)
#                                        (default: all but tune, tokens and distributed, in that order: the lessons
#                                        come after the benchmark because the dashboard lesson shows the newest results file)
#   NOTEBOOKS="notebooks/04_*.ipynb" scripts/gpu_check.sh notebooks     only some lessons
#   TESTS="tests/test_flash.py" scripts/gpu_check.sh tests             only some tests
#   TUNE_RUNGS="mma" TUNE_ARGS="--quick" scripts/gpu_check.sh tune     only some rungs' tuning, fewer lengths
#   BENCH_PRESET=decode scripts/gpu_check.sh bench     the decode preset instead of "all": wb.decode against SDPA,
#                                        FlexAttention and a copy, into results/decode/bench_<gpu>.json (about
#                                        5 min on an H100; BENCH_PRESET=decode-bar: its bar shapes, about 2.5 min)
#   BENCH_PRESET=hopper-bar scripts/gpu_check.sh build bench    the hopper rung's bar (issue 31) against mma, SDPA
#                                        FLASH/cuDNN and FlashInfer fa3 into results/hopper/bench_<gpu>.json, the table
#                                        of TFLOP/s and ratios to cuDNN in logs/bench.log (about 3 min on an H100)
#   scripts/gpu_check.sh build backward the gradients (lesson 08): the backward benchmark's bar problems and the
#                                        per-call cost (BACKWARD_PRESET=backward for all of it, 12-20 min) into
#                                        results/backward/bench_<gpu>.json, then the character-level transformer
#                                        trained with the mma stage and with SDPA into results/train/ (a few minutes)
#   scripts/gpu_check.sh build variants the triton stage's variants against FlexAttention (lesson 11): the bar
#                                        preset (L 4096 D128 fp16, every variant, forward and fwd+bwd, beside SDPA
#                                        FLASH/cuDNN, mma and hopper for plain and causal) into
#                                        results/triton/variants_<gpu>.json, its table and the issue's bars in
#                                        logs/variants.log. At most VARIANTS_LIMIT (540) s; rows stop starting 60 s
#                                        before it and the same command resumes the file (FlexAttention's compilations
#                                        may need a second run). VARIANTS_PRESET=full, window-sweep, memory or all: the
#                                        other presets, into the same file
#   scripts/gpu_check.sh build hopper-backward   the Hopper rung's backward (issue 47): the dQ product alone, the
#                                        checks against float64 and the deterministic mode, memcheck (watchdog 60 s),
#                                        tests/test_hopper_backward.py (about 10 min at most)
#   scripts/gpu_check.sh build gemv     the decode step's GEMV kernels (issue 48): checks, sanitizers, tests, then
#                                        the benchmark into results/gemv/bench_<gpu>.json and variants_<gpu>.json
#   scripts/gpu_check.sh build tokens   the decoder's tokens/s with SDPA and wb.decode (lesson 07), into
#                                        results/decode/decoder_<gpu>.json (about 1 min on an H100 after build)
#   scripts/gpu_check.sh distributed    exact attention across GPUs (issue #32; needs 2 or more GPUs of one host):
#                                        builds the mma extensions, runs every method on NCCL in float16 and bfloat16
#                                        graded by wb.check's rule, then the scaling benchmark against one GPU and
#                                        PyTorch's context_parallel into results/distributed/scaling_<gpu>x<W>.json
#                                        (copied to $OUT; put it back into results/distributed/ and the same command
#                                        resumes it). At most DIST_LIMIT (480) s plus the wheels: the benchmark gets
#                                        what the build and the checks leave. DIST_WORLD=4: four GPUs;
#                                        DIST_SCALING_ARGS="--dtypes float16": passed on to the benchmark
#   scripts/gpu_check.sh release K/N    part K of N of the release: every GPU test, every property test and every
#                                        lesson (executed in place, then under strict nbval) at one named commit, in N
#                                        parts of under RELEASE_LIMIT (540) s each (N = 3: release 1/3, 2/3, 3/3), so
#                                        that a machine with a per-command time limit can run them one command each.
#                                        Each part builds the CUDA extensions (cached where the machine is reused), then runs its share of
#                                        the test files (pytest-xdist, TESTS_WORKERS=6) beside its share of the lessons
#                                        (LESSON_WORKERS=4 at once), and records each unit's counts and verdict in
#                                        results/status/<gpu>.json ("release": the commit, each part, whether every
#                                        part passed). Resumable: a part that passed at the commit is skipped, and a
#                                        part stopped by its limit, run again, runs only its units (the test files,
#                                        the property suite, each lesson) that have not passed. $OUT gets
#                                        release_KofN.tgz (the part's logs and junit files, its executed lessons, the
#                                        status file, the README with its status block rendered from it, results and
#                                        figures it wrote) and <gpu>.json: unpack the tarball at the repository's root
#                                        before the next part (a reused machine also keeps a copy of the status in
#                                        logs/release/; the README must match the status file for
#                                        tests/test_status.py). The shares are balanced by the seconds each file and
#                                        lesson took in the last release (`python3 scripts/status.py release-plan 3`
#                                        prints them). The commit is WB_GIT_COMMIT, else git's HEAD; the part stops
#                                        starting and stops its commands RELEASE_LIMIT (540) s after the script began.
#   WB_GIT_COMMIT=<commit>: the commit results files record, when this copy's .git is not the one it came from
#   TESTS_WORKERS=8 (default): pytest-xdist processes sharing the GPU for the unit tests; 0 = one process
#   PROPERTIES_WORKERS=5 (default): the same for the property tests (one stage each); 0 = one process
#   PROPERTIES_K="gradients": only the property tests whose names match (pytest -k), e.g. after a backward change
#
# Wheels for packages the machine lacks may wait in .whl/ (README, "Checking on a GPU"); they are
# installed into a private folder first. Output goes to $OUT (default ./gpu-out) as it happens:
# gpu_check.log, and gpu_results.tgz (logs, executed notebooks, results, figures), re-packed after
# every step so that a run stopped part-way still returns what it finished.
set -uo pipefail
if [ "${1:-}" = release ] && ! [[ "${2:-}" =~ ^[0-9]+/[0-9]+$ ]]; then  # before anything is written or removed
  echo "usage: scripts/gpu_check.sh release K/N (e.g. release 1/3)"; exit 2
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT" logs
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 WB_BACKEND=gpu
export WB_FAILURE_LOG=$PWD/logs/failures.log  # conftest.py: each failure's traceback as it happens
rm -f "$WB_FAILURE_LOG"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env build traffic tests properties accuracy bench notebooks)
release_part=""
if [ "${steps[0]}" = release ]; then  # release K/N: nothing but that part (below)
  release_part=${steps[1]}
  steps=(release)
fi
has() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

if compgen -G ".whl/*.whl" >/dev/null; then
  # once per machine: several checks may run side by side (e.g. nbval next to the tests) after a first one
  if [ ! -e /tmp/site/.wb_installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
    touch /tmp/site/.wb_installed
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}  # (a caller's own paths, e.g. a contender's, stay)
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true

gpu_name() { python3 scripts/status.py gpu; }  # h100, h200, ...: the name results and status files carry
# the modules the steps run (python -m); tests/test_status.py checks that each exists
TOKENS_MODULE=wb_kernels.bench.decoder_tokens
SCALING_MODULE=wb_kernels.stages.distributed.scaling
DIST_RUN_MODULE=wb_kernels.stages.distributed.run
TRAIN_MODULE=wb_kernels.models.char_transformer
TRAFFIC_MODULE=wb_kernels.stages.naive.traffic
pack() {
  if [ -n "$release_part" ]; then pack_release; return; fi
  tar czf "$OUT/gpu_results.tgz" logs notebooks $(ls -d results figures 2>/dev/null)
}
status=0
run_step() {  # name, seconds, command...: log to logs/<name>.log and $LOG, stop it after `seconds`
  # (STEP_ECHO=1: its output on the console too, as it comes, for a long step whose lines are its progress)
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  if [ -n "${STEP_ECHO:-}" ]; then
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "logs/$name.log" | tee -a "$LOG"
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "logs/$name.log" >> "$LOG"
  fi
  local rc=${PIPESTATUS[0]}
  last_rc=$rc
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ -n "${STEP_ECHO:-}" ] || tail -n 15 "logs/$name.log"
  [ "$rc" -eq 0 ] || status=1
  pack
}

if has env; then
  { nvidia-smi; python3 -c "import sys, torch, numpy, numba; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('numpy', numpy.__version__, 'numba', numba.__version__)"; \
    python3 -c "import wb_kernels as wb; print(wb.banner())"; } > logs/env.log 2>&1
  tee -a "$LOG" < logs/env.log
fi
build_rungs() {  # [RUNG ...]: those rungs' extensions (default: every CUDA C++ rung's), side by side
  local rungs=("$@") script rung
  if [ ${#rungs[@]} -eq 0 ]; then
    for script in wb_kernels/stages/*/build.py; do rungs+=("$(basename "$(dirname "$script")")"); done
  fi
  for rung in "${rungs[@]}"; do
    run_step "build_$rung" "${BUILD_LIMIT:-300}" python3 -c "import time, wb_kernels; from wb_kernels.stages.$rung import build; \
t = time.time(); build.build(build.package_source()); print(f'$rung extension ready in {time.time() - t:.1f} s')" &
  done
  wait  # (run_step's status is lost in the background: a failed build is caught here)
  for rung in "${rungs[@]}"; do
    grep -q "extension ready" "logs/build_$rung.log" || { echo "build of $rung failed" | tee -a "$LOG"; status=1; }
  done
}
if has build; then
  # every CUDA C++ rung's extension (wb_kernels/stages/<rung>/build.py), built once into the cache that the tests
  # and lessons then load in milliseconds; side by side (nvcc uses one core each; a cold build takes 1-1.5 min)
  build_rungs
fi
if has traffic; then
  run_step traffic "${TRAFFIC_LIMIT:-240}" python3 -m "$TRAFFIC_MODULE" --timeout $(( ${TRAFFIC_LIMIT:-240} - 20 ))
fi
if has tests; then
  workers=()
  if [ "${TESTS_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then workers=(-n "${TESTS_WORKERS:-8}"); fi
  # shellcheck disable=SC2086
  # -v: every test's name and verdict is in the log as it finishes, so a run stopped at its limit
  # still says which tests failed (pytest's own summary only comes at the end). The property tests
  # have their own step, where hypothesis reports how many examples each ran.
  run_step tests "${TESTS_LIMIT:-420}" python3 -m pytest -v --tb=line -p no:cacheprovider "${workers[@]}" \
    --junitxml=logs/tests.xml ${TESTS:-tests} --ignore=tests/test_properties.py -W ignore::numba.core.errors.NumbaPerformanceWarning
  grep -E "(FAILED|ERROR)( |$)" logs/tests.log | tee -a "$LOG" | head -n 40
fi
if has properties; then
  # the "gpu" hypothesis profile (chosen automatically on a GPU): larger shapes, more examples
  # One stage per pytest-xdist worker when it is installed; -rP prints each stage's count of problems checked.
  prop_workers=()
  if [ "${PROPERTIES_WORKERS:-5}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    prop_workers=(-n "${PROPERTIES_WORKERS:-5}")
  fi
  run_step properties "${PROPERTIES_LIMIT:-300}" python3 -m pytest -v -rP --tb=short -p no:cacheprovider \
    "${prop_workers[@]}" ${PROPERTIES_K:+-k "$PROPERTIES_K"} --junitxml=logs/properties.xml tests/test_properties.py -W ignore::numba.core.errors.NumbaPerformanceWarning
  grep -E "(FAILED|ERROR)( |$)|random problems matched" logs/properties.log | tee -a "$LOG" | head -n 60
fi
if has accuracy; then
  # each fp32 stage's error next to every PyTorch path's, from ordinary to very peaked softmax
  run_step accuracy 150 python3 scripts/error_vs_pytorch.py
fi
if has bench; then
  # BENCH_PRESET=decode (or decode-bar) writes results/decode/bench_<gpu>.json instead of results/bench/, hopper-bar
  # results/hopper/bench_<gpu>.json
  run_step bench "${BENCH_LIMIT:-600}" python3 -m wb_kernels.bench --preset "${BENCH_PRESET:-all}" --time-failed-checks \
    --time-budget $(( ${BENCH_LIMIT:-600} - 60 ))  # a run cut short is resumed by the same command
fi
if has notebooks || has execute; then
  # shellcheck disable=SC2086
  # --timeout caps each cell; see scripts/execute_notebooks.py for why it is short
  run_step execute "${EXECUTE_LIMIT:-600}" python3 scripts/execute_notebooks.py --timeout "${CELL_TIMEOUT:-150}" \
    ${NOTEBOOKS:-}
fi
if has notebooks || has nbval; then
  # one lesson per process: nbval needs each notebook's cells in order on one worker (--dist loadscope)
  nb_workers=()
  if python3 -c "import xdist" 2>/dev/null; then nb_workers=(-n "${NBVAL_WORKERS:-6}" --dist loadscope); fi
  # shellcheck disable=SC2086
  # -v: each cell is named as it finishes, so a run stopped at its limit still says which lesson failed
  run_step nbval "${NBVAL_LIMIT:-600}" python3 -m pytest -v -p no:cacheprovider "${nb_workers[@]}" --junitxml=logs/nbval.xml \
    ${NOTEBOOKS:-notebooks} --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
    --nbval-cell-timeout "${CELL_TIMEOUT:-150}"
  grep -E "(FAILED|ERROR)( |$)" logs/nbval.log | tee -a "$LOG" | head -n 40
fi
if has tune; then
  # every rung with a tuning script: wb_kernels/stages/<rung>/tune.py, results into results/<rung>/
  # TUNE_RUNGS="mma" only some rungs; TUNE_ARGS="--quick" passed on to each tune.py
  for script in wb_kernels/stages/*/tune.py; do
    rung=$(basename "$(dirname "$script")")
    if [ -n "${TUNE_RUNGS:-}" ] && [[ " $TUNE_RUNGS " != *" $rung "* ]]; then continue; fi
    gpu=$(gpu_name)
    run_step "tune_$rung" "${TUNE_LIMIT:-420}" python3 -m "wb_kernels.stages.$rung.tune" ${TUNE_ARGS:-} \
      --json "results/$rung/tune_$gpu.json"
  done
fi
if has backward; then
  gpu=$(gpu_name)
  run_step backward_bench "${BACKWARD_LIMIT:-300}" python3 -m wb_kernels.bench --preset "${BACKWARD_PRESET:-backward-bar}" \
    --no-progress --time-budget $(( ${BACKWARD_LIMIT:-300} - 60 ))  # resumed by the same command
  mkdir -p results/train
  run_step train "${TRAIN_LIMIT:-240}" python3 -m "$TRAIN_MODULE" --stage mma --steps "${TRAIN_STEPS:-300}" \
    --no-progress --json "results/train/char_transformer_$gpu.json" --figure
fi
if has variants; then
  # the triton stage's variants against FlexAttention given the same modifications (wb_kernels/bench/variants.py)
  gpu=$(gpu_name)
  run_step variants "${VARIANTS_LIMIT:-540}" python3 -m wb_kernels.bench.variants --preset "${VARIANTS_PRESET:-bar}" \
    --no-progress --json "results/triton/variants_$gpu.json" --time-budget $(( ${VARIANTS_LIMIT:-540} - 60 ))
fi
if has hopper-backward; then
  # the Hopper rung's backward (issue 47; not yet the stage's Backward): the dQ product alone first (a wrong wgmma
  # descriptor shows there alone), then the quick and full checks against float64, the deterministic mode's bits and
  # its cost, memcheck and racecheck, and the rung's backward tests. Every launch has the barrier watchdog.
  has build || build_rungs hopper
  run_step hopper_dq_product 120 python3 -m wb_kernels.stages.hopper.gpu_checks dq_product
  run_step hopper_backward_quick 300 python3 -m wb_kernels.stages.hopper.gpu_checks backward_quick
  run_step hopper_backward 600 python3 -m wb_kernels.stages.hopper.gpu_checks backward deterministic
  # memcheck slows the kernels past the 2 s watchdog (a false trap in the deterministic mode's waits): a build with
  # 60 s instead. No racecheck: it does not see the TMA's, the bulk copies' and wgmma's accesses (the async proxy)
  WB_WATCHDOG_SECONDS=60 run_step hopper_backward_memcheck 600 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 -m wb_kernels.stages.hopper.gpu_checks dq_product backward_quick
  run_step hopper_backward_tests 900 python3 -m pytest tests/test_hopper_backward.py -q
fi
if has gemv; then
  # the decode step's matrix-vector products (issue 48; not yet used by the decoder): every kernel against float64
  # and the NumPy model's bits, memcheck and racecheck, the rung's tests, then each version against cuBLAS and the
  # copy ceiling at the model's shapes (L2 flushed) into results/gemv/bench_<gpu>.json and the batch-1 build variants
  # into results/gemv/variants_<gpu>.json
  has build || build_rungs gemv
  gpu=$(gpu_name)
  run_step gemv_checks 300 python3 -m wb_kernels.stages.gemv.gpu_checks v1 v2 v3 fused in_place
  run_step gemv_memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 -m wb_kernels.stages.gemv.gpu_checks quick
  run_step gemv_racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
    python3 -m wb_kernels.stages.gemv.gpu_checks quick
  run_step gemv_tests 300 python3 -m pytest tests/test_gemv.py -q
  run_step gemv_bench "${GEMV_LIMIT:-300}" python3 -m wb_kernels.stages.gemv.bench --json "results/gemv/bench_$gpu.json"
  run_step gemv_variants "${GEMV_LIMIT:-300}" python3 -m wb_kernels.stages.gemv.bench --batches 1 --variants all \
    --json "results/gemv/variants_$gpu.json"
fi
if has tokens; then
  # the LLaMA-shaped decoder's tokens per second (lesson 07): eager with SDPA, wb.decode and FlashInfer on contiguous
  # and paged caches; then the roofline sweep, the step in a CUDA graph per batch (SDPA, wb.decode where it is
  # graph-safe) and under torch.compile(mode="reduce-overhead"), batch 1/8/64 x context 1k/8k/32k; the greedy checks;
  # the roofline chart (figures/07_decoder_roofline_<gpu>.png). After build, so that the CUDA extension's build is not
  # in its time. Rows stop starting after TOKENS_LIMIT - 60 s; the same command resumes an unfinished file.
  gpu=$(gpu_name)
  run_step tokens "${TOKENS_LIMIT:-330}" python3 -m "$TOKENS_MODULE" \
    --json "results/decode/decoder_$gpu.json" --time-budget $(( ${TOKENS_LIMIT:-330} - 60 )) ${TOKENS_ARGS:-}
fi
if has distributed; then
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
  world=${DIST_WORLD:-2}
  if [ "${gpus:-0}" -lt "$world" ]; then
    echo "== distributed: skipped, needs $world GPUs of one host, found ${gpus:-0}" | tee -a "$LOG"
  else
    dist_started=$SECONDS  # the benchmark gets what is left of DIST_LIMIT (480 s) after the build and the checks
    # the forward's and the backward's extensions first, one process each: the ranks would otherwise build them
    # side by side into one cache
    has build || build_rungs mma backward
    # every method (ring, zigzag, ulysses, split-KV decode, the backwards) on NCCL, each rank's attention the mma
    # stage, the whole result graded by wb.check's rule (2x SDPA's error in the same precision; the gradients by
    # wb.check_gradients'); --timeout bounds every collective. One JSON line per rank and case, into
    # results/distributed/ (run every time: a file from an earlier commit says nothing of this one). float16 and
    # bfloat16 side by side: their float64 checks are NumPy on the CPU, one core per rank.
    mkdir -p results/distributed
    gpu=$(gpu_name)
    check_nccl() {  # dtype: run.py's cases on NCCL into results/distributed/nccl_<gpu>x<W>_<dtype>.jsonl
      local dtype=$1 checked="results/distributed/nccl_${gpu}x${world}_$1.jsonl"
      run_step "distributed_nccl_$dtype" "${DIST_CHECK_LIMIT:-180}" python3 -m torch.distributed.run --standalone \
        --nproc_per_node="$world" -m "$DIST_RUN_MODULE" --backend nccl --dtype "$dtype" --stage mma \
        --timeout 60 --json
      grep "^{" "logs/distributed_nccl_$dtype.log" > "$checked"
      # a run that stopped part-way (a crash, the limit) is not "passed before", whatever lines it left
      [ "$last_rc" -eq 0 ] || echo "{\"status\": \"FAILED\", \"reason\": \"torchrun exit $last_rc\"}" >> "$checked"
      echo "== distributed_nccl_$dtype: $(grep -c '"status": "ok"' "$checked") ok, $(grep -c '"status": "FAILED"' \
"$checked") failed (rank-case lines)" | tee -a "$LOG"
    }
    check_nccl float16 &
    check_nccl bfloat16 &
    wait  # (run_step's status is lost in the background: the files say it)
    for dtype in float16 bfloat16; do
      grep '"status": "FAILED"' "results/distributed/nccl_${gpu}x${world}_$dtype.jsonl" | tee -a "$LOG" | head -n 20
      ! grep -q '"status": "FAILED"' "results/distributed/nccl_${gpu}x${world}_$dtype.jsonl" || status=1
    done
    # the benchmark stops starting problems 110 s before its limit (a problem takes up to about a minute) and
    # resumes from results/distributed/ when run again; a SIGTERM at the limit leaves the record under way untried
    limit=$(( ${DIST_LIMIT:-480} - (SECONDS - dist_started) ))
    [ "$limit" -ge 150 ] || limit=150
    # shellcheck disable=SC2086
    STEP_ECHO=1 run_step distributed_scaling "$limit" python3 -m torch.distributed.run --standalone \
      --nproc_per_node="$world" -m "$SCALING_MODULE" --out results/distributed \
      --time-budget $(( limit - 110 )) --timeout 60 ${DIST_SCALING_ARGS:-}
    cp results/distributed/scaling_*.json results/distributed/nccl_*.jsonl "$OUT"/ 2>/dev/null
    pack
  fi
fi
if [ -n "$release_part" ]; then
  # ---- release K/N: one part of the release (usage above). Tests and lessons run side by side after the build;
  # every command gets what is left of the part's limit, so the part records its result inside one command.
  commit=${WB_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
  [ -n "$commit" ] || { echo "release: no commit to name (set WB_GIT_COMMIT=<commit> where .git is absent)" | tee -a "$LOG"; exit 2; }
  export WB_GIT_COMMIT=$commit
  gpu=$(gpu_name)
  tag=release_${release_part/\//of}  # release_1of3: names $OUT allows
  rel_logs=logs/$tag
  if python3 scripts/status.py release-done "$gpu" "$release_part" --commit "$commit"; then
    echo "== release $release_part: already passed at $commit (results/status/$gpu.json), skipped" | tee -a "$LOG"
    cp "results/status/$gpu.json" "$OUT/" 2>/dev/null
    exit 0
  fi
  eval "$(python3 scripts/status.py release-plan "$release_part" --gpu "$gpu" --commit "$commit" --shell)" \
    || { echo "release: no plan for part $release_part" | tee -a "$LOG"; exit 2; }
  rm -rf "$rel_logs"; mkdir -p "$rel_logs"; touch "$rel_logs/.started"
  release_started=$SECONDS
  # the part's commands stop starting, and are stopped, RELEASE_LIMIT (540) s after this script started (the wheels
  # included), which leaves the record and the packing inside a 600 s limit on the whole command
  export RELEASE_DEADLINE=$(( $(date +%s) + ${RELEASE_LIMIT:-540} - SECONDS ))
  left() { local s=$(( RELEASE_DEADLINE - $(date +%s) )); [ "$s" -gt 5 ] && echo "$s" || echo 5; }
  pack_release() {  # this part's logs, its executed lessons, the status file, results and figures it wrote
    local changed
    changed=$(find results figures -type f -newer "$rel_logs/.started" ! -path 'results/status/*' 2>/dev/null)
    # shellcheck disable=SC2086
    if tar czf "$OUT/$tag.tgz.tmp$BASHPID" "$rel_logs" $PART_LESSONS $changed $(ls "results/status/$gpu.json" 2>/dev/null) README.md; then
      mv "$OUT/$tag.tgz.tmp$BASHPID" "$OUT/$tag.tgz"
    else
      rm -f "$OUT/$tag.tgz.tmp$BASHPID"
    fi
  }
  echo "== release $release_part at $commit on $gpu, what has not passed yet: tests [$PART_TESTS]$([ "$PART_PROPERTIES" = 1 ] && echo ' + properties'); lessons [$PART_LESSONS]" | tee -a "$LOG"
  { nvidia-smi; python3 -c "import sys, torch, numpy, numba; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('numpy', numpy.__version__, 'numba', numba.__version__)"; \
    python3 -c "import wb_kernels as wb; print(wb.banner())"; } > "$rel_logs/env.log" 2>&1
  BUILD_LIMIT=$(left) build_rungs  # every CUDA C++ rung's extension, side by side (cached where the machine is reused)
  cp logs/build_*.log "$rel_logs/" 2>/dev/null
  steps_rc=()
  for script in wb_kernels/stages/*/build.py; do
    rung=$(basename "$(dirname "$script")")
    grep -q "extension ready" "logs/build_$rung.log" && steps_rc+=("--step=build_$rung=0") || steps_rc+=("--step=build_$rung=1")
  done
  release_tests() {  # this part's test files, then the property suite where the plan puts it here
    local workers=() rc
    if [ "${TESTS_WORKERS:-6}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then workers=(-n "${TESTS_WORKERS:-6}"); fi
    if [ -n "$PART_TESTS" ]; then
      # shellcheck disable=SC2086
      timeout --kill-after=10 "$(left)" python3 -m pytest -v --tb=line -p no:cacheprovider "${workers[@]}" \
        --junitxml="$rel_logs/tests.xml" $PART_TESTS -W ignore::numba.core.errors.NumbaPerformanceWarning \
        > "$rel_logs/tests.log" 2>&1
      rc=$?; echo "tests=$rc" >> "$rel_logs/rc"
      echo "== $tag tests: exit $rc; $(tail -n 1 "$rel_logs/tests.log")" | tee -a "$LOG"
      grep -E "(FAILED|ERROR)( |$)" "$rel_logs/tests.log" | tee -a "$LOG" | head -n 40
    fi
    if [ "$PART_PROPERTIES" = 1 ]; then
      workers=()
      if [ "${PROPERTIES_WORKERS:-5}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then workers=(-n "${PROPERTIES_WORKERS:-5}"); fi
      timeout --kill-after=10 "$(left)" python3 -m pytest -v -rP --tb=short -p no:cacheprovider "${workers[@]}" \
        --junitxml="$rel_logs/properties.xml" tests/test_properties.py -W ignore::numba.core.errors.NumbaPerformanceWarning \
        > "$rel_logs/properties.log" 2>&1
      rc=$?; echo "properties=$rc" >> "$rel_logs/rc"
      echo "== $tag properties: exit $rc; $(tail -n 1 "$rel_logs/properties.log")" | tee -a "$LOG"
      grep -E "(FAILED|ERROR)( |$)" "$rel_logs/properties.log" | tee -a "$LOG" | head -n 40
    fi
  }
  release_lesson() {  # one lesson: executed in place, then under strict nbval (several lessons side by side)
    local nb=$1 stem rc t0=$SECONDS
    stem=$(basename "$nb" .ipynb)
    timeout --kill-after=10 "$(left)" python3 scripts/execute_notebooks.py --timeout "${CELL_TIMEOUT:-150}" "$nb" \
      > "$rel_logs/execute_$stem.log" 2>&1
    rc=$?; echo "execute:$nb=$rc" >> "$rel_logs/rc"
    echo "== $tag execute $stem: exit $rc; $(tail -n 1 "$rel_logs/execute_$stem.log")" | tee -a "$LOG"
    if [ "$rc" -eq 0 ]; then
      timeout --kill-after=10 "$(left)" python3 -m pytest -v -p no:cacheprovider --junitxml="$rel_logs/nbval_$stem.xml" \
        "$nb" --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
        --nbval-cell-timeout "${CELL_TIMEOUT:-150}" > "$rel_logs/nbval_$stem.log" 2>&1
      rc=$?; echo "nbval:$nb=$rc" >> "$rel_logs/rc"
      echo "== $tag nbval $stem: exit $rc; $(tail -n 1 "$rel_logs/nbval_$stem.log")" | tee -a "$LOG"
      grep -E "(FAILED|ERROR)( |$)" "$rel_logs/nbval_$stem.log" | tee -a "$LOG" | head -n 20
    fi
    echo "seconds:$nb=$(( SECONDS - t0 ))" >> "$rel_logs/rc"
  }
  release_lessons() {
    [ -n "$PART_LESSONS" ] || return 0
    export -f release_lesson left
    export rel_logs tag LOG
    # shellcheck disable=SC2086
    printf '%s\n' $PART_LESSONS | xargs -P "${LESSON_WORKERS:-4}" -I{} bash -c 'release_lesson "$1"' _ {}
  }
  release_tests &
  release_lessons &
  wait
  cp logs/failures.log "$rel_logs/" 2>/dev/null
  cp -r logs/partial "$rel_logs/" 2>/dev/null  # a lesson that stopped at a cell: its outputs up to there
  while IFS= read -r line; do steps_rc+=("--step=$line"); done < <(cat "$rel_logs/rc" 2>/dev/null)
  python3 scripts/status.py release-record "$gpu" "$release_part" --commit "$commit" --logs "$rel_logs" \
    --seconds $(( SECONDS - release_started )) "${steps_rc[@]}" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # the README's status block rendered from the new record, so that the tree the next part is sent with (this
  # tarball unpacked at the root) passes tests/test_status.py
  python3 scripts/status.py --update-readme >> "$LOG" 2>&1
  cp "results/status/$gpu.json" "$OUT/"
  cp "$LOG" "$rel_logs/" 2>/dev/null
  pack_release
  echo "== release $release_part: collected into $OUT/$tag.tgz and $OUT/$gpu.json; overall status $status" | tee -a "$LOG"
  exit $status
fi
if compgen -G "logs/*.xml" >/dev/null; then
  # the README's status (scripts/status.py --update-readme) is rendered from these counts, not typed
  gpu=$(gpu_name)
  python3 scripts/status.py record "$gpu" logs/tests.xml logs/properties.xml logs/nbval.xml 2>&1 | tee -a "$LOG"
  pack
fi
echo "== collected into $OUT/gpu_results.tgz; overall status $status" | tee -a "$LOG"
exit $status
