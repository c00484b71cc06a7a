#!/usr/bin/env bash
# One device call's work, picked by name: bash bench/lab/h200_runs.sh suite|suite_a|suite_b|suite_c|results|spec|spec_noisy|verify_tune|spec_profile|spec_hlo|scan_tune|conv_tune|scan_seg|scan_vs_mamba_ssm|update_tune|conv_update_tune|scan_span|dsa_new|nano9b_bf16|serve_load|nano30b|nano30b_serve|nano30b_bf16|dispatch|x2a|x2b|x2_serve|deepseek|decode_profile|xla_flags_probe|fusions_tests|fusions_bench|shared_gmm_tests|shared_gmm_bench|compile_cache|start_padding|start_probe|start_30b|multiturn|serve_prefix|start_9b|launch_thread|kernel_checks|quick_tests|mla_prefill|mla_prefill_splits|long_tests|long_nano9b|long_dsa|long_dense|long_dsa_profile|long_128k|mla_b128|mla_mosaic|mla_split|mla_variants|mla_mosaic_engine|mla_settings_engine|greedy_probe|mla_ncu|mla_ncu_mosaic|mla_sass|mla_small|idx_decode|fp8|fp8_sweep|fp8_fence|fp8_cublaslt|fp8_decode|fp8_engine_rows|nano30b_b1_profile|nano30b_prefill_profile|nano9b_prefill_profile|conv_xla_prefill|hlo_b1|gmm_decode|fp8_moe_decode|fp8_gsweep|fp8_engine|fp8_b1_profile|fp8_models|structured|structured_tests ...
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() { python3 -m jaxmodels bench --no-progress "$@"; }
long() {  # bench/long_context.py on a config of bench/configs, log and json under $OUT
  local config=$1; shift; local log="$OUT/long_${config}$(echo "$*" | tr -d ' /-').log"
  timeout "${LONG_TIMEOUT:-280}" python3 bench/long_context.py --config "bench/configs/$config.json" "$@" \
    --json "${log%.log}.json" > "$log" 2>&1; echo "exit $?"; grep -A6 "^### " "$log"; grep "peak" "$log"; grep -A24 "^## profile" "$log"; }
x2() {  # decode at B=256 on a config of bench/configs with the given layout flags, a log each under $OUT
  for args in "$@"; do
    set -- $args; local config=$1; shift; local log="$OUT/x2_${config}$(echo "$*" | tr -d ' /-').log"
    echo "--- $config $* ${XLA_FLAGS:-}"
    timeout 170 python3 -m jaxmodels bench --no-progress --config "bench/configs/$config.json" --phases decode \
      --batches 256 --decode-steps 24 "$@" > "$log" 2>&1; echo "exit $?"
    grep -A3 "| B |" "$log"; grep -A12 "^| category" "$log" | head -13
  done; }
switch_bench() {  # decode_profile with the switch $1 on, then off (logs under $OUT/$2 1 and 0), of PROFILE_CONFIGS
  for on in 1 0; do echo "--- $1=$on"
    env OUT="$OUT/$2$on" "$1=$on" PROFILE_TIMEOUT=150 \
      PROFILE_CONFIGS="${PROFILE_CONFIGS:-nemotron_h_nano30b_a3b deepseek_v32_4layer}" bash "$0" decode_profile
  done; }
for what in "$@"; do
  echo "=== $what $(date -u +%T)"
  case $what in
    # Structured output's packages if the machine lacks them (wheels carried in .whl/: tools/gpu_wheels.sh), then
    # the sampler variants' decode cost at B=64/256 (the JSON schema's masks for the 128k-token tokenizer carried in
    # bench/.cache/) and the engine tests of structured output and the sampling controls.
    structured) bash tools/install_wheels.sh llguidance jsonschema
      timeout 420 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano9b.json --phases decode \
        --batches 64,256 --decode-steps 64 --sampling plain,logprobs,penalties,json \
        --tokenizer bench/.cache/tokenizer_128k.json --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
      echo "exit $?"; grep -B2 -A12 "| B |" "$OUT/structured.log" | head -30 ;;
    structured_tests) OUT="$OUT/structured_tests" GPU_CHECK_TESTS="tests/engine/test_structured_output.py tests/engine/test_sampling_controls.py tests/engine/test_grammar.py tests/engine/test_llm.py" bash tools/gpu_check.sh tests 2>&1 | tail -5 ;;
    suite) OUT=$OUT bash tools/gpu_check.sh tests > "$OUT/suite_stdout.log" 2>&1; tail -25 "$OUT/gpu_tests.log"; cat "$OUT/summary.txt" ;;
    kernel_checks) OUT="$OUT/kernel_checks" bash tools/gpu_check.sh checks 2>&1 | grep -i "check\|FAIL" | tail -40 ;;
    # The suite in three calls (whole, it took 596 s of a call's 600 on an H200 on 2026-12-01). On an H100 (5
    # workers) suite_a took 454 s and the old suite_b (these two together) reached 97% in 600 s on 2026-12-05.
    suite_a) OUT="$OUT/suite_a" GPU_CHECK_TESTS="tests/engine tests/pallas_kernels" bash "$0" suite ;;
    suite_b) OUT="$OUT/suite_b" GPU_CHECK_TESTS="tests/jaxmodels tests/bridge tests/sharding" bash "$0" suite ;;
    suite_c) OUT="$OUT/suite_c" GPU_CHECK_TESTS="tests/serve" bash "$0" suite ;;
    # BENCHMARKS.md's current results (issue 43): the serving benchmark with transformers beside it, one model class a
    # call (RESULTS_CONFIGS; NAME_fp8: NAME's config in block FP8, no comparator), JSON and figures under $OUT;
    # `python -m jaxmodels bench-report` renders them. Set JAXMODELS_COMMIT: the device's copy has no current .git.
    results) for config in ${RESULTS_CONFIGS:-nemotron_h_nano9b}; do echo "--- $config"
          case $config in *_fp8) flags="--config bench/configs/${config%_fp8}.json --fp8-block" ;;
                          *) flags="--config bench/configs/$config.json --compare-transformers" ;; esac
          timeout "${RESULTS_TIMEOUT:-560}" python3 -m jaxmodels bench --no-progress $flags \
            --prefill-len 1024,4096,16384 --label "$config" \
            --json "$OUT/results_$config.json" --plot "$OUT/figures_$config" 2>&1 | grep -v Warning | tail -40; done ;;
    spec) python3 bench/speculative.py --config bench/configs/nemotron_h_nano9b.json --batches 1,32 --ks 1,2,3 \
        --json "$OUT/spec.json" 2>&1 | grep -v Warning | tail -30 ;;
    spec_noisy) for config in ${SPEC_CONFIGS:-nemotron_h_nano9b deepseek_v32_4layer}; do echo "--- $config"
          timeout "${SPEC_TIMEOUT:-280}" python3 bench/speculative.py --config "bench/configs/$config.json" \
            --batches 1,32 --ks 1,2,3 --drafters noisy --json "$OUT/spec_noisy_$config.json" 2>&1 \
            | grep -v Warning | tail -12; done ;;
    verify_tune) timeout "${TUNE_TIMEOUT:-120}" python3 bench/mamba_kernels.py --tune-verify 2>&1 | grep "tune verify" ;;
    spec_profile) python3 bench/speculative.py --config bench/configs/nemotron_h_nano9b.json --batches 32 --ks 1 \
        --tokens 16 --profile /tmp/prof_spec 2>&1 | grep -v Warning | tail -80 ;;
    spec_hlo) rm -rf /tmp/hlo_spec; log="$OUT/spec_hlo.log"  # spec_profile, and what its top fusions compute
        XLA_FLAGS="--xla_dump_to=/tmp/hlo_spec --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*run.* ${XLA_FLAGS:-}" \
          python3 bench/speculative.py --config bench/configs/nemotron_h_nano9b.json --batches 32 --ks 1 \
          --tokens 16 --profile /tmp/prof_spec > "$log" 2>&1; echo "exit $?"; grep -v Warning "$log" | tail -60
        python3 bench/lab/hlo_fusions.py /tmp/hlo_spec --table "$log" --top 16 --param "s32[32]" \
          > "$OUT/spec_fusions.md"
        echo "fusions: exit $? ($OUT/spec_fusions.md)" ;;
    scan_tune) timeout 300 python3 bench/mamba_kernels.py --tune --kernels none --out "$OUT/scan_tune" 2>&1 \
        | grep "^tune\|FAIL\|pooled" | tail -40 ;;  # Nano-9B's head-dim tiles; the pooled scan at 1 of 1 / 256 rows
    conv_tune) timeout 200 python3 bench/mamba_kernels.py --tune-conv --out "$OUT/conv_tune" 2>&1 \
        | grep "tune conv\|FAIL" | tail -20 ;;  # the prefill conv's tiles at 8k; pooled vs gather/conv/scatter
    scan_seg) python3 bench/mamba_kernels.py --check --kernels scan_seg --out "$OUT" 2>&1 | tail -30 ;;
    # The decode state update at B=256 (fp32 and bf16 state, both shapes): tiles, then the launch orders and
    # evict-first state traffic (bench/mamba_kernels.py update_variants); the correctness checks first.
    update_tune) timeout 300 python3 bench/mamba_kernels.py --check --tune-update --out "$OUT/update_tune" 2>&1 \
        | grep "^tune\|FAIL\|state_update" | tail -40 ;;
    conv_update_tune) timeout 200 python3 bench/mamba_kernels.py --tune-conv-update --out "$OUT/conv_update_tune" 2>&1 \
        | grep "^tune\|FAIL" | tail -20 ;;  # the decode conv update's channel blocks x warps at B=256
    # mamba_ssm's Triton scan and state update timed in a torch process (bench/mamba_ssm_reference.py, its sources
    # carried in .thirdparty/), then ours in the same call with that column (issues 5 and 14's comparator);
    # SCAN_FLAGS replaces the table's flags (e.g. "--check --tune-span --kernels scan_seg").
    scan_vs_mamba_ssm) PYTHONPATH=.thirdparty:$PYTHONPATH timeout 150 python3 bench/mamba_ssm_reference.py \
          --json "$OUT/mamba_ssm.json" 2>&1 | grep -v Warning | tail -20
        timeout 400 python3 bench/mamba_kernels.py ${SCAN_FLAGS:---kernels scan_seg,decode} \
          --mamba-ssm-json "$OUT/mamba_ssm.json" --out "$OUT/scan_vs_mamba_ssm" 2>&1 \
          | grep "^|\|FAIL\|mamba_ssm\|^tune-span\|checks" | tail -40 ;;
    scan_span) timeout 400 python3 bench/mamba_kernels.py --tune-span --kernels scan_seg --out "$OUT/scan_span" 2>&1 \
        | grep "best\|^| scan" | tail -20 ;;  # Nano-9B's one-span scan tiles at 8k / 32k (issue 14's last scan gap)
    dsa_new) python3 bench/dsa_kernels.py --check --quick --only select,mla_decode --log "$OUT/dsa_new.log" 2>&1 | tail -40
        python3 bench/dsa_kernels.py --check --quick --only indexer --indexer-kinds decode --ctx 131072 \
          --log "$OUT/idx_new.log" 2>&1 | tail -12 ;;
    nano9b_bf16) bench --config bench/configs/nemotron_h_nano9b.json --phases decode --batches 1,256 \
        --mamba-ssm-cache-dtype bfloat16 --json "$OUT/nano9b_bf16.json" 2>&1 | tail -40 ;;
    serve_load) python3 bench/serve_load.py --config bench/configs/nemotron_h_nano9b.json --requests 256 \
        --prompt-len 128 --max-tokens 128 --no-progress 2>&1 | tail -12 ;;
    nano30b) bench --config bench/configs/nemotron_h_nano30b_a3b.json --phases decode,serve --batches 1,256 \
        --decode-steps 32 --serve 256 --serve-in 1024 --serve-out 1024 --arrival-rate 0 \
        --json "$OUT/nano30b.json" 2>&1 | tail -30 ;;
    nano30b_serve) timeout 280 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano30b_a3b.json \
        --phases serve --serve 256 --serve-in 1024 --serve-out 1024 --arrival-rate 0 --json "$OUT/nano30b_serve.json" \
        --prefill-chunk "${SERVE_CHUNK:-8192}" 2>&1 | tail -12 ;;  # issue 10's serving run with the config's fp32 state
    nano30b_bf16) bench --config bench/configs/nemotron_h_nano30b_a3b.json --phases serve --serve 256 --serve-in 1024 \
        --serve-out 1024 --arrival-rate 0 --mamba-ssm-cache-dtype bfloat16 --json "$OUT/nano30b_bf16.json" 2>&1 | tail -12 ;;
    dispatch) for b in 1 256; do timeout 200 python3 bench/lab/dispatch_probe.py \
        --config bench/configs/nemotron_h_nano9b.json --batch $b 2>&1 | tail -3; done ;;
    # Two H200s (kind nvidia-h200-x2), issue 11, in calls of under 10 minutes: decode at B=256 for each layout, with
    # the first run's per-op profile; x2b also runs dp=2 with NCCL collectives recorded into the step's CUDA graphs
    # (at dp=2 they cut each step's graph into ~90 pieces); x2_serve is the serving run, dp=2 against one GPU.
    x2a) x2 "nemotron_h_nano30b_a3b --dp 2 --profile /tmp/prof_dp2" "nemotron_h_nano30b_a3b" \
        "nemotron_h_nano30b_a3b --tp 2" ;;
    x2b) x2 "deepseek_v32_4layer --dp 2" "deepseek_v32_4layer"
        XLA_FLAGS="--xla_gpu_enable_command_buffer=+COLLECTIVES ${XLA_FLAGS:-}" x2 "nemotron_h_nano30b_a3b --dp 2" ;;
    x2_serve) for dp in "--dp 2" ""; do echo "--- serve $dp"
          timeout 280 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano30b_a3b.json \
            --phases serve --serve 256 --serve-in 1024 --serve-out 1024 --arrival-rate 0 $dp \
            --prefill-chunk "${SERVE_CHUNK:-8192}" > "$OUT/x2_serve${dp// /}.log" 2>&1  # chunks as nano30b_serve's
          echo "exit $?"; tail -12 "$OUT/x2_serve${dp// /}.log"; done ;;
    deepseek) bench --config bench/configs/deepseek_v32_4layer.json --phases prefill --prefill-chunk 4096 \
        --json "$OUT/deepseek.json" 2>&1 | tail -12 ;;
    long_tests) python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_large_pools.py \
        tests/engine/test_long_context.py 2>&1 | tail -15 ;;
    long_nano9b) long nemotron_h_nano9b --batch 8 ;;
    long_dsa) long deepseek_v32_4layer --batch 16 ;;
    long_dense) long deepseek_v32_4layer --batch 16 --dense ;;
    long_128k) for dense in "" --dense; do  # sparse against dense at 128k, decode only, in one run
          long deepseek_v32_4layer --batch 16 --contexts 131072 --serve-up-to 0 $dense; done ;;
    long_dsa_profile) long deepseek_v32_4layer --batch 16 --contexts 131072 --serve-up-to 0 --profile /tmp/prof_long ;;
    fp8) timeout "${FP8_TIMEOUT:-330}" python3 bench/fp8_kernels.py --check --only "${FP8_ONLY:-check,dense,grouped}" \
        --log "$OUT/fp8_$(echo "${FP8_ONLY:-main}" | tr , _).log" ${FP8_ARGS:-} 2>&1 | grep -v Warning | tail -40 ;;
    fp8_sweep) FP8_ONLY=sweep FP8_ARGS=--sweep bash "$0" fp8 ;;
    # The Mosaic FP8 GEMM without, then with, a proxy fence after each consumer step's reads (FENCE_STEP_READS, which
    # jax 0.11's interpreter asks for): its compiled tests, then the dense and grouped timings, one process each.
    fp8_fence) for fence in False True; do echo "--- FENCE_STEP_READS=$fence"
          for what in "-m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels/test_fp8_matmul_mosaic.py" \
              "bench/fp8_kernels.py --only dense,grouped --log $OUT/fp8_fence_$fence.log"; do
            timeout 240 python3 bench/lab/with_constants.py pallas_kernels.fp8_matmul_mosaic \
              FENCE_STEP_READS=$fence -- $what 2>&1 | grep -v Warning | tail -16; done; done ;;
    fp8_cublaslt) FP8_ONLY=check,cublaslt bash "$0" fp8 ;;  # the checks (cuBLASLt's among them), then 16..4096 rows on cuBLASLt and the kernels
    # decode's FP8 GEMMs, timed in one graph (check + decode took 210 s on 2026-12-01, the experts' rows 170 s+):
    # the dense linears at 1 / 32 rows (K split 1..16 ways), the experts at 1 / 8 / 32 tokens (Triton and Mosaic)
    fp8_decode) FP8_TIMEOUT=${FP8_TIMEOUT:-300} FP8_ONLY=decode bash "$0" fp8 ;;
    fp8_moe_decode) FP8_TIMEOUT=${FP8_TIMEOUT:-300} FP8_ONLY=grouped FP8_ARGS="--tokens 1,8,32" bash "$0" fp8 ;;
    fp8_gsweep) FP8_ONLY=grouped_sweep FP8_ARGS=--sweep bash "$0" fp8 ;;
    fp8_engine) for run in "1 --fp8-block" "0 --fp8-block" "1"; do  # FP8 in the engine as `auto` runs it (cuBLASLt
          set -- $run  # for prefill chunks, the Mosaic / Triton kernels below), then without cuBLASLt, then bf16
          echo "--- JAXMODELS_FP8_CUBLASLT=$1 ${2:-(bf16 weights)}"
          JAXMODELS_FP8_CUBLASLT=$1 bench --config bench/configs/deepseek_v32_4layer.json \
            --phases prefill,decode --batches 1,32 --decode-steps 24 --prefill-chunk 4096 ${2:-} 2>&1 | tail -14
        done ;;
    fp8_engine_rows) for rows in 1024 128; do  # DeepSeek FP8 decode at ${ROWS_BATCHES:-128,256} sequences, cuBLASLt
          echo "--- JAXMODELS_FP8_CUBLASLT_MIN_ROWS=$rows"  # from 1024 rows (prefill only, the default) or from 128
          JAXMODELS_FP8_CUBLASLT_MIN_ROWS=$rows timeout 200 python3 -m jaxmodels bench --no-progress \
            --config bench/configs/deepseek_v32_4layer.json --phases decode --batches "${ROWS_BATCHES:-128,256}" \
            --decode-steps 24 --fp8-block 2>&1 | grep -A4 "^| B |"
        done ;;
    nano30b_b1_profile) log="$OUT/nano30b_b1_profile.log"  # one sequence's decode step, per-op table
        timeout 200 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano30b_a3b.json \
          --phases decode --batches 1 --decode-steps 24 --profile /tmp/prof_n30_b1 > "$log" 2>&1
        echo "exit $?"; grep -A40 "^| B\|^| category\|^| op" "$log" | head -60 ;;
    nano30b_prefill_profile) log="$OUT/nano30b_prefill_profile.log"  # one 8192-token chunk, per-op table: where the
        # serving run's prefill (4.4 s of its 28.6 s at 8192-token chunks) goes
        timeout 250 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano30b_a3b.json \
          --phases prefill --prefill-len 8192 --prefill-chunk 8192 --profile /tmp/prof_n30_prefill > "$log" 2>&1
        echo "exit $?"; grep -A3 "^| tokens" "$log"; grep -A40 "^## profile" "$log" | head -45 ;;
    # Nano-9B's 8k prefill through the engine in chunks of PREFILL_CHUNKS (default 2048, the engine's, and 8192),
    # per-op table each: where the TTFT above its floor goes.
    nano9b_prefill_profile) for chunk in ${PREFILL_CHUNKS:-2048 8192}; do
        log="$OUT/nano9b_prefill_profile_$chunk.log"
        timeout 200 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano9b.json \
          --phases prefill --prefill-len 8192 --prefill-chunk "$chunk" --profile "/tmp/prof_n9_prefill_$chunk" \
          > "$log" 2>&1
        echo "exit $? (chunks of $chunk)"; grep -A3 "^| tokens" "$log"; grep -A40 "^## profile" "$log" | head -45
      done ;;
    # The prefill conv (0.7-0.8x its XLA reference alone at 8k tokens on 2026-11-30) against that reference inside
    # the engine: one 8192-token prompt in one chunk on Nano-30B and Nano-9B, with the kernel, then with XLA's.
    conv_xla_prefill) for xla in "" causal_conv1d; do echo "--- JAXMODELS_XLA_KERNELS=${xla:-(none)}"
          for config in nemotron_h_nano30b_a3b nemotron_h_nano9b; do
            JAXMODELS_XLA_KERNELS=$xla timeout 150 python3 -m jaxmodels bench --no-progress \
              --config "bench/configs/$config.json" --phases prefill --prefill-len 8192 --prefill-chunk 8192 \
              2>&1 | grep -A3 "^| tokens"; done; done ;;
    hlo_b1) rm -rf /tmp/hlo_dump; log="$OUT/hlo_b1.log"  # a short model's decode B=1 per-op table, and what its
        # top fusions compute (bench/lab/hlo_fusions.py on the optimized HLO); config, layers: HLO_CONFIG, HLO_LAYERS
        XLA_FLAGS="--xla_dump_to=/tmp/hlo_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*run.* ${XLA_FLAGS:-}" \
          timeout 200 python3 -m jaxmodels bench --no-progress --config "bench/configs/${HLO_CONFIG:-nemotron_h_nano30b_a3b}.json" \
          --layers "${HLO_LAYERS:-4}" --phases decode --batches 1 --decode-steps 24 --profile /tmp/prof_hlo > "$log" 2>&1
        echo "exit $?"; grep -A30 "^| op" "$log" | head -32
        python3 bench/lab/hlo_fusions.py /tmp/hlo_dump --table "$log" --top 12 --param "s32[1]" \
          > "$OUT/hlo_b1_fusions.md"
        echo "fusions: exit $? ($OUT/hlo_b1_fusions.md)" ;;
    fp8_b1_profile) for fp8 in --fp8-block ""; do  # FP8 against bf16 decode at one sequence, per-op tables
          log="$OUT/b1_profile${fp8:-_bf16}.log"
          timeout 150 python3 -m jaxmodels bench --no-progress --config bench/configs/deepseek_v32_4layer.json \
            --phases decode --batches 1 --decode-steps 24 $fp8 --profile "/tmp/prof_b1$fp8" > "$log" 2>&1
          echo "--- ${fp8:-bf16}: exit $?"; grep -A40 "^| B\|^| category\|^| op" "$log" | head -45; done ;;
    # The Mosaic GPU sparse MLA decode kernel (issue 42): the probe of its parts, its tests, its check and timings
    # beside the Triton kernel's (B=1/32/128); mla_mosaic_engine: DeepSeek 4-layer decode at B=32/128 on each kernel
    # (JAXMODELS_SPARSE_MLA_KERNEL).
    # The probe goes first: a kernel that hangs (a barrier waited on and never arrived at) stops the run there.
    mla_mosaic) timeout 120 python3 bench/lab/mosaic_mla_probe.py 2>&1 | grep -v Warning | tail -60
        if [ "${PIPESTATUS[0]}" = 124 ]; then echo "the probe timed out: the kernel hangs?"; continue; fi
        timeout 150 python3 -m pytest -q -p no:cacheprovider \
          tests/pallas_kernels/test_sparse_mla_mosaic.py 2>&1 | tail -8
        timeout "${MLA_TIMEOUT:-200}" python3 bench/dsa_kernels.py --check --quick --only mla_decode \
          --log "$OUT/mla_mosaic.log" 2>&1 | grep -v Warning | grep -i "check\|B=\|mosaic\|error" | tail -30 ;;
    mla_mosaic_engine) for kernel in triton mosaic; do echo "--- JAXMODELS_SPARSE_MLA_KERNEL=$kernel"
          JAXMODELS_SPARSE_MLA_KERNEL=$kernel timeout 120 python3 -m jaxmodels bench --no-progress \
            --config bench/configs/deepseek_v32_4layer.json --phases decode --batches 32,128 --decode-steps 32 \
            ${MLA_ENGINE_ARGS:-} 2>&1 | grep -A4 "| B |"; done ;;  # MLA_ENGINE_ARGS=--layers 2 on an 80 GB card
    # DeepSeek 4-layer decode at B=32/128 on the Triton kernel, then on the Mosaic one by default and with each of
    # MLA_SETTINGS (constants of sparse_mla_mosaic set before the engine is built, ',' between; default each schedule
    # on its own, where the default picks one by a program's blocks), one process each: the engine's step before and
    # after, in one call.
    mla_settings_engine) for setting in triton default \
          ${MLA_SETTINGS:-SCHEDULE=owner SCHEDULE=seesaw}
        do echo "--- $setting"; kernel=mosaic; [ "$setting" = triton ] && kernel=triton
          constants=$setting; [[ $setting == *=* ]] || constants=""  # triton and default: none set
          JAXMODELS_SPARSE_MLA_KERNEL=$kernel timeout 150 python3 bench/lab/with_constants.py \
            pallas_kernels.sparse_mla_mosaic $constants -- -m jaxmodels bench --no-progress \
            --config bench/configs/deepseek_v32_4layer.json --phases decode --batches 32,128 --decode-steps 32 \
            ${MLA_ENGINE_ARGS:-} 2>&1 | grep -A4 "| B |"; done ;;  # MLA_ENGINE_ARGS=--layers 2 on an 80 GB card
    # The kernel's time split (whole, compute alone, gathers alone) and warpgroup 0's column share (bench/lab/mla_mosaic_split.py).
    mla_split) timeout "${SPLIT_TIMEOUT:-540}" python3 bench/lab/mla_mosaic_split.py --batches "${SPLIT_BATCHES:-32,128}" \
        ${SPLIT_ONLY:+--only "$SPLIT_ONLY"} 2>&1 | grep -v Warning | tail -24 ;;  # SPLIT_ONLY: names, ';' between
    # The Mosaic sparse MLA's GPU tests (both schedules), then the variants at B=32 and 128 (mla_split): one call
    # (issue 42's open target); mla_settings_engine in the next gives the engine's decode with the same settings.
    mla_variants) timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
          tests/pallas_kernels/test_sparse_mla_mosaic.py 2>&1 | tail -4
        SPLIT_TIMEOUT=${SPLIT_TIMEOUT:-300} \
          SPLIT_ONLY=${SPLIT_ONLY:-owner;compute only;wg0 192 columns;seesaw;seesaw compute;seesaw, S at top} \
          bash "$0" mla_split ;;
    mla_b128) timeout "${MLA_TIMEOUT:-280}" python3 bench/dsa_kernels.py --check --only mla_decode --mla-batches 128 \
        --log "$OUT/mla_b128.log" 2>&1 | grep -v Warning | tail -30 ;;
    # Nsight Compute's counters of the sparse MLA decode at B = 128, a launch per tile variant
    # (bench/lab/ncu_sparse_mla.py): sections (speed of light, pipes, memory, stalls, launch) then the spill,
    # shared-memory, L2 and tensor-pipe metrics; one buffer per allocation and no CUDA graphs, so each launch
    # replays on its own.
    mla_ncu) ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
        export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}"
        timeout 200 "$ncu" --kernel-name "regex:${NCU_KERNEL:-sparse_mla}" --launch-count 3 --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section LaunchStats --section Occupancy --section InstructionStats python3 bench/lab/ncu_sparse_mla.py \
          ${NCU_ARGS:-} > "$OUT/mla_ncu_sections.log" 2>&1; echo "sections: exit $?"
        timeout 150 "$ncu" --kernel-name "regex:${NCU_KERNEL:-sparse_mla}" --launch-count 3 --metrics \
          l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,\
lts__t_bytes.sum,dram__bytes_read.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__inst_executed.sum,gpu__time_duration.sum python3 bench/lab/ncu_sparse_mla.py ${NCU_ARGS:-} \
          > "$OUT/mla_ncu_metrics.log" 2>&1
        echo "metrics: exit $?"; grep -E "^launch|sparse_mla|Duration|Throughput|Registers|Shared Memory Config|Dynamic Shared|Achieved Occ|Theoretical Occ|Pipe|Stall|Warp Cycles|Issued|Executed Ipc|l1tex__|lts__|dram__|sm__|gpu__|==ERR|==WARN" \
          "$OUT/mla_ncu_sections.log" "$OUT/mla_ncu_metrics.log" | cut -c1-200 | head -150 ;;
    # The SASS of the same launches with per-instruction counters (ncu's source page): which tensor-core path the
    # dots took (HGMMA = wgmma, HMMA = mma.sync) and the shared / local memory instructions, counted per launch.
    mla_ncu_mosaic) NCU_KERNEL=mosaic NCU_ARGS=--mosaic bash "$0" mla_ncu ;;  # launch 1: the owner schedule, 2: the seesaw
    mla_sass) ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
        export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}"
        timeout 200 "$ncu" --kernel-name regex:sparse_mla --launch-count 3 --section SourceCounters --page source \
          --print-source sass python3 bench/lab/ncu_sparse_mla.py > "$OUT/mla_sass.log" 2>&1; echo "sass: exit $?"
        awk '/^launch [0-9]/ {print} /^Kernel Name/ {k++}  # one source table a launch, in launch order
          { while (match($0, /(HGMMA|HMMA|LDSM|LDS|STS|LDL|STL|LDGSTS|WARPGROUP|BAR|SHFL|MUFU)[A-Z0-9._]*/)) {
              op = substr($0, RSTART, RLENGTH); sub(/\..*/, "", op); n[k" "op]++; $0 = substr($0, RSTART + RLENGTH) } }
          END { for (x in n) print "launch", x, "instructions:", n[x] }' "$OUT/mla_sass.log" | sort ;;
    mla_small) timeout "${MLA_TIMEOUT:-200}" python3 bench/dsa_kernels.py --only mla_decode --mla-batches 16,32 \
        --log "$OUT/mla_small.log" 2>&1 | grep -v Warning | grep "B=" | tail -40 ;;
    fp8_models) JAXMODELS_FP8_GPU_PATHS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 8 \
        -p no:cacheprovider tests/jaxmodels/test_fp8_checkpoints.py tests/bridge/test_fp8_loading.py \
        tests/pallas_kernels/test_fp8_matmul.py tests/sharding/test_sharded.py::test_sharded_fp8_serving_follows_one_device \
        > "$OUT/fp8_models.log" 2>&1; grep -E "^(E  |FAILED)|passed|failed" "$OUT/fp8_models.log" | cut -c1-300 | tail -40 ;;
        # the FP8 models on the GPU paths (the default since 2026-12-01), failures' reasons kept
    idx_decode) timeout "${IDX_TIMEOUT:-300}" python3 bench/dsa_kernels.py --only indexer --indexer-kinds decode \
        --ctx 131072 --log "$OUT/idx_decode.log" 2>&1 | grep -v Warning | grep "indexer" | tail -40 ;;
    gmm_decode) timeout "${GMM_TIMEOUT:-280}" python3 bench/dsa_kernels.py --check --only gmm_decode \
        --log "$OUT/gmm_decode.log" 2>&1 | grep -v Warning | grep "decode B=\|FAILED\|check" | tail -60 ;;
    # Decode at 1 and 256 sequences with per-op profiles (device kernels per step, device idle, host events), for
    # each config of PROFILE_CONFIGS (file names in bench/configs).
    decode_profile) for config in ${PROFILE_CONFIGS:-nemotron_h_nano30b_a3b nemotron_h_nano9b}; do
          log="$OUT/decode_profile_$config.log"
          timeout "${PROFILE_TIMEOUT:-240}" python3 -m jaxmodels bench --no-progress --config "bench/configs/$config.json" \
            --phases decode --batches "${PROFILE_BATCHES:-1,256}" --decode-steps 24 --profile "/tmp/prof_$config" \
            > "$log" 2>&1
          echo "--- $config exit $?"; grep -A4 "^| B |" "$log"; grep "^device time\|^device busy" "$log"
          grep -A12 "^| category" "$log"; done ;;
    # XLA's command-buffer scheduling: LHS (the default) keeps the kernels of a step's CUDA graph in one order;
    # CONCURRENT lets the graph run independent kernels side by side (at one sequence: the shared expert beside the
    # routing and the routed experts, the q / kv projections...), at the cost of less packed temporaries. Decode of
    # PROFILE_CONFIGS at PROFILE_BATCHES (default 1 and 256) under each mode.
    xla_flags_probe) for mode in LHS CONCURRENT; do echo "--- command buffer scheduling $mode"
          OUT="$OUT/scheduling_$mode" XLA_FLAGS="--xla_gpu_command_buffer_scheduling_mode=$mode ${XLA_FLAGS:-}" \
            PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-150} bash "$0" decode_profile | grep -v "^=== "
        done ;;
    # The shared expert inside the routed experts' grouped matmuls (on by default, JAXMODELS_SHARED_EXPERT_IN_GMM=0
    # turns it off; moe.MoE.shared_rides_with_experts): its kernel's tests and the parity tests with it on; then
    # decode at 1 and 8 sequences (Nemotron-30B's shared expert in two pieces takes it up to 8,
    # moe.SHARED_IN_GROUPED_MAX_ROWS / 2) with it on and off.
    shared_gmm_tests) JAXMODELS_SHARED_EXPERT_IN_GMM=1 QUICK_TESTS="tests/pallas_kernels/test_grouped_matmul.py
        tests/jaxmodels/test_moe.py tests/jaxmodels/test_decode_fusions.py tests/engine/test_llm.py
        tests/jaxmodels/test_nemotron_h_parity.py tests/jaxmodels/test_deepseek_v32_parity.py" bash "$0" quick_tests ;;
    shared_gmm_bench) PROFILE_BATCHES=1,8 switch_bench JAXMODELS_SHARED_EXPERT_IN_GMM shared ;;
    # The decode fusions (on by default, JAXMODELS_DECODE_FUSIONS=0 turns them off; jaxmodels/layers/decode_fusions.py):
    # their kernels' tests and the model / engine parity tests with them on; then decode with and without them.
    fusions_tests) JAXMODELS_DECODE_FUSIONS=1 QUICK_TESTS="tests/pallas_kernels/test_add_rms_norm.py
        tests/pallas_kernels/test_grouped_matmul.py tests/jaxmodels/test_moe.py tests/jaxmodels/test_decode_fusions.py
        tests/engine/test_llm.py tests/jaxmodels/test_nemotron_h_parity.py tests/jaxmodels/test_deepseek_v32_parity.py" \
        bash "$0" quick_tests ;;
    fusions_bench) switch_bench JAXMODELS_DECODE_FUSIONS fusions ;;
    # The persistent compilation cache (jaxmodels/compilation_cache.py): the same bench started twice on one cache
    # directory, the warm-up time of each ("buckets compiled in"), and the decode figures (the same programs).
    # Issue 44: the padding cost of bucket lists (decode steps and prefills at each size, both Nemotron-H classes),
    # then a new user's start: cold, then warm from the compilation cache in a new process, with the serving run
    # during and after the background compilation; the real-size checkpoint's load.
    start_padding) for config in ${PADDING_CONFIGS:-nemotron_h_nano30b_a3b nemotron_h_nano9b}; do
          timeout ${PADDING_TIMEOUT:-280} python3 bench/startup.py padding --no-progress --config "bench/configs/$config.json" \
            --decode-sizes 1,2,4,8,12,16,24,32,48,64,96,128,192,256 --prefill-sizes 16,32,64,128,256,384,512,768,1024 \
            --json "$OUT/padding_$config.json" > "$OUT/padding_$config.log" 2>&1; echo "exit $?"
          grep -B2 -A30 "^### padding" "$OUT/padding_$config.log"; done ;;
    start_30b) rm -rf /tmp/startcache; for run in cold warm; do echo "--- $run"
          timeout $([ $run = warm ] && echo 180 || echo 380) python3 bench/startup.py start --no-progress --compilation-cache /tmp/startcache \
            --config bench/configs/nemotron_h_nano30b_a3b.json $([ $run = warm ] && echo --serve 0) \
            --json "$OUT/start_30b_$run.json" > "$OUT/start_30b_$run.log" 2>&1; echo "exit $?"
          grep -A12 "^### start" "$OUT/start_30b_$run.log"; done ;;
    # Where the start goes (issue 44): the largest programs' lowering profiled (13 of the 52 layers), then a cold
    # start (no serving run), a warm one from its compilation cache, and a warm one that compiles nothing in the
    # background during the first request (--warmup covering): their first requests' step times side by side.
    start_probe) rm -rf /tmp/startcache
        timeout 120 python3 bench/startup.py lowering --no-progress --config bench/configs/nemotron_h_nano30b_a3b.json \
          --layers 13 --profile-rows 45 > "$OUT/lowering_30b.log" 2>&1; echo "exit $?"; grep "^###" "$OUT/lowering_30b.log"
        for run in cold:background warm:background warm:covering; do echo "--- $run"; mode=${run#*:}
          timeout $([ ${run%:*} = warm ] && echo 100 || echo 240) python3 bench/startup.py start --no-progress \
            --compilation-cache /tmp/startcache --config bench/configs/nemotron_h_nano30b_a3b.json --serve 0 \
            --warmup $mode $([ ${run%:*} = warm ] && echo --stop-after-first) --json "$OUT/probe_${run/:/_}.json" \
            > "$OUT/probe_${run/:/_}.log" 2>&1; echo "exit $?"; grep -A8 "^### start" "$OUT/probe_${run/:/_}.log" | cut -c1-600; done ;;
    # Prefix caching (issue 40): the multi-turn workload, caching on against off in one process, for the Nano-9B
    # class and the DeepSeek 4-layer model (64 conversations x 6 turns, 2k-token system prompt, 200 + 128 a turn).
    multiturn) for config in ${MULTITURN_CONFIGS:-nemotron_h_nano9b deepseek_v32_4layer}; do
          timeout ${MULTITURN_TIMEOUT:-280} python3 -m jaxmodels bench --workload multiturn --no-progress \
            --config "bench/configs/$config.json" --json "$OUT/multiturn_$config.json" > "$OUT/multiturn_$config.log" 2>&1
          echo "exit $?"; grep -A6 "^### multi" "$OUT/multiturn_$config.log"; done ;;
    # What prefix caching (on by default) costs where prompts share nothing: the 256 x (1k, 1k) serving run of the
    # Nano-9B class with it and without (its extend steps' state copies, one more chunk per prompt).
    serve_prefix) for flag in "" --no-prefix-caching; do echo "--- prefix caching ${flag:-on}"
          timeout 280 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano9b.json \
            --phases serve --serve 256 --serve-in 1000 --serve-out 1000 --arrival-rate 0 $flag \
            --json "$OUT/serve_prefix${flag:+_off}.json" 2>&1 | grep -A3 "^### serving"; done ;;
    start_9b) timeout 250 python3 bench/startup.py start --no-progress --config bench/configs/nemotron_h_nano9b.json \
          --json "$OUT/start_9b.json" > "$OUT/start_9b.log" 2>&1; echo "exit $?"; grep -A12 "^### start" "$OUT/start_9b.log"
        timeout 150 python3 bench/startup.py load --no-progress --config bench/configs/nemotron_h_nano9b.json \
          --checkpoint /tmp/nano9b_ckpt 2>&1 | tail -3 ;;
    compile_cache) rm -rf /tmp/jaxcache; for run in cold warm; do echo "--- $run start"
          timeout 250 python3 -m jaxmodels bench --no-progress --config bench/configs/nemotron_h_nano30b_a3b.json \
            --phases decode --batches 1,8 --decode-steps 16 --compilation-cache /tmp/jaxcache 2>&1 \
            | grep "compiled in\|^| 1 \|^| 8 "; done; du -sh /tmp/jaxcache; ls /tmp/jaxcache | wc -l ;;
    # The launch thread (engine.runner, on by default): its two tests on the GPU, then decode of PROFILE_CONFIGS at
    # 1 and 256 sequences without and with it (host ms / step is the scheduling thread's with it).
    launch_thread) QUICK_TESTS="tests/engine/test_llm.py::test_overlapped_loop_gives_the_plain_loops_tokens
        tests/engine/test_speculative.py::test_preemption_with_speculation_is_lossless" bash "$0" quick_tests
        for config in ${PROFILE_CONFIGS:-nemotron_h_nano9b nemotron_h_nano30b_a3b}; do
          for flag in --no-launch-thread ""; do echo "--- $config ${flag:-(launch thread)}"
            timeout 150 python3 -m jaxmodels bench --no-progress --config "bench/configs/$config.json" --phases decode \
              --batches 1,256 --decode-steps 32 $flag 2>&1 | grep -A4 "^| B |"; done; done ;;
    # The GPU tests of the files named in QUICK_TESTS (pytest node ids), in 8 workers as the suite runs.
    quick_tests) OUT="$OUT/quick" GPU_CHECK_TESTS="$QUICK_TESTS" bash "$0" suite ;;
    mla_prefill) python3 bench/dsa_kernels.py --only mla_prefill --log "$OUT/mla_prefill.log" 2>&1 | tail -20 ;;
    # A 2,048-query prefill chunk on the Mosaic kernel at auto's split count (8: the owner schedule, 4 blocks a
    # program), at one split (auto's seesaw, 32 blocks) and at two (the owner schedule), Triton's default tiles beside.
    mla_prefill_splits) python3 bench/dsa_kernels.py --quick --only mla_prefill > "$OUT/mla_prefill_splits.log" 2>&1 \
          || tail -5 "$OUT/mla_prefill_splits.log"; grep "sparse MLA prefill" "$OUT/mla_prefill_splits.log" ;;
    # Distinct greedy tokens and experts touched per MoE layer of the benchmark's random model, full width: whether
    # decode rows read the experts that per-request tokens would. Two steps: each re-runs the whole forward, and at
    # full width four overran the timeout. PROBE_HEADS="uncentered centered" compares the LM head as drawn with the
    # benchmark's centered one (jaxmodels.benchmark.center_lm_head).
    greedy_probe) for config in ${PROBE_CONFIGS:-nemotron_h_nano30b_a3b deepseek_v32_4layer}; do
        for head in ${PROBE_HEADS:-centered}; do echo "--- $config, $head head"
          flag=""; [ "$head" = uncentered ] && flag=--uncentered-head
          timeout 150 python3 bench/lab/greedy_routing_probe.py --config "bench/configs/$config.json" --batch 32 \
            --steps 2 $flag 2>&1 | grep "^step\|Error"; done; done ;;
  esac
done
