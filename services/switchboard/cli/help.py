"""How every `switchboard` command prints its --help."""

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: ``(default: X)`` from the parser, ``on`` or
    ``off`` for a switch, nothing where the text already says it (a default of None or "" means
    something only words can say) or the option is required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.required
            or not action.option_strings
            or action.default is argparse.SUPPRESS
        ):
            return text
        if action.nargs == 0 and isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"
