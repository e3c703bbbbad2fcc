"""The family tests import the toy family's two modules by name (here and in spawned workers) and run their
worlds with the multi-process helper of tests/parallel/."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "parallel")]
