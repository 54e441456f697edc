"""The CPU tests' interpreter patches (`tests/interpreter_speedups.py`) against what they replaced:
the same answers on sample inputs, and a kernel calling jit helpers still launches and leaves
`triton.language` as it found it."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tests.interpreter_speedups import ORIGINALS  # noqa: E402

core = tl.core
pytestmark = pytest.mark.skipif(not ORIGINALS, reason="the interpreter is not patched here (GPU, or another Triton)")


def _same(a, b) -> bool:
    if isinstance(a, core.tuple) or isinstance(b, core.tuple):
        return type(a) is type(b) and _same(a.values, b.values)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a is b or a == b)


def test_unwrap_if_constexpr_answers_as_the_original():
    c = core.constexpr
    samples = [0, -3, 2.5, True, "s", None, c(4), c(True), c(2.0), [c(1), 2], (c(1), 3), [[c(2)], (c(3),)],
               core.tuple([c(2), 3]), tl.float32, tl.pointer_type(tl.float16), core.block_type(tl.int32, [4, 8])]
    for o in samples:
        assert _same(core._unwrap_if_constexpr(o), ORIGINALS["core._unwrap_if_constexpr"](o)), o


def test_tuple_indexing_and_lazy_types_match_the_original():
    values = [core.constexpr(2), 5, core.constexpr(7)]
    t = core.tuple(values)
    for i in (0, 1, 2, -1, -3, core.constexpr(1)):
        assert t[i] is ORIGINALS["core.tuple.__getitem__"](t, i)
    assert _same(t[0:2], ORIGINALS["core.tuple.__getitem__"](t, slice(0, 2, None)))
    assert t.type.name == core._type_for_tuple_values(values).name  # built on first read
    t._setitem(1, core.constexpr(9))
    assert t.type.name == core._type_for_tuple_values(t.values).name
    typed = core.tuple([1], type=core.tuple_type([core.constexpr_type(1)], ["a"]))
    assert typed.type.fields == ["a"] and typed.a == 1


@pytest.mark.parametrize("shape", [[4], [1, 16], (2, 8), "tl_tuple", "constexprs"])
def test_block_type_matches_the_original(shape):
    c = core.constexpr
    shape = {"tl_tuple": core.tuple([c(2), c(4)]), "constexprs": [c(8), 2]}.get(shape, shape) \
        if isinstance(shape, str) else shape
    if type(shape) is tuple:  # core.py's `tuple` is tl.tuple: a Python tuple is refused by both
        with pytest.raises(AssertionError):
            core.block_type(tl.float32, shape)
        with pytest.raises(AssertionError):
            ORIGINALS["core.block_type.__init__"](object.__new__(core.block_type), tl.float32, shape)
        return
    got = core.block_type(tl.float32, shape)
    want = object.__new__(core.block_type)
    ORIGINALS["core.block_type.__init__"](want, tl.float32, shape)
    assert _same(got.shape, want.shape) and got.numel == want.numel and got == want
    assert got.name == want.__dict__["_lazy_name"] == str(got)  # (the original's name went through the setter)
    with pytest.raises(TypeError):
        core.block_type(tl.float32, [])
    with pytest.raises(ValueError):  # not a power of 2: validate_block_shape still runs
        core.block_type(tl.float32, [3])


def test_numpy_dtypes_match_the_original():
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e4nv]
    types = scalars + [tl.pointer_type(tl.float32), core.block_type(tl.bfloat16, [4]),
                       core.block_type(tl.pointer_type(tl.int8), [2, 2])]
    for t in types:
        assert interpreter._get_np_dtype(t) == ORIGINALS["interpreter._get_np_dtype"](t), t


@triton.jit
def _twice(x):
    return x * 2 + tl.sum(x, axis=0) * 0  # tl.sum: a jit function of triton.language.standard


@triton.jit
def _helper_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _twice(tl.load(X + offs)) + 1)


def test_a_kernel_with_jit_helpers_runs_and_leaves_the_language_as_it_found_it():
    # (Triton's own helpers, tl.sum's module among them, may leave tl.core patched for good after
    # an earlier test's launch, as the unpatched interpreter does: compare with before, not with
    # the unpatched module)
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty_like(x)
    members = lambda: (tl.load, tl.core.load, tl.tensor.__add__, getattr(tl.tensor, "__index__", None), tl.static_range,
                       tl.math.exp)
    before = members()
    for _ in range(2):
        _helper_kernel[(1,)](x, y, N=8)
        assert torch.equal(y, 2 * x + 1)
        assert all(a is b for a, b in zip(members(), before))


def _block(values, dtype=tl.int32):
    """An interpreted tensor holding `values` (numpy) as a block of their shape."""
    import numpy as np

    values = np.asarray(values, dtype=np.int32 if dtype == tl.int32 else np.float32)
    return tl.tensor(interpreter.TensorHandle(values, dtype), core.block_type(dtype, list(values.shape)))


def test_tensor_shapes_are_shared_constants_in_a_tensor_of_their_own():
    for ty in (core.block_type(tl.float32, [2, 4]), core.block_type(tl.int32, [8]), tl.float32):
        got = object.__new__(tl.tensor)
        tl.tensor.__init__(got, None, ty)
        want = object.__new__(tl.tensor)
        ORIGINALS["core.tensor.__init__"](want, None, ty)
        assert _same(got.shape, want.shape) and _same(got.numel, want.numel), ty
        assert got.type is want.type is ty and got.dtype is want.dtype
    a, b = (tl.tensor(None, core.block_type(tl.float32, [2, 4])) for _ in range(2))
    assert a.shape is not b.shape and a.shape.values is not b.shape.values
    a.shape._setitem(0, core.constexpr(9))  # one tensor's shape changed: not the other's
    assert [int(d.value) for d in b.shape] == [2, 4]


@pytest.mark.parametrize("shapes", [([2, 4], [2, 4]), ([2, 4], [1, 4]), ([4], [2, 4]), ([2, 1], [1, 4])])
def test_broadcasts_match_the_original(shapes):
    import numpy as np

    semantic = interpreter.TritonSemantic(interpreter.InterpreterBuilder())
    lhs, rhs = (_block(np.arange(int(np.prod(s))).reshape(s)) for s in shapes)
    got = semantic.broadcast_impl_value(lhs, rhs)
    want = ORIGINALS["semantic.broadcast_impl_value"](semantic, lhs, rhs)
    for g, w in zip(got, want):
        assert g.type == w.type and np.array_equal(g.handle.data, w.handle.data)
    if shapes[0] == shapes[1]:
        assert got[0] is lhs and got[1] is rhs


def test_overflow_checks_run_only_where_their_assert_is_kept():
    # Without debug the original computes the int32 check and drops it in device_assert; the patch
    # skips it. With debug the check runs and an overflowing add fails.
    from triton.runtime.interpreter import InterpreterOptions

    builder = interpreter.InterpreterBuilder()
    semantic = interpreter.TritonSemantic(builder)
    big = _block([2**31 - 1, 5])
    ops = []
    record = lambda a, b, sanitize: ops.append(1) or semantic.add(a, b, False)
    assert semantic.binary_op_sanitize_overflow_impl(big, big, record) is None and not ops
    assert ORIGINALS["semantic.binary_op_sanitize_overflow_impl"](semantic, big, big, record) is None and ops
    assert semantic.add(big, big, True).handle.data[1] == 10  # (wraps as a GPU would)
    builder.options = InterpreterOptions(debug=True)
    with pytest.raises(Exception, match="overflow"):
        semantic.add(big, big, True)
    semantic.add(_block([1, 2]), _block([3, 4]), True)  # no overflow: no error
