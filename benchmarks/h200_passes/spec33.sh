# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-third session (2026-12-05). Lane `spec32b` (the GPU suite at the thirty-second session's
# end) ran on an H100 and failed 4 tests: a capture invalidated by the garbage collector destroying
# an earlier engine's graphs, MTP's K = 1 drafts refused by the verify-moves kernel, and a count in
# the late catch-up test. `spec33a`: the whole GPU suite after the fixes, nothing deselected.
# shellcheck shell=bash

lane0_spec33a() {
  step gpu_suite 420 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
}
