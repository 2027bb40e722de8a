# Sourced by the benchmark scripts: sets `python` to $PYTHON, else the first of
# python3 and /usr/bin/python3 that can import the module named in $1 (default
# torch), else "". The caller decides whether a missing one is an error.
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3 /usr/bin/python3; do
    if "$candidate" -c "import ${1:-torch}" 2>/dev/null; then python="$candidate"; break; fi
  done
fi
