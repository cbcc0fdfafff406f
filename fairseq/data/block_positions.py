"""The positions rule of fairseq-eval-lm and fairseq-generate: a block the model reads must fit the positions
it was trained with.

Past them a learned position table has no entry and sinusoidal positions give numbers the model never saw
(eval-lm would print a worse perplexity without a word). So a split whose longest block is longer than the
model's positions is refused in one line naming the flag that made the block and the fix, or, with
--skip-invalid-size-inputs-valid-test, such blocks are skipped (`block_limit`).
"""

from typing import Optional

import numpy as np

from fairseq.dataclass.flag_values import task_adds_bos, task_block_options

TRAINED = "the --tokens-per-sample / --max-target-positions it was trained with"


def block_limit(max_positions: Optional[int], context_window: int = 0) -> Optional[int]:
    """The longest block (as the dataset counts it) that fits `max_positions` with `context_window` tokens of
    context in front of it; None: no limit."""
    return None if max_positions is None else max_positions - context_window


def generation_start_positions(task_cfg) -> int:
    """Positions a fairseq-generate prompt (the whole sample: --prefix-size 0) takes besides its block's tokens.

    The prompt is the block's source, the token before the block and the block but its last token, after the
    token generation starts from (</s>, or <s> with --add-bos-token); a source that already begins with that
    token does not repeat it. With --sample-break-mode none the token before a block is the end of the previous
    block, not </s>, and with --add-bos-token <s> comes before it: one position more than the block. The other
    modes' blocks follow a </s>: the block's own tokens."""
    _, mode = task_block_options(task_cfg)
    return 1 if mode == "none" or task_adds_bos(task_cfg) else 0


def check_blocks_fit(
    sizes,
    max_positions: Optional[int],
    split: str,
    task_cfg,
    context_window: int = 0,
    other_fix: str = "",
    generation: bool = False,
) -> None:
    """ValueError when the longest block of `split` (`sizes`: tokens per block, `<s>` not counted, as in
    training) plus `context_window` is longer than `max_positions`. `task_cfg` holds the --tokens-per-sample
    the blocks were cut with (without the context window) and --sample-break-mode; `other_fix` is a further
    way out the caller offers (", or ..."). `generation`: the blocks are fairseq-generate's prompts, which
    may take one position more: the limit is block_limit(max_positions, generation_start_positions(task_cfg))."""
    start = generation_start_positions(task_cfg) if generation else 0
    limit = block_limit(max_positions, context_window + start)
    sizes = np.asarray(sizes)
    if limit is None or len(sizes) == 0 or int(sizes.max()) <= limit:
        return
    longest = int(sizes.argmax())
    block = int(sizes[longest])
    tokens_per_sample, mode = task_block_options(task_cfg)
    model = f"the model's {max_positions} positions ({TRAINED})"
    if mode != "eos" and tokens_per_sample is not None and block <= tokens_per_sample:
        # the block is as long as --tokens-per-sample made it
        given = tokens_per_sample + context_window
        window = (
            (
                f" (blocks of {tokens_per_sample} tokens read after up to --context-window {context_window} "
                "tokens of context)"
            )
            if context_window
            else ""
        )
        smaller = ", with a --context-window smaller than it" if context_window else ""
        index = f"sample {longest} of {split!r} has {block} tokens"
        if start:
            token = "<s>" if task_adds_bos(task_cfg) else "</s>"
            raise ValueError(
                f"--tokens-per-sample {given} makes prompts that need {block + start} positions with the {token} "
                f"generation starts from ({index}; a prompt is the token before its block and all of the block but "
                f"its last token), more than {model}: pass --tokens-per-sample {max_positions - start} or "
                f"less{other_fix}, or --skip-invalid-size-inputs-valid-test to skip such samples"
            )
        raise ValueError(
            f"--tokens-per-sample {given}{window} is more than {model}: {index}; pass "
            f"--tokens-per-sample {max_positions} or less{smaller}{other_fix}"
        )
    # a line longer than the block size: --sample-break-mode keeps it whole
    context = f" plus --context-window {context_window} tokens of context" if context_window else ""
    context += " plus the token generation starts from" if start else ""
    blocks = max_positions - (1 if generation else 0)  # what --sample-break-mode none would need
    raise ValueError(
        f"sample {longest} of {split!r} is one line of {block} tokens{context} (--sample-break-mode {mode} keeps "
        f"lines whole), more than {model}: pass --sample-break-mode none to cut the text into blocks of "
        f"--tokens-per-sample {blocks} or less{other_fix}, or "
        "--skip-invalid-size-inputs-valid-test to skip such lines"
    )
