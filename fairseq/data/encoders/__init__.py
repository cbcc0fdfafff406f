"""Text encoders: BPE schemes (`--bpe`) and tokenizers (`--tokenizer`), named as upstream fairseq names them.

    from fairseq.data.encoders import build_bpe
    bpe = build_bpe("gpt2")                      # a name: the scheme's config with its defaults
    bpe = build_bpe(GPT2BPEConfig(gpt2_encoder_json="gpt2_bpe/encoder.json", gpt2_vocab_bpe="gpt2_bpe/vocab.bpe"))
    bpe = build_bpe(args)                        # an argparse namespace with `bpe` and the scheme's flags
    bpe = build_bpe({"_name": "gpt2", "gpt2_encoder_json": ..., "gpt2_vocab_bpe": ...})   # or a DictConfig
    bpe.encode("Hello world") -> "15496 995";   bpe.decode("15496 995") -> "Hello world"

Every scheme registers a config dataclass whose fields are its flags (`gpt2_encoder_json` ->
`--gpt2-encoder-json`), so `fairseq.dataclass.utils.add_dataclass_to_parser(parser,
BPE_REGISTRY.dataclass(name))` adds exactly upstream's flags for the chosen scheme.

Schemes: `gpt2`, `sentencepiece`, `bytes`, `characters`; tokenizers: `space`, `nltk`. The modules are
imported the first time a registry is read.
"""

import dataclasses
from collections.abc import Mapping

# The registries live with the others (fairseq.registry), below the config builder that reads them.
from fairseq.registry import BPE_REGISTRY, TOKENIZER_REGISTRY, EncoderRegistry, config_name


register_bpe = BPE_REGISTRY.register
register_tokenizer = TOKENIZER_REGISTRY.register


def _field(cfg, name, default=None):
    """A field of a mapping (a dict or an omegaconf DictConfig, both Mappings) by key, of anything else by
    attribute."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _build(registry: EncoderRegistry, attr: str, cfg, *extra_args):
    """Upstream's `build_x(cfg)`: None or an unset choice gives None, else the component built from its
    config dataclass filled from `cfg` (a name, a config dataclass, a dict/DictConfig with `_name`, or a
    namespace whose attribute `attr` names the choice)."""
    if cfg is None:
        return None
    if isinstance(cfg, str):
        name, source = cfg, None
    elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) and not hasattr(cfg, attr):
        name, source = config_name(cfg) or registry.name_of_config(cfg), cfg
    elif isinstance(cfg, Mapping):
        name, source = _field(cfg, "_name"), cfg
        if name is None and _field(cfg, attr) is not None:
            return _build(registry, attr, _field(cfg, attr), *extra_args)
    else:  # an argparse namespace (or a parent config holding the choice)
        choice = getattr(cfg, attr, None)
        if choice is not None and not isinstance(choice, str):
            return _build(registry, attr, choice, *extra_args)  # a nested config
        name, source = choice, cfg
    if name is None or name == "none":
        return None
    cls = registry.get(name)
    dc = registry.dataclass(name)
    if dc is None:
        return cls(source, *extra_args)
    if not isinstance(source, dc):
        values = {}
        if source is not None:
            for f in dataclasses.fields(dc):
                if f.init and not f.name.startswith("_"):
                    value = _field(source, f.name, dataclasses.MISSING)
                    if value is not dataclasses.MISSING:
                        values[f.name] = value
        source = dc(**values)
    if hasattr(source, "_name"):
        source._name = name
    return cls(source, *extra_args)


def build_bpe(cfg, *extra_args):
    """The `--bpe` scheme that `cfg` selects, or None."""
    return _build(BPE_REGISTRY, "bpe", cfg, *extra_args)


def build_tokenizer(cfg, *extra_args):
    """The `--tokenizer` that `cfg` selects, or None."""
    return _build(TOKENIZER_REGISTRY, "tokenizer", cfg, *extra_args)


__all__ = ["BPE_REGISTRY", "TOKENIZER_REGISTRY", "register_bpe", "register_tokenizer", "build_bpe", "build_tokenizer"]
