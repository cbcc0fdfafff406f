#!/usr/bin/env bash
# One-call GPU validation (used with the device tool). On 2 GPUs: tests|resume|bench-a|bench-rest|175b.
# On one H100/H200, the open measurements (issue 41: decode, decode-int8, gen-bench, decode-more; 43: serve;
# 39: ckpt-blocked, ckpt-tps, fp8-tp-parity; older: gen-*, fp8*), each part one 10-minute call:
#   decode|decode-more|decode-int8|gen-tests|gen-bench|gen-int8|fp8|fp8-tp-parity|fp8-bench|ckpt-blocked|ckpt-tps|serve       (OUT=dir for logs, default gpu_out)
# The lent machine lacks hydra-core, omegaconf and torchao: carry the wheels (.whl/, ignored) and first run
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Installs nothing: expects torch, numpy, omegaconf, hydra, sentencepiece, tqdm (puts the repo on PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"   # gets one archive per part (the device tool brings back few files)
WORK="$(mktemp -d)"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
B="python3 scripts/benchmark_fsdp.py --nproc 2 --num-workers 1"
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" 2>&1 | tee "$WORK/$name.txt" | tail -25; echo "=== $name exit ${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
case "${1:-tests}" in
  tests)
    step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests -rs --basetemp "$WORK/pytest"
    ;;
  resume)  # issue 4 on GPUs: 2 GPUs -> save sharded -> resume on 1 GPU -> consolidate -> eval-lm (dir and file)
    D="$WORK/data"; python3 examples/language_model/prepare_sample_corpus.py "$D/text" >/dev/null
    python3 -m fairseq_cli.preprocess --only-source --trainpref "$D/text/train.txt" --validpref "$D/text/valid.txt" \
      --testpref "$D/text/test.txt" --destdir "$D/bin" --workers 4 >/dev/null 2>&1
    T="-m fairseq_cli.train --task language_modeling $D/bin --save-dir $WORK/ck --arch transformer_lm_gpt2_small
       --decoder-layers 4 --bf16 --ddp-backend fully_sharded --fsdp-forward-prefetch --fsdp-sync-free
       --use-sharded-state --optimizer adam --lr 3e-4 --tokens-per-sample 512 --batch-size 8 --log-format json
       --log-interval 5 --log-file $WORK/ck/train.log --num-workers 1"
    step two_gpus 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 $T --max-update 40
    step one_gpu 240 python3 $T --update-freq 2 --max-update 60
    step consolidate 120 python3 scripts/consolidate_fsdp_shards.py "$WORK/ck/checkpoint_last" "$WORK/ck/full.pt"
    for p in "$WORK/ck/checkpoint_last" "$WORK/ck/full.pt"; do
      step eval 120 python3 -m fairseq_cli.eval_lm "$D/bin" --path "$p" --gen-subset test --tokens-per-sample 512 --batch-size 8
    done
    step distributed_tests 300 python3 -m pytest -q -p no:cacheprovider tests/distributed
    ;;
  bench-a)
    step bench_a_b8 420 $B --layers 12 --embed-dim 6144 --heads 48 --seq 2048 --batch 8 --log-interval 4 --intervals 2 --compile --combos all --out "$WORK/a_b8"
    ;;
  bench-rest)
    step bench_a_b1 150 $B --layers 12 --embed-dim 6144 --heads 48 --seq 2048 --batch 1 --log-interval 5 --intervals 2 --out "$WORK/a_b1"
    step bench_b_b8 200 $B --layers 32 --embed-dim 2560 --heads 32 --seq 2048 --batch 8 --log-interval 4 --intervals 2 --out "$WORK/b_b8"
    step bench_c_b1 150 $B --arch transformer_lm_gpt3_medium --seq 2048 --batch 1 --log-interval 10 --intervals 2 --out "$WORK/c_b1"
    ;;
  gen-tests)  # issue 33: device decode loops, CUDA graphs, int8 (greedy agreement figure printed)
    step gen_tests 540 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_generation_gpu.py \
      tests/gpu/test_quantize_gpu.py -rs --basetemp "$WORK/pytest"
    ;;
  decode)  # issue 41, one call on one H100 (<= 9 min with the compiles): the decode GPU tests (the compiled step first),
           # then greedy with the eager and the compiled decode step beside transformers' static compiled path, in one
           # run: tokens/s, % of copy bandwidth, kernels per step (--profile), each row's first call (compile, capture),
           # each row's prefill apart (the compiled row compiles its prompts' forward too: 2 more compiles, rows 1 and 32)
    step decode_tests 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_decode_compiled_gpu.py \
      tests/gpu/test_decode_attention_gpu.py tests/gpu/test_beam_block_table_gpu.py tests/gpu/test_decode_engine_gpu.py \
      -rs --basetemp "$WORK/pytest"
    step decode_bench 330 python3 scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \
      --prompt-len 512 --new-tokens 256 --dtype bf16 --repeats 1 --rows greedy,greedy-compiled --no-default-cache \
      --no-int8-matmuls --no-attention-calls --profile --json "$WORK/decode.json"
    ;;
  decode-more)  # the rest of issue 41's rows (SDPA without the kernel, max-autotune) and generation tests; int8: decode-int8
    step decode_more_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_generation_gpu.py \
      -rs --basetemp "$WORK/pytest"
    step decode_more_bench 300 python3 scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \
      --prompt-len 512 --new-tokens 256 --dtype bf16 --repeats 1 --rows greedy,greedy-compiled,greedy-sdpa \
      --compile-mode max-autotune-no-cudagraphs --no-transformers --no-int8-matmuls --json "$WORK/decode_more.json"
    ;;
  decode-int8)  # issue 41.4, one call on one H100 (step limits set from estimates, not yet measured): the int8 GPU
                # tests (every launch shape, greedy agreement); bf16 greedy beside int8 (the Triton kernels, launch
                # shapes timed at first use) with the table of one Linear's int8 paths at rows 1 and 32 (its inductor
                # column compiled in the default mode); then the compiled steps, max-autotune: bf16, int8 through
                # the Triton op (FAIRSEQ_INT8_MATMUL=triton) and through inductor's fusion (=inductor)
    step decode_int8_tests 170 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_quantize_gpu.py \
      -rs --basetemp "$WORK/pytest"
    step decode_int8_bench 190 python3 scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \
      --prompt-len 512 --new-tokens 256 --dtype bf16 --repeats 1 --rows greedy,int8 --no-transformers \
      --no-attention-calls --json "$WORK/decode_int8.json"
    step decode_int8_compiled 220 python3 scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl \
      --batch-sizes 1,32 --prompt-len 512 --new-tokens 256 --dtype bf16 --repeats 1 \
      --rows greedy,greedy-compiled,int8-compiled,int8-inductor --compile-mode max-autotune-no-cudagraphs \
      --no-transformers --no-attention-calls --no-int8-matmuls --json "$WORK/decode_int8_compiled.json"
    ;;
  gen-bench)  # issue 33: the fork (greedy, beam 4, sampling) against transformers' default and static-cache paths
    step gen_bench 580 python3 scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \
      --prompt-len 512 --new-tokens 256 --dtype bf16 --repeats 2 --rows greedy,beam4,sample --no-int8-matmuls \
      --json "$WORK/generate_h200.json"
    ;;
  gen-int8)
    step gen_int8 580 python3 scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \
      --prompt-len 512 --new-tokens 256 --dtype bf16 --repeats 2 --rows greedy,int8 --no-transformers \
      --json "$WORK/generate_int8_h200.json"
    ;;
  fp8)  # issue 31: the TP plan on a one-rank mesh with float8, --compile and checkpointing
    export FAIRSEQ_TP_MESH_OF_ONE=1
    step fp8_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_float8_gpu.py -rs --basetemp "$WORK/pytest"
    step fp8_parity 300 python3 scripts/fp8_loss_parity.py --updates 300 --recipes tensorwise --compile --tp-mesh-of-one
    ;;
  fp8-tp-parity)  # issue 39.4: float8 under the TP plan against bf16 of the same compile mode, two seeds, the curve
    export FAIRSEQ_TP_MESH_OF_ONE=1
    step fp8_tp_parity 560 python3 scripts/fp8_loss_parity.py --updates "${UPDATES:-300}" --recipes tensorwise \
      --compile --tp-mesh-of-one --seeds "${SEEDS:-1,2}" --curve --out "$WORK/fp8_tp"
    ;;
  fp8-bench)
    step fp8_bench 580 python3 scripts/benchmark_fsdp.py --nproc 1 --layers 32 --embed-dim 2560 --heads 32 --seq 2048 \
      --batch 8 --combos '' --fp8 tensorwise --compile --no-compile-rows --no-reference --tp-mesh-of-one
    ;;
  ckpt-blocked)  # issues 32/39 (docs/checkpoints.md): blocked time per save, sync vs async, single file and sharded
    step ckpt_blocked 540 python3 scripts/benchmark_checkpoint.py --nproc 1 --layers 32 --embed-dim 2560 --heads 32 \
      --vocab 50000 --seq 2048 --batch 8 --saves 3 --save-every 20 --skip throughput --no-optimizer-state \
      --layouts single,sharded --work-dir "$WORK/ckbench"
    ;;
  ckpt-tps)  # tokens/s saving every 20 updates (async, single file and sharded) against --no-save
    step ckpt_tps 540 python3 scripts/benchmark_checkpoint.py --nproc 1 --layers 32 --embed-dim 2560 --heads 32 \
      --vocab 50000 --seq 2048 --batch 8 --skip blocked --throughput-updates 100 --throughput-save-every 20 \
      --warmup 5 --no-optimizer-state --layouts single,sharded --work-dir "$WORK/ckbench"
    ;;
  serve)  # issue 43: fairseq-serve at 1, 8 and 64 clients on the 1.3B preset (random weights), against the hub one
           # at a time; the image lacks starlette and uvicorn: carry their wheels in .whl/ too
    step serve_bench 560 python3 scripts/benchmark_serve.py --bf16 --arch transformer_lm_gpt3_xl --vocab-size 50272 \
      --decoder-layers 24 --decoder-embed-dim 2048 --positions 2048 --prompt-len 256 --new-tokens 128 \
      --concurrency 1,8,64 --requests 64 --hub-baseline
    ;;
  175b)
    layers="${LAYERS:-2}"
    step l175b 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m fairseq_cli.train \
      --task dummy_lm --dict-size 50268 --tokens-per-sample 2048 --batch-size 1 --max-tokens 2048 \
      --arch transformer_lm_gpt3_175 --decoder-layers "$layers" --bf16 --checkpoint-activations \
      --ddp-backend fully_sharded --fsdp-forward-prefetch --fsdp-sync-free --optimizer adam \
      --adam-betas '(0.9, 0.95)' --lr 3e-5 --lr-scheduler fixed --clip-norm 1.0 --max-update 6 \
      --log-format json --log-interval 1 --log-file "$WORK/l175b.log" --no-save --disable-validation \
      --num-workers 1 --required-batch-size-multiple 1
    ;;
esac
# Logs only: checkpoints and data stay behind (the device tool brings back at most 16 MiB a file).
tar -czf "$OUT/${1:-tests}.tgz" --exclude=./pytest --exclude=./data --exclude="*.pt" --exclude="./ck/checkpoint*" \
  --exclude=./ckbench -C "$WORK" .
exit 0
