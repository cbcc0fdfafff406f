"""Distributed training: launch detection (env), process start-up (launch), collective helpers (utils),
and the data-parallel engines (ddp, fsdp).

Import the submodule you need; this package imports nothing itself so that `import fairseq` stays cheap.
"""
