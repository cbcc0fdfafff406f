#!/usr/bin/env python3
"""Generation speed: this fork's SequenceGenerator (KV cache) against transformers' `generate` on the same weights
exported with scripts/export_hf.py, in one run; the fork's beam, sampling and int8 rows; and how close each fork
row comes to the memory-bandwidth limit.

    python scripts/benchmark_generate.py --arch transformer_lm_gpt3_xl --batch-sizes 1,32 \\
        --prompt-len 512 --new-tokens 256 --dtype bf16

Random weights (the preset's own initialization, seeded), random prompts of `--prompt-len` tokens over a
`--vocab-size` dictionary. Every row decodes exactly `--new-tokens` tokens per sentence (end of sentence blocked
until then: fork `--min-len`, transformers `min_new_tokens`) after the same first token (`</s>`, fairseq's and
OPT's convention); tokens/s = batch x new tokens / wall time, best of `--repeats` after a warm-up.

Fork rows (`--rows`): `greedy`; `greedy-compiled` (greedy with the one-token step compiled by inductor inside
the CUDA graphs, fairseq.generation.compiled_step, mode `--compile-mode`; its first call, compile and capture,
is printed apart); `greedy-sdpa` (greedy with the split-KV decode attention kernel turned off:
SDPA over a masked window, as before the kernel; CUDA with Triton only, where the kernel runs); `beam4` (beam
search, 4 hypotheses per sentence); `sample` (top-k 50 and top-p 0.9, seeded); `int8` (greedy after `--quantize
int8-weight-only`, fairseq.generation.quantize: CUDA and bf16 only, run last since it quantizes the model in
place; `int8-compiled`: the same with the compiled step, the int8 matmul one opaque op in it (the Triton kernels,
FAIRSEQ_INT8_MATMUL=triton); `int8-inductor`: the compiled step with FAIRSEQ_INT8_MATMUL=inductor, the int8 matmul
tensor code inductor fuses). The Triton kernels' launch shapes, timed at each shape's first call (the warm-up), are
printed after the tables. On CUDA the
model's q/k/v projections are fused first (one GEMM, as fairseq-generate loads a model). Transformers, on the
exported weights (OPTForCausalLM, SDPA attention), greedy only: its default dynamic cache, and the static cache (`cache_implementation="static"`,
with which transformers 5 compiles the forward itself on CUDA: torch.compile mode "reduce-overhead", its
documented fastest path; on the CPU it runs uncompiled). Identical rows: sentences whose greedy tokens equal the
fork's bf16 greedy ones.

Bandwidth: a decode step reads every weight once (their stored bytes: int8 weights count 1 byte) and the KV cache
of every row up to the live length (mean over the run: prompt + new tokens / 2 + 1). Achieved GB/s = those bytes x
new tokens / wall time (so the prompt's forward counts against it); the limit is the device's own copy bandwidth,
measured here by a large device-to-device copy (bytes read + written / time).

Int8 matmuls: for each weight shape the int8 row quantizes and each batch size, one Linear's time per call (on
CUDA inside a CUDA graph, each call reading another of 20 copies of the weights, more than the L2 cache holds, as a
decode step reads weights from memory) in bf16; through fairseq's Int8WeightOnlyLinear (what the int8 row runs:
fairseq.kernels.int8_matmul, its launch shape timed at first use); on CUDA the same Triton kernels with the launch
shape before tuning (`triton 32x128`: BLOCK_N 32, BLOCK_K 128, no split-K) and with the untimed heuristic's, and
FAIRSEQ_INT8_MATMUL=inductor's form compiled in `--compile-mode`; and torch's `torch._weight_int8pack_mm` on the
same int8 values and scales.

Decode attention calls (not with --no-attention-calls): one layer's attention of one new token per row at the run's
mean live length, per batch size: SDPA over the live length's 256-slot window with a mask (the path without the
kernel) and the split-KV kernel (fairseq.kernels.decode_attention), timed inside a CUDA graph of 20 calls as the
decode step replays them; the kernel's GB/s counts the live keys and values it reads; the kernel again through a
block table of random rows (beam search's path, docs/generation.md).

`--profile`: torch.profiler over greedy decoding at each batch size (and the greedy-compiled and greedy-sdpa rows
asked for, the latter where the kernel runs):
a call that decodes one token and a call that decodes them all, profiled after a warm-up; their difference is
new tokens - 1 decode steps, from which the kernels per step (CUDA: every GPU activity, kernels replayed from CUDA
graphs included; CPU: the top-level aten ops) and the 10 kernels with the most time per step.

Prefill: every fork row's prompt forward (one batched forward of the begin token and the prompt, and the scores
of the prompt's tokens; compiled in the `-compiled` rows, fairseq.generation.compiled_step.CompiledPrefill) is
timed apart within its calls, the device synchronized around it: its first call (the compile) and its best later
call, with the prompt tokens per second.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fairseq.checkpoint.io import atomic_torch_save  # noqa: E402
from fairseq.data.dictionary import Dictionary  # noqa: E402
from fairseq.dataclass.utils import config_to_dict  # noqa: E402
from fairseq.generation import search  # noqa: E402
from fairseq.generation.decode_memory import attention_shape, kv_cache_bytes, model_bytes  # noqa: E402
from fairseq.generation.quantize import check_quantize, quantize_for_generation  # noqa: E402
from fairseq.generation.sequence_generator import SequenceGenerator  # noqa: E402
from fairseq.kernels.int8_matmul import check_int8_matmul_path, set_int8_matmul  # noqa: E402
from fairseq.kernels.int8_tuning import tuned_configs  # noqa: E402
from fairseq.kernels.decode_attention import decode_attention_available  # noqa: E402
from fairseq.modules.causal_attention import fuse_qkv_  # noqa: E402
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config  # noqa: E402
from scripts.decode_call_tables import (  # noqa: E402
    DTYPES,
    attention_call_rows,
    decode_attention_kernel,
    int8_matmul_rows,
    model_probe,
    print_attention_calls,
    print_int8_matmuls,
    print_profile,
    profile_rows,
    sync,
)

ROWS = ("greedy", "greedy-compiled", "greedy-sdpa", "beam4", "sample", "int8", "int8-compiled", "int8-inductor")
BEAM = {row: 4 if row == "beam4" else 1 for row in ROWS}
INT8_ROWS = ("int8", "int8-compiled", "int8-inductor")  # run last: the model is quantized in place
COMPILED_ROWS = ("greedy-compiled", "int8-compiled", "int8-inductor")  # the step compiled, mode --compile-mode
INT8_PATHS = {"int8-compiled": "triton", "int8-inductor": "inductor"}  # FAIRSEQ_INT8_MATMUL of a compiled int8 row
# the rows greedy tokens are compared with the greedy row's, and --profile profiles
GREEDY_ROWS = ("greedy-compiled", "greedy-sdpa", "int8", "int8-compiled", "int8-inductor")
MODEL_FLAGS = ("decoder_layers", "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads")


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="transformer_lm_gpt3_xl")
    for name in MODEL_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="override the preset's")
    p.add_argument("--vocab-size", type=int, default=50272, help="dictionary size, specials included")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rows", default=",".join(ROWS), help=f"the fork's rows, of {', '.join(ROWS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--uncached-samples", type=int, default=8, help="prefix lengths timed without the cache")
    p.add_argument("--copy-mib", type=int, default=2048, help="size of the copy that measures the bandwidth")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-transformers", action="store_true", help="time the fork only")
    p.add_argument("--no-static-cache", action="store_true", help="transformers' default cache only")
    p.add_argument("--no-default-cache", action="store_true", help="transformers' static (compiled) cache only")
    p.add_argument("--compile-mode", default="default", help="the greedy-compiled row's inductor mode")
    p.add_argument("--no-cuda-graphs", action="store_true", help="the fork's decode steps eagerly")
    p.add_argument("--no-int8-matmuls", action="store_true", help="skip the table of one Linear's int8 paths")
    p.add_argument("--no-attention-calls", action="store_true", help="skip the table of one decode attention call")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile greedy decoding (torch.profiler): kernels per step and the top 10 kernels",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--seed", type=int, default=1)
    return p


def build(args):
    dictionary = Dictionary()
    for i in range(args.vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    overrides = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    cfg = preset_config(args.arch, tokens_per_sample=args.prompt_len + args.new_tokens + 1, **overrides)
    torch.manual_seed(args.seed)
    model = TransformerLanguageModel.build(cfg, len(dictionary), dictionary.pad())
    return dictionary, cfg, model.to(DTYPES[args.dtype]).eval()


def export_to_transformers(model, cfg, dictionary, directory, dtype):
    from fairseq.export import hf

    ckpt_dir = os.path.join(directory, "ckpt")
    os.makedirs(ckpt_dir)
    path = os.path.join(ckpt_dir, "checkpoint_best.pt")
    atomic_torch_save(
        {"cfg": {"model": config_to_dict(cfg), "task": {"_name": "language_modeling"}}, "model": model.state_dict()},
        path,
    )
    dictionary.save(os.path.join(ckpt_dir, "dict.txt"))
    out = os.path.join(directory, "hf")
    hf.export(path, out, dtype=dtype, tokenizer=False)
    os.remove(path)
    return out


def best_time(fn, repeats, device):
    """(best seconds of `repeats` calls, the last result) after a warm-up call, whose seconds are kept in
    best_time.warmup (allocator, kernels' autotuning, CUDA-graph capture, compiles)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    best_time.warmup = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times), result


@torch.no_grad()
def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes per second a device-to-device copy of `mib` MiB moves (read + written), best of 5 after a warm-up."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    seconds, _ = best_time(lambda: dst.copy_(src), 5, device)  # both freed on return
    return 2 * mib * 2**20 / seconds


def fork_generate(model, dictionary, prompts, args, row, new_tokens=None):
    total = args.prompt_len + (args.new_tokens if new_tokens is None else new_tokens)
    strategy = search.Sampling(dictionary, sampling_topk=50, sampling_topp=0.9) if row == "sample" else None
    generator = SequenceGenerator(
        [model],
        dictionary,
        beam_size=BEAM[row],
        max_len_a=0,
        max_len_b=total,
        min_len=total,
        search_strategy=strategy,
        cuda_graphs=not args.no_cuda_graphs,
        compile_step=args.compile_mode if row in COMPILED_ROWS else False,
    )
    sample = {
        "net_input": {
            "src_tokens": prompts,
            "src_lengths": torch.full((prompts.size(0),), prompts.size(1), device=prompts.device),
        }
    }

    def run():
        torch.manual_seed(args.seed)
        hypos = generator.generate([model], sample, prefix_tokens=prompts)
        return torch.stack([h[0]["tokens"][args.prompt_len : total] for h in hypos])

    run.prefill_seconds = time_prefills(generator.step_model, args.device)
    return run


def time_prefills(step_model, device: str) -> list:
    """The seconds of each prefill (the prompts' forward and their scores) `step_model` runs from now on, the
    device synchronized before and after (a list that fills as it runs)."""
    seconds, prefill = [], step_model.prefill

    def timed(*args):
        sync(device)
        start = time.perf_counter()
        out = prefill(*args)
        sync(device)
        seconds.append(time.perf_counter() - start)
        return out

    step_model.prefill = timed
    return seconds


def hf_generate(hf_model, prompts, args, eos, static: bool):
    first = torch.full((prompts.size(0), 1), eos, dtype=prompts.dtype, device=prompts.device)
    ids = torch.cat([first, prompts], dim=1)
    mask = torch.ones_like(ids)
    cache = {"cache_implementation": "static"} if static else {}

    def run():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            **cache,
        )
        return out[:, ids.size(1) :]

    return run


@torch.no_grad()
def uncached_step_time(model, dictionary, args, device):
    """Mean time of one full forward at batch 1 over prefixes from the prompt's length to the end: what each
    generated token costs without the cache."""
    lengths = torch.linspace(args.prompt_len, args.prompt_len + args.new_tokens, args.uncached_samples).long()
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (1, int(lengths[-1])), device=device)
    model(tokens[:, : int(lengths[0])])  # warm-up
    total = 0.0
    for n in lengths.tolist():
        sync(device)
        start = time.perf_counter()
        model(tokens[:, :n])[0][:, -1].argmax(-1)  # (logits, extra)
        sync(device)
        total += time.perf_counter() - start
    return total / len(lengths)


def step_bytes(model, rows: int, args) -> dict:
    """Bytes one decode step reads: the weights as stored, and the KV cache of `rows` at the mean live length."""
    layers, width = attention_shape(model)
    live = args.prompt_len + args.new_tokens / 2 + 1
    kv = kv_cache_bytes(rows, 1, layers, width, torch.finfo(DTYPES[args.dtype]).bits // 8) * live
    return {"weight_bytes": model_bytes([model]), "kv_bytes": int(kv)}


def fork_rows(model, dictionary, prompts_by_batch, args, device, rows):
    """The fork's rows for every batch size: dicts of the timings, bytes and tokens."""
    out = []
    for row in rows:
        for batch, prompts in prompts_by_batch.items():
            with (
                torch.no_grad(),
                decode_attention_kernel(False if row == "greedy-sdpa" else None),
                int8_matmul_path(INT8_PATHS.get(row)),
            ):
                run = fork_generate(model, dictionary, prompts, args, row)
                seconds, tokens = best_time(run, args.repeats, device)
            prefills = run.prefill_seconds  # the warm-up's (compiles), then one per timed call
            out.append(
                {
                    "row": row,
                    "batch": batch,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": batch * args.new_tokens / seconds,
                    "first_call_s": best_time.warmup,
                    "prefill_first_s": prefills[0],
                    "prefill_s": min(prefills[1:] or prefills),
                    **step_bytes(model, batch * BEAM[row], args),
                }
            )
    return out


@contextlib.contextmanager
def int8_matmul_path(path: Optional[str]):
    """The int8 path (FAIRSEQ_INT8_MATMUL's) that steps compiled inside use (None: as set): read when a step is
    traced, which the rows' warm-up calls do inside."""
    previous = set_int8_matmul(path or check_int8_matmul_path())
    try:
        yield
    finally:
        set_int8_matmul(previous)


def hf_rows(hf_model, prompts_by_batch, args, device, eos):
    out = []
    for static in [s for s in (False, True) if not (args.no_static_cache if s else args.no_default_cache)]:
        for batch, prompts in prompts_by_batch.items():
            with torch.no_grad():
                seconds, tokens = best_time(hf_generate(hf_model, prompts, args, eos, static), args.repeats, device)
            out.append(
                {
                    "row": "static" if static else "default",
                    "batch": batch,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": batch * args.new_tokens / seconds,
                    "first_call_s": best_time.warmup,
                }
            )
    return out


def int8_reason(args, device):
    """Why the int8 row cannot run here, or None."""
    try:
        check_quantize("int8-weight-only", torch.device(device), DTYPES[args.dtype])
    except ValueError as e:
        return str(e)
    return None


def print_tables(fork, hf, args, bandwidth, uncached, name, skipped):
    greedy = {r["batch"]: r["tokens"] for r in fork if r["row"] == "greedy"}
    print(
        f"{args.arch}, {args.dtype}, {name}, torch {torch.__version__}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, best of {args.repeats}, "
        f"{'eager decode steps' if args.no_cuda_graphs or name == 'cpu' else 'CUDA-graph decode steps'}; "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    print(
        f"decode attention: {'split-KV kernel' if args.attention_kernel else 'SDPA over a masked window'} "
        "(the greedy-sdpa row: SDPA)"
    )
    print()
    print(
        "| batch | fork rows | tokens/s | ms per step | weights MB | KV cache MB read per step | GB/s read "
        "| % of copy bandwidth | tokens as greedy bf16 |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in sorted(fork, key=lambda r: (r["batch"], ROWS.index(r["row"]))):
        step_s = r["seconds"] / args.new_tokens
        rate = (r["weight_bytes"] + r["kv_bytes"]) / step_s
        agreement = f"{float((r['tokens'] == greedy[r['batch']]).float().mean()):.1%}" if r["batch"] in greedy else "-"
        same = "(reference)" if r["row"] == "greedy" else agreement if r["row"] in GREEDY_ROWS else "-"
        r.update(step_ms=1000 * step_s, gb_per_s=rate / 1e9, bandwidth_fraction=rate / bandwidth)
        print(
            f"| {r['batch']} | {r['row']} | {r['tokens_per_s']:,.0f} | {1000 * step_s:.2f} | "
            f"{r['weight_bytes'] / 1e6:,.1f} | {r['kv_bytes'] / 1e6:,.1f} | {rate / 1e9:,.1f} | "
            f"{100 * rate / bandwidth:.1f}% | {same} |"
        )
    for row, reason in skipped.items():
        print(f"\n{row}: not run ({reason})")
    if hf:
        print_transformers(fork, hf, greedy, args)
    if not fork:
        return
    first = next(r for r in fork if r["row"] == "greedy") if greedy else fork[0]
    print(
        f"\ntime per token at batch {first['batch']} ({first['row']}): "
        f"{1000 * first['seconds'] / args.new_tokens:.2f} ms with the cache, {1000 * uncached:.2f} ms without "
        "(one full forward over the prefix)"
    )
    firsts = [f"{r['row']} {r['batch']}: {r['first_call_s']:.1f} s" for r in fork + hf]
    print("first call, the warm-up (compiles, graph captures, autotuning): " + "; ".join(firsts))
    print_prefills(fork, args)


def print_prefills(fork, args) -> None:
    """The fork rows' prefill (the prompts' forward, the scores of their tokens): the first call's (the compiled
    rows' compile) and the best later call's, within the rows' times above."""
    print("\n| batch | fork rows | prefill ms, later calls | prompt tokens/s | prefill first call s |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in sorted(fork, key=lambda r: (r["batch"], ROWS.index(r["row"]))):
        rate = r["batch"] * (args.prompt_len + 1) / r["prefill_s"]
        print(
            f"| {r['batch']} | {r['row']} | {1000 * r['prefill_s']:,.2f} | {rate:,.0f} | {r['prefill_first_s']:.2f} |"
        )


def print_transformers(fork, hf, greedy, args) -> None:
    """The fork's greedy rows (uncompiled and compiled step) beside transformers' paths, one run, same prompts."""
    rate = {(r["row"], r["batch"]): r["tokens_per_s"] for r in fork}
    print(
        "\n| batch | fork greedy tokens/s | fork greedy-compiled | transformers default | transformers static "
        "cache | fork / best transformers (greedy, compiled) | identical rows (default, static) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, tokens in greedy.items():
        theirs = {r["row"]: r for r in hf if r["batch"] == batch}
        best = max(r["tokens_per_s"] for r in theirs.values())
        ours = [rate.get((row, batch)) for row in ("greedy", "greedy-compiled")]
        cells = [f"{r:,.0f}" if r else "-" for r in ours]
        cells += [f"{theirs[k]['tokens_per_s']:,.0f}" if k in theirs else "-" for k in ("default", "static")]
        ratios = ", ".join(f"{r / best:.2f}x" if r else "-" for r in ours)
        same = [
            f"{int((theirs[k]['tokens'] == tokens).all(dim=1).sum())}/{batch}" if k in theirs else "-"
            for k in ("default", "static")
        ]
        print(f"| {batch} | {' | '.join(cells)} | {ratios} | {', '.join(same)} |")
    compiled = "compiled by transformers (reduce-overhead)" if args.device.startswith("cuda") else "uncompiled"
    print(f"\ntransformers static cache: {compiled}")


def main(argv=None):
    args = get_parser().parse_args(argv)
    device = args.device
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        get_parser().error(f"--rows {','.join(unknown)}: choose from {', '.join(ROWS)}")
    dictionary, cfg, model = build(args)
    model.to(device)
    hf_model = None
    tmp = tempfile.TemporaryDirectory()
    if not args.no_transformers and "greedy" in rows:
        import transformers

        out = export_to_transformers(model.cpu(), cfg, dictionary, tmp.name, args.dtype)
        model.to(device)
        hf_model = (
            transformers.AutoModelForCausalLM.from_pretrained(out, dtype=DTYPES[args.dtype], attn_implementation="sdpa")
            .to(device)
            .eval()
        )
    g = torch.Generator().manual_seed(args.seed)
    prompts_by_batch = {
        batch: torch.randint(dictionary.nspecial, len(dictionary), (batch, args.prompt_len), generator=g).to(device)
        for batch in (int(b) for b in args.batch_sizes.split(","))
    }
    bandwidth = copy_bandwidth(device, args.copy_mib)
    if device.startswith("cuda"):  # as fairseq-generate loads a model: one q/k/v GEMM per layer call
        fuse_qkv_(model)
    skipped = {}
    int8 = any(r in INT8_ROWS for r in rows) and int8_reason(args, device)
    if int8:
        skipped["int8"] = int8
    args.attention_kernel = decode_attention_available(model_probe(model))
    if "greedy-sdpa" in rows and not args.attention_kernel:
        skipped["greedy-sdpa"] = (
            "the split-KV decode attention kernel runs on CUDA with Triton only (or is "
            "turned off): the greedy row is SDPA already"
        )
    fork = fork_rows(
        model, dictionary, prompts_by_batch, args, device, [r for r in rows if r not in INT8_ROWS and r not in skipped]
    )

    def run_of(prompts, row, new):
        return fork_generate(model, dictionary, prompts, args, row, new_tokens=new)

    profiled = profile_rows(model, run_of, prompts_by_batch, args, device) if args.profile else []
    hf = hf_rows(hf_model, prompts_by_batch, args, device, dictionary.eos()) if hf_model is not None else []
    del hf_model
    uncached = uncached_step_time(model, dictionary, args, device)
    if any(r in INT8_ROWS for r in rows) and not int8:  # last: in place
        quantize_for_generation(model, "int8-weight-only", torch.device(device))
        fork += fork_rows(model, dictionary, prompts_by_batch, args, device, [r for r in rows if r in INT8_ROWS])
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print_tables(fork, hf, args, bandwidth, uncached, name, skipped)
    matmuls = (
        [] if args.no_int8_matmuls or args.dtype != "bf16" else int8_matmul_rows(model, prompts_by_batch, args, device)
    )
    if matmuls:
        print_int8_matmuls(matmuls)
    launch_shapes = [
        {"rows": k[0], "n": k[1], "k": k[2], "bias": k[4], **c._asdict()} for k, c in tuned_configs().items()
    ]
    if launch_shapes:
        print(
            "\nint8 launch shapes timed (row bucket, N x K, bias: shape): "
            + "; ".join(
                f"{c['rows']}, {c['n']} x {c['k']}, {c['bias']}: {'GEMV' if c['gemv'] else 'dot'} {c['block_n']}x"
                f"{c['block_k']} split-K {c['split_k']} {c['num_warps']} warps"
                for c in launch_shapes
            )
        )
    attention = [] if args.no_attention_calls else attention_call_rows(model, list(prompts_by_batch), args, device)
    if attention:
        print_attention_calls(attention)
    if profiled:
        print_profile(profiled, device)
    if args.json:
        save_json(
            args,
            fork + hf,
            copy_bytes_per_s=bandwidth,
            uncached_step_s=uncached,
            device=name,
            skipped=skipped,
            int8_matmuls=matmuls,
            int8_launch_shapes=launch_shapes,
            attention_calls=attention,
            profile=profiled,
        )
    tmp.cleanup()


def save_json(args, rows, **results) -> None:
    with open(args.json, "w") as f:
        json.dump(
            {"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows], **results},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
