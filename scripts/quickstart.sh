#!/usr/bin/env bash
# The main job, end to end on a fresh machine with Python 3.10+: install (into .venv), write a sample corpus
# from text that ships with Python, preprocess it, train a small transformer LM on the CPU, evaluate it.
# Everything lands under ${WORK:-work/quickstart}. Takes a few minutes on 2 CPU cores (a first run also
# installs, which it says). MAX_UPDATE (default 300) sets the training length; the docs tests use a tiny one.
set -euo pipefail
echo "== 0/4 the environment: ${FAIRSEQ_VENV:-.venv} (created and installed into on the first run)"
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
WORK="${WORK:-work/quickstart}"
MAX_UPDATE="${MAX_UPDATE:-300}"
mkdir -p "$WORK"

echo "== 1/4 sample corpus -> $WORK/text"
python examples/language_model/prepare_sample_corpus.py "$WORK/text"

echo "== 2/4 fairseq-preprocess -> $WORK/data-bin"
fairseq-preprocess --only-source \
    --trainpref "$WORK/text/train.txt" --validpref "$WORK/text/valid.txt" --testpref "$WORK/text/test.txt" \
    --destdir "$WORK/data-bin" --workers 2

echo "== 3/4 fairseq-train (transformer_lm, 2 layers, CPU, $MAX_UPDATE updates) -> $WORK/checkpoints"
fairseq-train --task language_modeling "$WORK/data-bin" --save-dir "$WORK/checkpoints" \
    --arch transformer_lm --decoder-layers 2 --decoder-embed-dim 128 --decoder-ffn-embed-dim 512 \
    --decoder-attention-heads 4 --decoder-input-dim 128 --decoder-output-dim 128 \
    --share-decoder-input-output-embed --dropout 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --clip-norm 1.0 \
    --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates 100 --warmup-init-lr 1e-07 \
    --tokens-per-sample 128 --sample-break-mode none --max-tokens 4096 \
    --max-update "$MAX_UPDATE" --validate-interval 4 --save-interval 4 --save-interval-updates 150 --keep-interval-updates 1 \
    --log-format simple --log-interval 50 --num-workers 0 --cpu --seed 1

echo "== 4/4 fairseq-eval-lm on the test split"
fairseq-eval-lm "$WORK/data-bin" --path "$WORK/checkpoints/checkpoint_best.pt" --gen-subset test \
    --tokens-per-sample 128 --context-window 64 --max-tokens 4096 --cpu

echo "== done: data in $WORK/data-bin, checkpoints in $WORK/checkpoints"
echo "== the docs' commands (fairseq-*, python scripts/...) run in this environment: first"
echo "   source ${VENV#$ROOT/}/bin/activate"
