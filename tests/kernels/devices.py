"""The devices every kernel test runs on, in one place.

"cpu": the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when
there is no GPU). On a GPU machine Triton compiles for CUDA and cannot take CPU tensors, so those
cases skip there. "cuda": compiled kernels at real shapes, marked gpu (skipped without CUDA).
"""

import pytest

from kiln.kernels import interpreting

INTERPRETER_ONLY = pytest.mark.skipif(not interpreting(), reason="CPU tensors run only under Triton's interpreter")
DEVICES = [pytest.param("cpu", marks=INTERPRETER_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)]
