"""The front ends: the command-line parsers (`options`), the YAML configs of fairseq-hydra-train (`hydra`) and
`validate(cfg)`, which collects every component's flag checks. They sit above the training layer, below the
entry points (fairseq_cli/), so they may import any component they check (docs/ARCHITECTURE.md)."""
