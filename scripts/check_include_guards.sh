#!/usr/bin/env bash
# Every header's include guard must match its path: spawn/comm/flight_recorder.h
# -> TANDEM_SPAWN_COMM_FLIGHT_RECORDER_H_ (upper case, '/', '.' and '-' become '_',
# TANDEM_ in front, '_' behind). Checks the #ifndef, the #define after it and the
# closing #endif's comment of every tracked .h and .cuh outside third_party/.
# Prints each file that does not match with the guard expected; exits 1 then.
# Run by scripts/test.sh (and so by .ci/run) before anything is built.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
while IFS= read -r file; do
  expected="TANDEM_$(printf '%s' "$file" | tr '[:lower:]/.-' '[:upper:]___')_"
  # The first #ifndef and the #define on the line after it.
  guard_lines="$(grep -n -m1 -A1 -E '^#ifndef[[:space:]]' "$file" || true)"
  ifndef="$(sed -n '1s/^[0-9]*:#ifndef[[:space:]]*\([A-Za-z0-9_]*\).*/\1/p' <<<"$guard_lines")"
  define="$(sed -n '2s/^[0-9]*-#define[[:space:]]*\([A-Za-z0-9_]*\).*/\1/p' <<<"$guard_lines")"
  endif="$(grep -E '^#endif' "$file" | tail -n1 | sed -n 's|^#endif[[:space:]]*//[[:space:]]*\([A-Za-z0-9_]*\).*|\1|p')"
  if [[ "$ifndef" != "$expected" || "$define" != "$expected" || "$endif" != "$expected" ]]; then
    echo "$file: include guard should be $expected" \
         "(#ifndef ${ifndef:-none}, #define ${define:-none}, #endif // ${endif:-none})" >&2
    status=1
  fi
done < <(git ls-files -- '*.h' '*.cuh' ':!:third_party/**')
if [[ $status -ne 0 ]]; then
  echo "include guards: fix the files above (guard = TANDEM_ + path in upper case, / and . as _, then _)" >&2
fi
exit $status
