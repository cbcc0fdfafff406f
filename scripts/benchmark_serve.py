#!/usr/bin/env python3
"""fairseq-serve under load: the same requests sent one at a time, then from C concurrent clients; tokens/s,
latency p50/p99 and time to first token p50/p99 per row, and each row's throughput against one at a time.

    python scripts/benchmark_serve.py --concurrency 1,16 --requests 64 --new-tokens 64 --cpu
    python scripts/benchmark_serve.py --path checkpoints/checkpoint_best.pt --data data-bin --concurrency 1,8,64
    python scripts/benchmark_serve.py --bf16 --model-parallel-size 2 --concurrency 1,8,64   # 2 GPUs, TP 2

Without --path, a transformer_lm of random weights (--arch and the dimension flags, seeded) and a dictionary of
--vocab-size words are written to a temporary directory and served. Prompts are random words of 8 to
--prompt-len tokens; every request streams (TTFT: until the first chunk with text) and asks for --new-tokens
tokens, greedy (temperature 0) or, with --sample, top_p 0.9 at temperature 0.8 with a seed per request. A server
process is started per run on a free port of 127.0.0.1 (--cpu: on the CPU; else the GPU if there is one); the
first row (concurrency 1) is the one-at-a-time baseline. The server's own figures (GET /metrics) are not used.
With --model-parallel-size N the server runs over N ranks (--distributed-world-size N: one GPU each, or N CPU
processes with --cpu), rank 0 serving HTTP.
"""

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", help="checkpoint to serve (default: a random-weight model written here)")
    parser.add_argument("--data", help="directory of its dict.txt (DATA of fairseq-serve)")
    parser.add_argument("--arch", default="transformer_lm_gpt", help="architecture of the random model")
    parser.add_argument("--decoder-layers", type=int, default=4)
    parser.add_argument("--decoder-embed-dim", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--positions", type=int, default=512, help="the random model's positions")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated client counts (1 first: baseline)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64, help="longest prompt, in tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample (top_p 0.9, temperature 0.8) instead of greedy")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument(
        "--hub-baseline",
        action="store_true",
        help="also send the same prompts to the hub one at a time (the served model's own generator, no server)",
    )
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--model-parallel-size",
        type=int,
        default=1,
        help="serve over this many ranks (tensor parallelism; the project's launcher, one GPU each)",
    )
    parser.add_argument("--seed", type=int, default=1)
    return parser


def write_random_model(args, directory: str) -> tuple:
    # the clients' side (this process) needs neither torch nor the model
    import torch  # deferred: startup

    from fairseq.checkpoint.io import atomic_torch_save  # deferred: startup
    from fairseq.data.dictionary import Dictionary  # deferred: startup
    from fairseq.dataclass.utils import config_to_dict  # deferred: startup
    from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config  # deferred: startup

    dictionary = Dictionary()
    for i in range(args.vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    dim = args.decoder_embed_dim
    cfg = preset_config(
        args.arch,
        tokens_per_sample=args.positions,
        decoder_layers=args.decoder_layers,
        decoder_embed_dim=dim,
        decoder_ffn_embed_dim=4 * dim,
        decoder_attention_heads=max(dim // 64, 1),
    )
    torch.manual_seed(args.seed)
    model = TransformerLanguageModel.build(cfg, len(dictionary), dictionary.pad())
    path = os.path.join(directory, "checkpoint.pt")
    atomic_torch_save(
        {
            "cfg": {
                "model": config_to_dict(cfg),
                "task": {"_name": "language_modeling", "data": directory, "tokens_per_sample": args.positions},
            },
            "model": model.state_dict(),
        },
        path,
    )
    dictionary.save(os.path.join(directory, "dict.txt"))
    return path, directory, len(dictionary)


def start_server(args, path: str, data: str):
    argv = [sys.executable, "-m", "fairseq_cli.serve", "--port", "0", *server_argv(args, path, data)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("FAIRSEQ_API_KEYS", None)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if match:
            break
    else:
        raise SystemExit("benchmark_serve: error: the server did not start")
    host, port = match.group(1), int(match.group(2))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, host, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("benchmark_serve: error: the model did not load in 300 s")


def one_request(host: str, port: int, body: dict) -> tuple:
    """(latency s, time to first token s, completion tokens) of one streamed request."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"benchmark_serve: error: the server answered {response.status}: {response.read()[:300]}")
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and any(c.get("text") for c in chunk.get("choices", ())):
            first = time.monotonic() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return time.monotonic() - started, first if first is not None else time.monotonic() - started, tokens


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def bodies(args, vocab: int) -> list:
    rng = random.Random(args.seed)
    words = [f"w{i}" for i in range(vocab - 4)]
    out = []
    for i in range(args.requests):
        prompt = " ".join(rng.choices(words, k=rng.randint(8, args.prompt_len)))
        body = {
            "prompt": prompt,
            "max_tokens": args.new_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        if args.sample:
            body.update(temperature=0.8, top_p=0.9, seed=i)
        out.append(body)
    return out


def run_row(host, port, requests: list, clients: int) -> dict:
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda body: one_request(host, port, body), requests))
    return summary(clients, results, time.monotonic() - started)


def summary(clients, results: list, wall: float) -> dict:
    """A row of the table from each request's (latency, time to first token, tokens)."""
    latencies, ttfts, tokens = zip(*results)
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": sum(tokens),
        "wall_s": wall,
        "tokens_per_s": sum(tokens) / wall,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
    }


def server_argv(args, path: str, data: str) -> list:
    """fairseq-serve's arguments for `path` (also how the hub row loads the same model)."""
    argv = [data, "--path", path, "--max-running", str(args.max_running), "--max-queue", str(args.requests + 1)]
    argv += ["--cpu"] if args.cpu else []
    argv += ["--bf16"] if args.bf16 else []
    tp = args.model_parallel_size
    argv += ["--model-parallel-size", str(tp), "--distributed-world-size", str(tp)] if tp > 1 else []
    return argv


def hub_row(args, path: str, data: str, requests: list) -> dict:
    """The same prompts through the served model's hub, one at a time, in this process (what a user of
    from_pretrained gets without the server): the baseline the issue asks the server's rows against."""
    from fairseq.serving.model import generation_options  # deferred: startup (the server rows need none of it)
    from fairseq_cli.serve import load_served_model, serve_config  # deferred: startup

    served = load_served_model(serve_config(server_argv(args, path, data)))

    def alone(i, body):
        """(latency, time to first token, tokens) of request i through the hub, as one_request's."""
        prompt = served.encode(body["prompt"])
        gen = generation_options(body["temperature"], body.get("top_p", 1.0), 0) or {}
        first = []
        begin = time.monotonic()
        hypo = served.sample_alone(
            prompt,
            body["max_tokens"],
            gen,
            body.get("seed", 0),
            i,
            on_tokens=lambda *a: first or first.append(time.monotonic()),
        )
        done = time.monotonic()
        new = served.split_hypothesis(prompt, hypo, body["max_tokens"])[0]
        return done - begin, (first[0] if first else done) - begin, len(new)

    started = time.monotonic()
    results = [alone(i, body) for i, body in enumerate(requests)]
    return summary("hub, 1 at a time", results, time.monotonic() - started)


def main(argv=None) -> list:
    args = get_parser().parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="benchmark-serve-") as directory:
        if args.path:
            path, data, vocab = args.path, args.data or os.path.dirname(args.path), None
        else:
            path, data, vocab = write_random_model(args, directory)
        if vocab is None:
            from fairseq.data.dictionary import Dictionary  # deferred: startup

            vocab = len(Dictionary.load(os.path.join(data, "dict.txt")))
        proc, host, port = start_server(args, path, data)
        try:
            requests = bodies(args, vocab)
            one_request(host, port, dict(requests[0], max_tokens=4))  # warm-up
            rows = [run_row(host, port, requests, clients) for clients in concurrency]
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        if args.hub_baseline:  # after the server has exited: the device is this process's alone
            rows.append(hub_row(args, path, data, requests))
    base = rows[0]["tokens_per_s"]
    print(
        f"| clients | requests | tokens | wall s | tokens/s | vs {rows[0]['clients']} client(s) | latency p50 s | "
        "p99 s | TTFT p50 s | TTFT p99 s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['clients']} | {row['requests']} | {row['tokens']} | {row['wall_s']:.2f} | "
            f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | {row['p50_s']:.3f} | "
            f"{row['p99_s']:.3f} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} |"
        )
    return rows


if __name__ == "__main__":
    main()
