"""The argument parser of every command line (the front ends' parsers and the memory planner's): one-line usage
errors and the closest real flag or choice for a misspelt one."""

import argparse
from typing import List

from fairseq.suggest import close_flag, did_you_mean


class FairseqArgumentParser(argparse.ArgumentParser):
    """argparse's parser with short usage errors: the one line `PROG: error: MESSAGE` (status 2) instead of the
    whole usage first (~100 lines here), and the closest real flag or choice for a misspelt one."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(self._unrecognized(extra))
        return args

    def _unrecognized(self, extra: List[str]) -> str:
        message = f"unrecognized arguments: {' '.join(extra)}"
        if "--quantize" in extra:  # a generation flag given to a command that trains or evaluates
            return (
                f"{message} (--quantize is a generation option: fairseq-generate, fairseq-interactive and the "
                "hub quantize a trained model's weights when they load it for generation; this command does "
                "not: drop it)"
            )
        flags = [a for a in extra if a.startswith("-") and not _is_number(a)]
        hints = [(flag, close_flag(flag, self._option_string_actions)) for flag in flags]
        hints = [(flag, match) for flag, match in hints if match is not None]
        if len(hints) == 1:
            return f"{message} (did you mean {hints[0][1]}?)"
        if hints:
            return f"{message} (did you mean {', '.join(f'{m} for {f}' for f, m in hints)}?)"
        return f"{message}; `{self.prog} --help` lists the options"

    def _check_value(self, action, value):  # argparse's hook for choices
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(value, action.choices)}; choose from {choices}"
            )

    def format_help(self):
        # The usage line names the positional arguments only: --help lists every flag once, below it.
        positionals = [
            f"[{a.metavar or a.dest}]" if a.nargs == "?" else (a.metavar or a.dest)
            for a in self._get_positional_actions()
            if a.help is not argparse.SUPPRESS
        ]
        usage, self.usage = self.usage, self.usage or " ".join(["%(prog)s [options]"] + positionals)
        try:
            return super().format_help()
        finally:
            self.usage = usage


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
