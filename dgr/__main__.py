from dgr.cli import run

run()
