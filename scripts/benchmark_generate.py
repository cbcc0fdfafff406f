#!/usr/bin/env python3
"""Greedy generation speed: this fork's SequenceGenerator (KV cache) against transformers' `generate` on the
same weights exported with scripts/export_hf.py, in one run, and what the cache buys.

    python scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \\
        --prompt-len 512 --new-tokens 256 --dtype bf16

Random weights (the preset's own initialization, seeded), random prompts of `--prompt-len` tokens over a
`--vocab-size` dictionary. Both sides decode greedily exactly `--new-tokens` tokens (end of sentence blocked
until then: fork `--min-len`, transformers `min_new_tokens`), after the same first token (`</s>`, fairseq's
and OPT's convention). Prints a markdown table (tokens/s = batch x new tokens / wall time, best of
`--repeats` after a warm-up), the share of rows whose greedy tokens are identical, and the time of one
uncached step (a full forward over the prefix, averaged over prefix lengths from the prompt to the end).
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fairseq.checkpoint.io import atomic_torch_save  # noqa: E402
from fairseq.data.dictionary import Dictionary  # noqa: E402
from fairseq.dataclass.utils import config_to_dict  # noqa: E402
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config  # noqa: E402
from fairseq.generation.sequence_generator import SequenceGenerator  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="transformer_lm_gpt3_xl")
    p.add_argument("--vocab-size", type=int, default=50272, help="dictionary size, specials included")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--uncached-samples", type=int, default=8, help="prefix lengths timed without the cache")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-transformers", action="store_true", help="time the fork only")
    p.add_argument("--no-cuda-graphs", action="store_true", help="the fork's decode steps eagerly")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--seed", type=int, default=1)
    return p


def build(args):
    dictionary = Dictionary()
    for i in range(args.vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    cfg = preset_config(args.arch, tokens_per_sample=args.prompt_len + args.new_tokens + 1)
    torch.manual_seed(args.seed)
    model = TransformerLanguageModel.build(cfg, len(dictionary), dictionary.pad())
    return dictionary, cfg, model.to(DTYPES[args.dtype]).eval()


def export_to_transformers(model, cfg, dictionary, directory, dtype):
    from fairseq.export import hf

    ckpt_dir = os.path.join(directory, "ckpt")
    os.makedirs(ckpt_dir)
    path = os.path.join(ckpt_dir, "checkpoint_best.pt")
    atomic_torch_save({"cfg": {"model": config_to_dict(cfg), "task": {"_name": "language_modeling"}},
                       "model": model.state_dict()}, path)
    dictionary.save(os.path.join(ckpt_dir, "dict.txt"))
    out = os.path.join(directory, "hf")
    hf.export(path, out, dtype=dtype, tokenizer=False)
    os.remove(path)
    return out


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn, repeats, device):
    fn()  # warm-up (allocator, kernels' autotuning)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times), result


def fork_generate(model, dictionary, prompts, args):
    total = args.prompt_len + args.new_tokens
    generator = SequenceGenerator([model], dictionary, beam_size=1, max_len_a=0, max_len_b=total, min_len=total,
                                  cuda_graphs=not args.no_cuda_graphs)
    sample = {"net_input": {"src_tokens": prompts,
                            "src_lengths": torch.full((prompts.size(0),), prompts.size(1), device=prompts.device)}}

    def run():
        hypos = generator.generate([model], sample, prefix_tokens=prompts)
        return torch.stack([h[0]["tokens"][args.prompt_len:total] for h in hypos])

    return run


def hf_generate(hf_model, prompts, args, eos):
    first = torch.full((prompts.size(0), 1), eos, dtype=prompts.dtype, device=prompts.device)
    ids = torch.cat([first, prompts], dim=1)
    mask = torch.ones_like(ids)

    def run():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                min_new_tokens=args.new_tokens, do_sample=False, num_beams=1, use_cache=True)
        return out[:, ids.size(1):]

    return run


@torch.no_grad()
def uncached_step_time(model, dictionary, args, device):
    """Mean time of one full forward at batch 1 over prefixes from the prompt's length to the end: what each
    generated token costs without the cache."""
    lengths = torch.linspace(args.prompt_len, args.prompt_len + args.new_tokens, args.uncached_samples).long()
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (1, int(lengths[-1])), device=device)
    model(tokens[:, :int(lengths[0])])  # warm-up
    total = 0.0
    for n in lengths.tolist():
        sync(device)
        start = time.perf_counter()
        model(tokens[:, :n])[0][:, -1].argmax(-1)  # (logits, extra)
        sync(device)
        total += time.perf_counter() - start
    return total / len(lengths)


def main(argv=None):
    args = get_parser().parse_args(argv)
    device = args.device
    dictionary, cfg, model = build(args)
    model.to(device)
    hf_model = None
    tmp = tempfile.TemporaryDirectory()
    if not args.no_transformers:
        import transformers

        out = export_to_transformers(model.cpu(), cfg, dictionary, tmp.name, args.dtype)
        model.to(device)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=DTYPES[args.dtype], attn_implementation="sdpa").to(device).eval()
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = torch.randint(dictionary.nspecial, len(dictionary), (batch, args.prompt_len), generator=g)
        prompts = prompts.to(device)
        with torch.no_grad():
            fork_s, fork_tokens = best_time(fork_generate(model, dictionary, prompts, args), args.repeats, device)
        row = {"batch": batch, "fork_tokens_per_s": batch * args.new_tokens / fork_s, "fork_s": fork_s}
        if hf_model is not None:
            with torch.no_grad():
                hf_s, hf_tokens = best_time(hf_generate(hf_model, prompts, args, dictionary.eos()), args.repeats,
                                            device)
            same = (fork_tokens == hf_tokens).all(dim=1)
            mismatch = (fork_tokens != hf_tokens).float().argmax(dim=1)
            row.update(hf_tokens_per_s=batch * args.new_tokens / hf_s, hf_s=hf_s, speedup=hf_s / fork_s,
                       identical_rows=int(same.sum()), first_mismatch=[int(m) for m, s in zip(mismatch, same) if not s])
        rows.append(row)
        del prompts
    uncached = uncached_step_time(model, dictionary, args, device)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"{args.arch}, {args.dtype}, {name}, torch {torch.__version__}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, best of {args.repeats}, "
          f"{'eager decode steps' if args.no_cuda_graphs else 'CUDA-graph decode steps'}")
    print("| batch | fork tokens/s | transformers tokens/s | fork / transformers | identical rows |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        hf_cols = (f"{r['hf_tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['identical_rows']}/{r['batch']}"
                   if "hf_s" in r else "- | - | -")
        print(f"| {r['batch']} | {r['fork_tokens_per_s']:.0f} | {hf_cols} |")
    cached_ms = 1000 * rows[0]["fork_s"] / args.new_tokens
    print(f"time per token at batch {rows[0]['batch']}: {cached_ms:.2f} ms with the cache, "
          f"{1000 * uncached:.2f} ms without (one full forward over the prefix)")
    for r in rows:
        if r.get("first_mismatch"):
            print(f"batch {r['batch']}: rows differ from step(s) {sorted(r['first_mismatch'])[:8]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "uncached_step_s": uncached, "device": name}, f, indent=1)
    tmp.cleanup()


if __name__ == "__main__":
    main()
