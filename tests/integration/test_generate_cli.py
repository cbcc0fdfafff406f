"""fairseq-generate --task language_modeling through its entry point on a tiny model trained here by
fairseq-train, on the binarized test split: upstream's S-/T-/H-/D-/P- lines, greedy hypotheses equal to the
argmax of full forwards, --prefix-size prompts, a sharded checkpoint directory and bf16; bad input is one line
naming the flag."""

import math
import re

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq.checkpoint import sharded
from fairseq.utils import run_console_script
from fairseq_cli import generate

from tests.unit.test_hub_utils import greedy_by_full_forwards

LINE = re.compile(r"^([STHDP])-(\d+)\t(.*)$")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


@pytest.fixture(scope="module")
def ckpt(tiny_lm_checkpoint):
    return tiny_lm_checkpoint


def argv(tiny_data, path, *extra):
    # one sentence per sample (--sample-break-mode eos), each shorter than the model's 32 positions
    return [
        str(tiny_data),
        "--task",
        "language_modeling",
        "--path",
        str(path),
        "--cpu",
        "--gen-subset",
        "test",
        "--tokens-per-sample",
        "32",
        "--sample-break-mode",
        "eos",
        "--batch-size",
        "40",
        "--num-workers",
        "0",
        *map(str, extra),
    ]


def run(capsys, args):
    """(exit status, stdout, stderr) of fairseq-generate's console entry point."""
    capsys.readouterr()
    try:
        run_console_script("fairseq-generate", generate.cli_main, args)
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def parse(stdout):
    """{id: {"S": fields, "T": fields, "H": [fields, ...], "D": [...], "P": [...]}}, checking each id's order."""
    samples = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            kind, i, fields = m.group(1), int(m.group(2)), m.group(3).split("\t")
            samples.setdefault(i, []).append((kind, fields))
    out = {}
    for i, rows in samples.items():
        kinds = [kind for kind, _ in rows]
        assert kinds[:2] == ["S", "T"] and kinds[2:] == ["H", "D", "P"] * ((len(kinds) - 2) // 3), (i, kinds)
        out[i] = {
            "S": rows[0][1],
            "T": rows[1][1],
            "H": [f for k, f in rows if k == "H"],
            "D": [f for k, f in rows if k == "D"],
            "P": [f for k, f in rows if k == "P"],
        }
    return out


def test_prefix_prompts_greedy_equals_argmax_of_full_forwards(tiny_data, ckpt, capsys):
    status, out, _ = run(capsys, argv(tiny_data, ckpt, "--prefix-size", 3, "--beam", 1, "--max-len-b", 8))
    assert status == 0
    samples = parse(out)
    assert sorted(samples) == list(range(40))  # every sentence of the split, once
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt)], arg_overrides={"data": str(tiny_data)}
    )
    d = task.target_dictionary
    for i in range(8):
        sample = samples[i]
        assert sample["S"] == sample["T"]  # the source is the sentence shifted right: the same words
        prompt = [d.index(w) for w in sample["T"][0].split()[:3]]
        expected = greedy_by_full_forwards(model, prompt, 8, d.eos(), d.pad())
        ((score, tokens),) = sample["H"]
        assert tokens == d.string(torch.tensor(expected)) == sample["D"][0][1]
        positional = [float(x) for x in sample["P"][0][0].split()]
        assert len(positional) == len(expected)  # one per token, </s> included
        # the score is the per-token mean (--lenpen 1) of the positional scores, all in base 2
        assert float(score) == pytest.approx(sum(positional) / len(positional), abs=1e-3)
        # positional scores are the model's log-probabilities of the tokens given the ones before
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([[d.eos()] + expected[:-1]]))[0][0], dim=-1)
        chosen = log_probs.gather(1, torch.tensor(expected)[:, None]).squeeze(1) / math.log(2)
        assert positional == pytest.approx(chosen.tolist(), abs=1e-4)


def test_whole_sample_as_prompt_nbest_and_results_path(tiny_data, ckpt, capsys, tmp_path):
    # --prefix-size 0 (upstream's default): the prompt is the whole sample but its last token
    status, out, _ = run(
        capsys,
        argv(
            tiny_data, ckpt, "--beam", 3, "--nbest", 2, "--max-len-a", 1, "--max-len-b", 3, "--results-path", tmp_path
        ),
    )
    assert status == 0 and not parse(out)
    samples = parse((tmp_path / "generate-test.txt").read_text(encoding="utf-8"))
    assert len(samples) == 40
    for sample in samples.values():
        assert len(sample["H"]) == 2
        scores = [float(h[0]) for h in sample["H"]]
        assert scores == sorted(scores, reverse=True)
        source = sample["S"][0].split()
        for _, tokens in sample["H"]:
            assert tokens.split()[: len(source)] == source
    status, out, _ = run(capsys, argv(tiny_data, ckpt, "--beam", 1, "--max-len-a", 1, "--max-len-b", 3, "--quiet"))
    assert status == 0 and not parse(out)


def test_sharded_directory_ensemble_and_bf16(tiny_data, ckpt, capsys, tmp_path):
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    directory = tmp_path / "checkpoint_last"
    # one rank's DCP directory, written as the checkpoint writer writes it
    write = sharded.sharded_write(str(directory), {"model": dict(state["model"])}, {"cfg": state["cfg"]})
    write.bytes()
    write.publish()
    flags = ("--prefix-size", 2, "--beam", 2, "--max-len-b", 6)
    _, from_file, _ = run(capsys, argv(tiny_data, ckpt, *flags))
    status, from_directory, _ = run(capsys, argv(tiny_data, directory, *flags))
    assert status == 0 and parse(from_directory) == parse(from_file)
    # an ensemble of the same model twice: probabilities averaged, so the same hypotheses and scores
    status, ensemble, _ = run(capsys, argv(tiny_data, f"{ckpt}:{directory}", *flags))
    assert status == 0
    for i, sample in parse(ensemble).items():
        expected = parse(from_file)[i]
        assert [h[1] for h in sample["H"]] == [h[1] for h in expected["H"]]
        assert [float(h[0]) for h in sample["H"]] == pytest.approx([float(h[0]) for h in expected["H"]], abs=1e-4)
    status, bf16, _ = run(capsys, argv(tiny_data, ckpt, "--bf16", *flags))
    assert status == 0
    for i, sample in parse(bf16).items():  # the forced prompt is the same; its scores within bf16's precision
        expected = parse(from_file)[i]
        assert sample["H"][0][1].split()[:2] == expected["H"][0][1].split()[:2]
        got, want = (sample["P"][0][0].split()[:2], expected["P"][0][0].split()[:2])
        assert [float(x) for x in got] == pytest.approx([float(x) for x in want], abs=0.15)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", [[], ["--fp16"], ["--bf16"]])
def test_on_the_gpu(tiny_data, ckpt, capsys, precision):
    flags = ("--prefix-size", 2, "--beam", 2, "--max-len-b", 6)
    _, on_cpu, _ = run(capsys, argv(tiny_data, ckpt, *flags))
    status, on_gpu, err = run(capsys, [a for a in argv(tiny_data, ckpt, *flags, *precision) if a != "--cpu"])
    assert status == 0, err
    cpu, gpu = parse(on_cpu), parse(on_gpu)
    assert sorted(gpu) == sorted(cpu)
    for i, sample in gpu.items():
        assert sample["T"] == cpu[i]["T"]
        best, reference = sample["H"][0], cpu[i]["H"][0]
        assert best[1].split()[:2] == reference[1].split()[:2]  # the forced prompt
        if not precision:  # fp32 (no TF32 by default): the same search, scores to rounding
            assert [h[1] for h in sample["H"]] == [h[1] for h in cpu[i]["H"]]
            assert float(best[0]) == pytest.approx(float(reference[0]), abs=1e-4)
        else:  # the prompt's scores within half precision's
            got, want = sample["P"][0][0].split()[:2], cpu[i]["P"][0][0].split()[:2]
            assert [float(x) for x in got] == pytest.approx([float(x) for x in want], abs=0.15)


@pytest.mark.parametrize(
    "extra, status, message",
    [
        (
            ["--tokens-per-sample", 1024, "--sample-break-mode", "none"],
            1,
            "the model's 32 positions (the --tokens-per-sample / --max-target-positions it was trained with): pass "
            "--tokens-per-sample 31 or less, or --prefix-size N",
        ),
        (["--beam", 2, "--sampling"], 2, "--sampling requires --nbest to be equal to --beam"),
        (["--nbest", 3, "--beam", 2], 2, "--nbest 3 is larger than --beam 2"),
        (["--model-overrides", "{'decoder_layers': 3}"], 1, "was saved from a different architecture"),
        (["--lr", 0.1], 2, "unrecognized arguments: --lr 0.1"),
        (["--stream", "--beam", 1], 2, "--stream is fairseq-interactive's, with --beam 1"),
        (["--seed", -1], 1, "--seed -1 is out of range: an integer from 0 to 2**32 - 1"),
    ],
)
def test_bad_input_is_one_line(tiny_data, ckpt, capsys, extra, status, message):
    got, _, err = run(capsys, argv(tiny_data, ckpt, *extra))
    assert got == status and "Traceback" not in err
    assert err.strip().count("\n") == 0 and ": error: " in err and message in err  # usage errors too: one line


def test_prompt_longer_than_the_output_allowed_is_cut_as_upstream_cuts_it(tiny_data, ckpt, capsys, caplog):
    """Upstream's generator forces a prompt until the output is max_len long, then ends it: the output is the
    prompt's first max_len tokens (upstream's LM tests generate with --max-len-b 5 from whole lines); said once."""
    status, out, _ = run(capsys, argv(tiny_data, ckpt, "--prefix-size", 3, "--max-len-b", 2, "--beam", 2))
    assert status == 0
    samples = parse(out)
    assert samples and all(len(sample["H"][0][1].split()) == 2 for sample in samples.values())
    for sample in samples.values():
        assert sample["H"][0][1].split() == sample["S"][0].split()[:2]
    warnings = [r.getMessage() for r in caplog.records if "longer than the longest output allowed" in r.getMessage()]
    assert (
        len(warnings) == 1
        and warnings[0].startswith("a prompt of 3 tokens is longer than the longest output allowed, 2 tokens")
        and "raise --max-len-b" in warnings[0]
    )


def test_missing_inputs(tiny_data, tmp_path, capsys):
    status, _, err = run(capsys, argv(tiny_data, tmp_path / "nope.pt"))
    assert status == 1 and err.strip() == (
        f"fairseq-generate: error: --path {tmp_path / 'nope.pt'}: no such "
        "checkpoint file or sharded checkpoint directory"
    )
    status, _, err = run(capsys, ["--task", "language_modeling", "--path", str(tmp_path / "nope.pt")])
    assert status == 1 and "pass the data directory (DATA)" in err


def test_text_only_prints_the_decoded_hypotheses_alone(tiny_data, ckpt, capsys):
    flags = ("--prefix-size", 2, "--beam", 3, "--nbest", 2, "--max-len-b", 6, "--batch-size", 7)
    status, full, _ = run(capsys, argv(tiny_data, ckpt, *flags))
    assert status == 0
    status, text, _ = run(capsys, argv(tiny_data, ckpt, *flags, "--text-only"))
    assert status == 0
    # one line per hypothesis, in upstream's order (samples as batched, each one's hypotheses best first)
    decoded = [line.split("\t")[2] for line in full.splitlines() if line.startswith("D-")]
    assert text.splitlines() == decoded and len(decoded) == 2 * 40
