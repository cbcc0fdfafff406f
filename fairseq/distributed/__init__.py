"""Distributed training: process start-up (launch; the launch environment it reads is fairseq.runtime.env), collective helpers (utils),
and the data-parallel engines (ddp, fsdp).

Import the submodule you need; this package imports nothing itself so that `import fairseq` stays cheap.
"""
