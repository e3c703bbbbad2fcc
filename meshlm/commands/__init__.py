"""The command line, one module per command: its argument parser and a handler that imports its work
lazily from the packages below (`meshlm --help` loads no torch). `meshlm.cli` only assembles them.

The argparse layer ends here: the work below takes typed arguments, a frozen options dataclass that the command
module builds from the parsed flags (`tune_options(args) -> TuneOptions`, ...) or explicit parameters, never the
`argparse.Namespace` (tests/test_typed_handlers.py).

May import: every meshlm package (the handlers, lazily); at module level only the standard library and
torch-free `meshlm.core` modules.
"""
