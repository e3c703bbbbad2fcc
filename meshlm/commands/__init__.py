"""The command line, one module per command: its argument parser and a handler that imports its work
lazily from the packages below (`meshlm --help` loads no torch). `meshlm.cli` only assembles them.

May import: every meshlm package (the handlers, lazily); at module level only the standard library and
torch-free `meshlm.core` modules.
"""
