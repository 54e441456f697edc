"""Costs of Triton's CPU interpreter that the CPU tests remove, without changing what runs.

The tests run every Triton kernel under the interpreter (no GPU), and the interpreter's own
bookkeeping, not the numpy math, was most of their time. Profiled on
`test_kernel_path.py::test_decode_gemv_path_equals_reference[llama]` (Triton 3.6), which took
91 s before the first four patches and 20 s with them (together with
`kiln.kernels.gemv_tiles.interpreter_tile`):

- Every call of a `@triton.jit` helper from inside a kernel (`InterpretedFunction.__call__`) runs
  `_patch_lang` again: `inspect.getmembers` over `triton.language`, `tl.tensor` and `tl.math`
  per call, ~200 calls per launch, about a fifth of the test. The launch (`GridExecutor`) has
  already patched those modules, and the helper's repeat patches nothing new (every builtin is
  already replaced) and is never undone. It is skipped when every language module the helper
  sees is already patched.
- Every interpreted tensor stores its shape as a `tl.tuple`, whose `__init__` builds a
  `tuple_type` at once (a `constexpr_type` per dimension and a formatted name): millions of times
  per test, for a type the interpreter rarely reads. It is built on first read instead, from the
  same values (`_setitem`, the one mutation, rebuilds it anyway).
- The semantic layer's type bookkeeping, paid per op per program: `_unwrap_if_constexpr`
  (millions of calls, four `isinstance` checks each) answers plain ints, floats, tensors, dtypes
  and constexprs at once; a `tl.tuple` indexed by an int skips wrapping the index in a
  constexpr; a `block_type` unwraps a flat shape of ints and constexprs in one pass and formats
  its name (a string of the shape and dtype, read only when printed) on first read, and
  validates each shape once.
  `tl.tensor.__init__` (once per op result) builds a constexpr per dimension and one for the
  element count: they are built once per shape and shared (a new `tl.tuple` per tensor still
  holds them). Broadcasting two blocks of one shape, which changes nothing, returns at once.
- `_get_np_dtype` builds a dict of 17 dtypes per call (hashing each), hundreds of thousands of
  calls per test. It is replaced by a lookup in one dict built once from the original function.
- Every integer `+`, `-` and `*` runs the overflow sanitizer (`sanitize_overflow` is on in the
  interpreter's options): both sides cast to int64, the op again, two bound constants, two
  comparisons and an `and`, whose result goes to `device_assert`, which drops it unless the
  options' `debug` is on. A compiled kernel loses that dead code to DCE; the interpreter computes
  it on numpy arrays, about a fifth of a test such as `test_block_pass.py`'s MiniMax-M3 graph
  replay. The check is skipped when its assert would be dropped, and only on the interpreter's
  builder.

`install()` patches only the Triton release it was checked against; on any other the interpreter
runs as shipped (slower, the same results). `ORIGINALS` keeps what each patch replaced, for
`tests/test_interpreter_speedups.py`, which compares the two on sample inputs.
"""

from __future__ import annotations

import builtins
import inspect
import math

CHECKED_TRITON = "3.6."
ORIGINALS: dict = {}  # "module.name" -> the object a patch replaced (filled by install())


def install() -> bool:
    """Patch the interpreter in this process; returns whether it did."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not triton.__version__.startswith(CHECKED_TRITON) or getattr(interpreter, "_kiln_patched", False):
        return False
    _skip_repeated_lang_patches(interpreter, tl)
    _cache_numpy_dtypes(interpreter, tl)
    _lazy_tuple_types(tl.core)
    _fast_type_bookkeeping(tl.core)
    _skip_dropped_overflow_checks(interpreter)
    _same_shape_broadcasts(interpreter)
    interpreter._kiln_patched = True
    return True


def _skip_repeated_lang_patches(interpreter, tl) -> None:
    patch_lang = ORIGINALS["interpreter._patch_lang"] = interpreter._patch_lang
    langs_of: dict = {}

    def _patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = [v for v in fn.__globals__.values()
                                    if inspect.ismodule(v) and v in (tl, tl.core)]
        # a patched module's builtins are the interpreter's wrappers, no longer builtins
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return interpreter._LangPatchScope()  # nothing to restore: the launch's scope does it
        return patch_lang(fn)

    interpreter._patch_lang = _patch_lang


def _cache_numpy_dtypes(interpreter, tl) -> None:
    get_np_dtype = ORIGINALS["interpreter._get_np_dtype"] = interpreter._get_np_dtype
    scalars = (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
               tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16,
               tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)
    by_name = {t.name: get_np_dtype(t) for t in scalars}
    pointer = get_np_dtype(tl.pointer_type(tl.float32))
    block_type, pointer_type = tl.block_type, tl.pointer_type

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer_type):
            return pointer
        return by_name[tt_dtype.name]

    interpreter._get_np_dtype = _get_np_dtype


def _lazy_tuple_types(core) -> None:
    tuple_type, type_for_values = core.tuple_type, core._type_for_tuple_values
    ORIGINALS["core.tuple.__init__"] = core.tuple.__init__

    def __init__(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, tuple_type) or type is None:
            self._lazy_type = type
        else:  # make_template in ASTFunction.deserialize may pass a list/tuple
            self._lazy_type = tuple_type(type)

    def _get_type(self):
        t = self.__dict__.get("_lazy_type")  # (tuple's __getattr__ would look in values)
        if t is None:
            t = self._lazy_type = type_for_values(self.values)
        return t

    def _set_type(self, value):
        self._lazy_type = value

    core.tuple.__init__ = __init__
    core.tuple.type = property(_get_type, _set_type)


def _fast_type_bookkeeping(core) -> None:
    constexpr, tensor, tuple_cls, block_type = core.constexpr, core.tensor, core.tuple, core.block_type
    unwrap, unwrap_shape, getitem = core._unwrap_if_constexpr, core._unwrap_shape, core.tuple.__getitem__
    plain = (int, float, bool, str, type(None), tensor, core.dtype, core.pointer_type, block_type)
    validate_block_shape = core.validate_block_shape
    valid_shapes: dict = {}  # shape (ints) -> element count, for shapes validate_block_shape accepted
    ORIGINALS.update({"core._unwrap_if_constexpr": unwrap, "core.tuple.__getitem__": getitem,
                      "core.block_type.__init__": block_type.__init__})

    def _unwrap_if_constexpr(o):
        t = type(o)
        if t is constexpr:
            return o.value
        if t in plain:  # (exact types: a subclass goes the original's way)
            return o
        return unwrap(o)

    def __getitem__(self, idx):
        if type(idx) is int:
            return self.values[idx]
        return getitem(self, idx)

    def _flat_shape(shape) -> list:
        values = shape.values if type(shape) is tuple_cls else shape
        out = []
        for s in values:
            t = type(s)
            if t is int:
                out.append(s)
            elif t is constexpr and type(s.value) is int:
                out.append(s.value)
            else:
                return unwrap_shape(shape)
        return out

    def __init__(self, element_ty, shape):
        self.element_ty = element_ty
        assert isinstance(shape, (list, tuple_cls))  # core.py's `tuple` is tl.tuple
        self.shape = tuple_cls(_flat_shape(shape))
        if not self.shape:
            raise TypeError('0d block_type is forbidden')
        key = builtins.tuple(self.shape.values)
        numel = valid_shapes.get(key)
        if numel is None:  # (raises on a shape it refuses; only accepted shapes are kept)
            numel = valid_shapes[key] = validate_block_shape(self.shape)
        self.numel = numel

    def _get_name(self):
        name = self.__dict__.get("_lazy_name")
        if name is None:
            name = self._lazy_name = f'<{self.shape}, {self.element_ty}>'
        return name

    def _set_name(self, value):
        self._lazy_name = value

    core._unwrap_if_constexpr = _unwrap_if_constexpr
    tuple_cls.__getitem__ = __getitem__
    block_type.__init__ = __init__
    block_type.name = property(_get_name, _set_name)
    _shared_shape_constants(core)


def _shared_shape_constants(core) -> None:
    constexpr, tuple_cls, tensor = core.constexpr, core.tuple, core.tensor
    ORIGINALS["core.tensor.__init__"] = tensor.__init__
    by_shape: dict = {}  # shape (ints) -> ([constexpr per dimension], constexpr(element count))
    scalar = ([], constexpr(1))

    def __init__(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        if type.is_block():
            key = builtins.tuple(type.shape.values)
            dims, numel = by_shape.get(key) or by_shape.setdefault(
                key, ([constexpr(s) for s in key], constexpr(math.prod(key))))
        else:
            dims, numel = scalar
        self.shape = tuple_cls(dims)  # (copies the list: a tensor's shape stays its own)
        self.numel = numel

    tensor.__init__ = __init__


def _same_shape_broadcasts(interpreter) -> None:
    semantic, block_type = interpreter.TritonSemantic, interpreter.tl.block_type
    broadcast = ORIGINALS["semantic.broadcast_impl_value"] = semantic.broadcast_impl_value

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if type(lt) is block_type and type(rt) is block_type and lt.shape.values == rt.shape.values:
            return lhs, rhs  # (what the original returns for equal shapes)
        return broadcast(self, lhs, rhs)

    semantic.broadcast_impl_value = broadcast_impl_value


def _skip_dropped_overflow_checks(interpreter) -> None:
    semantic = interpreter.TritonSemantic
    sanitize = ORIGINALS["semantic.binary_op_sanitize_overflow_impl"] = semantic.binary_op_sanitize_overflow_impl
    interpreter_builder = interpreter.InterpreterBuilder

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
        if type(self.builder) is interpreter_builder and not self.builder.options.debug:
            return  # (the original's `device_assert` returns without debug: nothing to check)
        return sanitize(self, lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl
