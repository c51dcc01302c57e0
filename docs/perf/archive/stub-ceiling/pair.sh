#!/bin/sh
# one run of the stub ceiling on tree $1, its JSON line appended to $2
cd "$1" && PYTHONPATH="$1" ROUNDS=2 exec "$1/.venv/bin/python" /work/msb/ceiling.py >> "$2" 2>/dev/null
