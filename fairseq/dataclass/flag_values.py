"""Reading flag values written the way upstream writes them, and filling a legacy namespace."""

import ast


def literal_or_none(value):
    """A flag value as upstream writes Python literals ("(0.9, 0.98)", "[20000, 60000]", "False"): the parsed
    literal for a string, None if it is not one; anything else is returned unchanged. Never `eval`s."""
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return None


def fill_missing(args, **defaults) -> None:
    """Set each attribute `args` does not have yet (how upstream's architecture functions fill a namespace)."""
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)
