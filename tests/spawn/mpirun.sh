#!/usr/bin/env bash
# mpirun for tests and scripts: OpenMPI's mpiexec with the flags a test machine
# needs (more processes than cores, no core binding; --allow-run-as-root when
# run as root, e.g. in a container), then the arguments. MPIEXEC overrides the
# launcher. Shared-memory single copy is off: containers often forbid the ptrace
# (CMA) it uses.
set -euo pipefail
launcher="${MPIEXEC:-mpiexec}"
flags=(--oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
if [ "$(id -u)" -eq 0 ]; then flags+=(--allow-run-as-root); fi
exec "$launcher" "${flags[@]}" "$@"
