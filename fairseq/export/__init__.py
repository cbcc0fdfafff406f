"""Exporting trained models to other libraries' formats and back (`fairseq.export.hf`, `fairseq.export.hf_import`:
Hugging Face transformers). `require_transformers` is the one check, for both ways, that the export extra is
installed (a one-line install hint instead of an ImportError from deep inside)."""


def require_transformers(what: str = "exporting to transformers") -> None:
    try:
        import transformers  # noqa: F401  # deferred: optional (the export extra)
        import safetensors  # noqa: F401  # deferred: optional (the export extra)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the transformers and safetensors packages ({e}); "
            "install them with: pip install 'fairseq[export]'"
        ) from None
