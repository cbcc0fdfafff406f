"""fairseq-preprocess: build (or reuse) a dictionary and binarize text for language modeling.

Writes `DESTDIR/dict.txt`, `DESTDIR/{train,valid,valid1,...,test,...}.{bin,idx}` and appends its log
lines to `DESTDIR/preprocess.log`, as upstream fairseq does. Only source-side data (`--only-source`)
is supported: this fork is for language models.
"""

import contextlib
import glob
import logging
import os
import sys
from argparse import Namespace
from typing import List, Optional

from fairseq.frontend import options
from fairseq.dataclass.configs import PreprocessConfig
from fairseq.dataclass.notices import announce_compat_options
from fairseq.dataclass.utils import config_from_namespace, flag_name
from fairseq.upstream_absent import refused_options

from fairseq.preprocessing import binarizer
from fairseq.checkpoint.io import os_error_message
from fairseq.data import Dictionary
from fairseq.data.encoders import BPE_REGISTRY, build_bpe
from fairseq.data.encoders._script_io import interrupted_exit, stopping_on_signals
from fairseq.data.indexed_dataset import data_file_path
from fairseq.data.jsonl_corpus import CorpusError, find_corpora, open_shard, parse_document
from fairseq.registry import import_user_module

logger = logging.getLogger("fairseq_cli.preprocess")


class PreprocessError(ValueError):
    """Bad flags or inputs; the message says which and what to do."""


def _input_path(prefix: str, lang: Optional[str]) -> str:
    return prefix + (f".{lang}" if lang else "")


def _dest_prefix(args: Namespace, split: str, lang: Optional[str]) -> str:
    # Upstream's names: `train` for plain LM data, `train.SRC-TGT.LANG` when a language is given.
    suffix = f".{args.source_lang}-{args.target_lang}.{lang}" if lang else ""
    return os.path.join(args.destdir, split + suffix)


def _dict_path(args: Namespace, lang: Optional[str]) -> str:
    return os.path.join(args.destdir, f"dict.{lang}.txt" if lang else "dict.txt")


def _splits(args: Namespace, lang: Optional[str]) -> List[tuple]:
    """(input file, output prefix) for every split to binarize, in upstream's order."""
    out = []
    if args.trainpref:
        out.append((_input_path(args.trainpref, lang), _dest_prefix(args, "train", lang)))
    for flag, name in ((args.validpref, "valid"), (args.testpref, "test")):
        if flag:
            for k, prefix in enumerate(flag.split(",")):
                out.append((_input_path(prefix, lang), _dest_prefix(args, f"{name}{k}" if k else name, lang)))
    return out


def check_args(args: Namespace) -> None:
    if not args.only_source:
        raise PreprocessError(
            "fairseq-preprocess: only language-modeling data is supported here; pass --only-source "
            "(translation pairs with --target-lang are not)"
        )
    if args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: must be at least 1")
    if args.padding_factor < 1:
        raise PreprocessError(f"--padding-factor {args.padding_factor}: must be at least 1")
    if args.dataset_impl not in (None, "mmap"):
        raise PreprocessError(f"--dataset-impl {args.dataset_impl}: only 'mmap' is supported")
    for name, is_set, fix in refused_options("preprocess"):
        value = getattr(args, name, None)
        if value is not None and is_set(value):
            raise PreprocessError(f"{flag_name(name)} {value}: not supported by this fairseq: {fix}")
    if args.joined_dictionary and args.srcdict and args.tgtdict:
        raise PreprocessError("--joined-dictionary takes one dictionary: pass --srcdict or --tgtdict, not both")
    given_dict = _given_dictionary(args)
    if not given_dict and not args.trainpref:
        raise PreprocessError("--trainpref is required to build a dictionary (or pass an existing one with --srcdict)")
    if given_dict and not os.path.isfile(given_dict):
        raise PreprocessError(f"{'--srcdict' if args.srcdict else '--tgtdict'} {given_dict}: file does not exist")
    lang = args.source_lang
    inputs = [] if args.dict_only else [path for path, _ in _splits(args, lang)]
    if not given_dict:
        inputs[:0] = _dictionary_inputs(args)
    for path in inputs:
        if not os.path.isfile(path):
            raise PreprocessError(f"input file {path} does not exist (check --trainpref/--validpref/--testpref)")


def _given_dictionary(args: Namespace) -> Optional[str]:
    """--srcdict, or with --joined-dictionary --tgtdict (upstream's rule for the one dictionary)."""
    return args.srcdict or (args.tgtdict if args.joined_dictionary else None)


def _dictionary_inputs(args: Namespace) -> List[str]:
    """The train files the dictionary is built from: the source's, with --joined-dictionary the target's too."""
    langs = [args.source_lang] + ([args.target_lang] if args.joined_dictionary and args.target_lang else [])
    return list(dict.fromkeys(_input_path(args.trainpref, lang) for lang in langs))


def _announce_upstream_options(args: Namespace) -> None:
    """One line per upstream option accepted without an effect here (upstream_absent.ACCEPTED_OPTIONS)."""
    announce_compat_options(preprocess=config_from_namespace(PreprocessConfig, args))


def _bpe_spec(args: Namespace):
    """Build the --bpe scheme (errors for missing/malformed files come here, before any output) and make it
    available to the binarizer and its workers; None without --bpe."""
    if not args.bpe:
        return None
    dc = BPE_REGISTRY.dataclass(args.bpe)
    if dc is None:  # a scheme without options (bytes, characters)
        bpe = build_bpe(args.bpe)
        spec = (args.bpe, ())
        binarizer.register_line_encoder(spec, bpe)
        return spec
    cfg = config_from_namespace(dc, args, args.bpe)
    if args.bpe == "sentencepiece" and cfg.sentencepiece_enable_sampling:  # that scheme's own option
        raise PreprocessError(
            "--sentencepiece-enable-sampling: sampled encodings differ from run to run; "
            "fairseq-preprocess --bpe sentencepiece encodes deterministically (drop the flag)"
        )
    bpe = build_bpe(cfg)
    spec = binarizer.bpe_spec(cfg)
    binarizer.register_line_encoder(spec, bpe)
    return spec


def main(args: Namespace) -> None:
    if args.user_dir:
        import_user_module(args.user_dir)
    if args.json_key:
        with _writing(args.destdir):
            os.makedirs(args.destdir, exist_ok=True)
        try:
            _text_from_jsonl(args)
            main(Namespace(**dict(vars(args), json_key=None)))
        finally:
            _remove_own_temporaries(args.destdir)
        return
    check_args(args)
    _announce_upstream_options(args)
    if args.tokenizer:
        logger.warning(
            f"--tokenizer {args.tokenizer} is accepted for upstream compatibility and not applied by "
            "fairseq-preprocess (as upstream); tokenize the text first"
        )
    spec = _bpe_spec(args)  # before the pool forks: the workers inherit the encoder
    with _writing(args.destdir):
        os.makedirs(args.destdir, exist_ok=True)
        log_handler = logging.FileHandler(os.path.join(args.destdir, "preprocess.log"), encoding="utf-8")
    logger.addHandler(log_handler)
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:  # preprocess.log always gets the INFO lines
        logger.setLevel(logging.INFO)
    pool = None
    try:
        logger.info(args)  # first, as upstream: its log is never empty, even when a Ctrl-C comes next
        if args.workers > 1:  # seconds (the workers' forkserver imports torch): an interrupt here ends the run too
            pool = binarizer.make_pool(args.workers - 1, preload=(binarizer.__name__,))
        _run(args, pool, spec)
        if pool is not None:
            pool.close()
    except BaseException:
        if pool is not None:
            pool.terminate()
            pool.join()
        _remove_own_temporaries(args.destdir)
        raise
    finally:
        if pool is not None:
            pool.join()
        logger.setLevel(old_level)
        logger.removeHandler(log_handler)
        log_handler.close()


def _text_from_jsonl(args: Namespace) -> None:
    """--json-key: each --trainpref/--validpref/--testpref (a JSONL file, or a split directory of corpora read in
    the streaming task's order) becomes a hidden text file in DESTDIR with the items the streaming task makes
    of it: each document's lines, then an empty line (the end of a document). The prefixes then name those."""
    for flag in ("trainpref", "validpref", "testpref"):
        value = getattr(args, flag)
        if not value:
            continue
        texts = []
        for k, source in enumerate(value.split(",")):
            files = [f for fs in find_corpora(source).values() for f in fs] if os.path.isdir(source) else [source]
            text = os.path.join(args.destdir, f".{flag}{k}.{os.getpid()}.jsonl.txt")
            try:
                with _writing(text), open(text, "w", encoding="utf-8") as out:
                    for path in files:
                        if not os.path.isfile(path):
                            raise PreprocessError(f"--{flag} {path}: no such JSONL file (--json-key reads JSONL)")
                        with open_shard(path) as lines:
                            for lineno, raw in enumerate(lines, 1):
                                if raw.strip():
                                    doc = parse_document(raw.rstrip(b"\r\n"), args.json_key, path, lineno)
                                    out.write("".join(line + "\n" for line in doc) + "\n" if doc else "")
            except CorpusError as e:
                raise PreprocessError(
                    str(e).replace(", or pass --skip-invalid-documents to skip such lines", "")
                ) from None
            logger.info(
                f"--{flag} {source}: {len(files)} JSONL file(s) read as {os.path.basename(text)} "
                f"(--json-key {args.json_key})"
            )
            texts.append(text)
        setattr(args, flag, ",".join(texts))


def _remove_own_temporaries(destdir: str) -> None:
    """This run's hidden files in `destdir` (`.NAME.PID.*`: parts, caches), whatever step was cut short."""
    for path in glob.glob(os.path.join(glob.escape(destdir), f".*.{os.getpid()}.*")):
        with contextlib.suppress(OSError):
            os.remove(path)


@contextlib.contextmanager
def _writing(path: str):
    """Name `path` in an OSError of a write that does not name its file (or names a hidden temporary)."""
    try:
        yield
    except OSError as err:
        if err.filename is not None and not os.path.basename(str(err.filename)).startswith("."):
            raise
        raise OSError(err.errno, err.strerror or str(err), path) from None


def _run(args: Namespace, pool, spec=None) -> None:
    caches: list = []  # --bpe while building the dictionary: the train split encoded once, cached for binarizing
    try:
        _run_splits(args, pool, spec, caches)
    finally:
        for cache in caches:
            binarizer.remove_cache(cache)


def _run_splits(args: Namespace, pool, spec, caches: list) -> None:
    lang = args.source_lang
    train_path = _input_path(args.trainpref, lang) if args.trainpref else None
    vocab = _dictionary(args, pool, spec, caches, train_path)
    dict_path = _dict_path(args, lang)
    tmp = os.path.join(args.destdir, f".{os.path.basename(dict_path)}.{os.getpid()}.part")
    with _writing(dict_path):
        vocab.save(tmp)
        os.replace(tmp, dict_path)
    if not args.dict_only:
        _binarize_splits(args, pool, spec, caches, vocab, train_path)
        logger.info(f"Wrote preprocessed data to {args.destdir}")


def _dictionary(args: Namespace, pool, spec, caches: list, train_path: Optional[str]) -> Dictionary:
    """--srcdict's dictionary, or one built from the train file(s); with --bpe the train split is encoded once
    and cached (`caches`) for binarizing."""
    dictionary_inputs = _dictionary_inputs(args) if args.trainpref else []
    if _given_dictionary(args):
        return Dictionary.load(_given_dictionary(args))
    if spec is not None and len(dictionary_inputs) > 1:
        raise PreprocessError(
            f"--joined-dictionary with --bpe builds the dictionary from one train file; encode "
            f"{' and '.join(dictionary_inputs)} into one and pass it as --trainpref"
        )
    counting = dict(
        num_workers=args.workers,
        threshold=args.thresholdsrc,
        nwords=args.nwordssrc,
        padding_factor=args.padding_factor,
        pool=pool,
    )
    if spec is None:
        return binarizer.build_dictionary(dictionary_inputs, **counting)
    stem = os.path.join(args.destdir, f".encoded.{os.getpid()}")
    vocab, cached = binarizer.build_dictionary_encoded(train_path, spec, stem, **counting)
    caches.extend(cached)
    return vocab


def _binarize_splits(args: Namespace, pool, spec, caches: list, vocab: Dictionary, train_path: Optional[str]) -> None:
    """Each split's .bin/.idx, with a line per split; with --bpe and --srcdict, one warning for the tokens the
    encoder produced that the dictionary lacks."""
    lang = args.source_lang
    replaced = []
    for input_file, out_prefix in _splits(args, lang):
        logger.info(f"[{lang}] Dictionary: {len(vocab)} types")
        with _writing(data_file_path(out_prefix)):
            if spec is None:
                summary = binarizer.binarize_file(input_file, vocab, out_prefix, num_workers=args.workers, pool=pool)
            else:
                use_cache = caches and input_file == train_path and out_prefix == _dest_prefix(args, "train", lang)
                summary = binarizer.binarize_file_encoded(
                    input_file,
                    vocab,
                    out_prefix,
                    spec,
                    pool=pool,
                    num_workers=args.workers,
                    caches=list(caches) if use_cache else None,
                )
        if summary.num_replaced and spec is not None:
            replaced.append(f"{summary.num_replaced} in {input_file}")
        logger.info(f"[{lang}] {input_file}: {summary} (by {vocab.unk_word})")
    if replaced and args.srcdict:
        # Upstream maps them to <unk> silently; say so once, with the count and the fix.
        logger.warning(
            f"--bpe {args.bpe}: the encoder produced tokens that {args.srcdict} does not have; they were mapped "
            f"to {vocab.unk_word} ({', '.join(replaced)}). --srcdict must be the dictionary of this encoder "
            f"(e.g. the dict.txt published with its encoder.json/model), or omit --srcdict to build one from the data"
        )


def parse_args(argv: Optional[List[str]] = None) -> Namespace:
    parser = options.get_preprocessing_parser(default_task="language_modeling")
    return options.parse_args_with_encoders(parser, argv)


def cli_main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=sys.stdout,
    )
    args = parse_args(argv)
    try:
        with stopping_on_signals():  # one Ctrl-C or SIGTERM ends the run (workers too), temporaries removed
            main(args)
    except KeyboardInterrupt as e:
        interrupted_exit("fairseq-preprocess", e)
    except (PreprocessError, FileNotFoundError, ValueError) as e:
        print(f"fairseq-preprocess: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # an unwritable, read-only or full --destdir
        print(
            f"fairseq-preprocess: error: {os_error_message(e.filename or args.destdir, e, flag='--destdir')}",
            file=sys.stderr,
        )
        sys.exit(2)


if __name__ == "__main__":
    cli_main()
