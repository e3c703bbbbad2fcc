from meshlm.cli import run

run()
