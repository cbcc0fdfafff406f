#!/usr/bin/env bash
# One-call GPU validation on a 2-GPU machine (used with the device tool; any 2-GPU box works).
#   bash scripts/gpu_validation.sh tests|resume|bench-a|bench-rest|175b   (OUT=dir for logs, default gpu_out)
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
tar -czf "$OUT/${1:-tests}.tgz" --exclude=./pytest --exclude=./data --exclude="*.pt" --exclude="./ck/checkpoint*" -C "$WORK" .
exit 0
