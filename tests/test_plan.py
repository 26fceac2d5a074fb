"""vitrail.plan on the CPU: plans recorded from a general path and replayed, with host functions
standing in for launches (nvcc builds them; their pointers are host memory)."""
from __future__ import annotations

import pytest
import torch

from vitrail import jit, plan
from vitrail.jit.errors import LaunchError
from vitrail.plan import GENERAL, Plans, keep, scratch, signature

SOURCE = r"""
#include <cuda_runtime.h>
extern "C" cudaError_t scale(float* out, const float* x, long long n, float a, cudaStream_t s) {
  if (n < 0) return cudaErrorInvalidValue;
  for (long long i = 0; i < n; ++i) out[i] = a * x[i];
  return cudaSuccess;
}
extern "C" cudaError_t shift(float* out, const float* x, const float* table, long long n,
                             cudaStream_t s) {
  for (long long i = 0; i < n; ++i) out[i] = x[i] + table[i % 4];
  return cudaSuccess;
}
"""


@pytest.fixture(scope="module")
def module():
    return jit.compile(SOURCE, name="plan_test")


@pytest.fixture(autouse=True)
def cpu_device(monkeypatch):
    """The plans' device and stream on a machine with no GPU: device 0, stream 0."""
    monkeypatch.setattr(plan, "_device", lambda: 0)
    monkeypatch.setattr(plan.native, "_current_device", lambda: 0)
    monkeypatch.setattr(plan, "_stream", lambda device: 0)


def _outputs(x, *rest):
    return (torch.empty_like(x),)


def _key(x, *scalars):
    return (signature(x), *scalars)


def test_a_plan_is_recorded_then_replayed_with_new_pointers(module):
    plans, calls = Plans("test"), []

    def general(x, out, a):
        calls.append(a)
        if x.dim() != 1:
            raise ValueError("x must be 1-D")
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), a, stream=0)

    for a in (2.0, 3.0):
        for _ in range(3):
            x = torch.randn(37)
            y, = plans.run(_key(x, a), (x,), _outputs, general, (a,))
            torch.testing.assert_close(y, a * x)
    assert calls == [2.0, 3.0]  # one general call per key; the others were plans
    built = plans.get(_key(x, 3.0))
    assert built is not GENERAL and "f0(" in built.source
    x = torch.randn(5)  # another shape: a miss
    y, = plans.run(_key(x, 3.0), (x,), _outputs, general, (3.0,))
    torch.testing.assert_close(y, 3.0 * x)
    assert len(calls) == 3 and len(plans) == 3
    with pytest.raises(ValueError, match="1-D"):  # the miss path still refuses, and plans nothing
        plans.run(_key(torch.ones(2, 2), 1.0), (torch.ones(2, 2),), _outputs, general, (1.0,))
    assert plans.get(_key(torch.ones(2, 2), 1.0)) is None


def test_scratch_is_allocated_again_and_kept_tensors_are_constants(module):
    plans, calls = Plans("test"), []
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def general(x, out):
        calls.append(1)
        tmp = scratch(x.numel(), torch.float32, x.device)
        keep(table)
        module.scale(tmp.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=0)
        module.shift(out.data_ptr(), tmp.data_ptr(), table.data_ptr(), x.numel(), stream=0)

    for _ in range(3):
        x = torch.randn(10)
        y, = plans.run(_key(x), (x,), _outputs, general)
        torch.testing.assert_close(y, 2 * x + table.repeat(3)[:10])
    assert len(calls) == 1
    source = plans.get(_key(x)).source
    assert "s0 = empty(10" in source and str(table.data_ptr()) in source


def test_a_plan_holds_on_the_stream_it_was_recorded_on(module, monkeypatch):
    """State kept per stream (a workspace two grids must not share) is a plan's constant: a
    call on another stream is a key of its own, and passes that stream's state."""
    plans, calls, current = Plans("test"), [], [1]
    tables = {1: torch.full((4,), 1.0), 2: torch.full((4,), 2.0)}
    monkeypatch.setattr(plan, "_stream", lambda device: current[0])

    def general(x, out):
        calls.append(current[0])
        keep(tables[current[0]])
        module.shift(out.data_ptr(), x.data_ptr(), tables[current[0]].data_ptr(), x.numel(),
                     stream=current[0])

    for stream in (1, 2, 1, 2, 2):
        current[0] = stream
        x = torch.randn(6)
        y, = plans.run(_key(x), (x,), _outputs, general)
        torch.testing.assert_close(y, x + stream)
    assert calls == [1, 2] and len(plans) == 2


def test_what_a_plan_cannot_repeat_takes_the_general_path(module):
    plans, calls = Plans("test"), []
    other = torch.zeros(8)

    def with_copy(x, out):  # a torch op the plan would skip
        calls.append("copy")
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=0)
        out.add_(1.0)

    def foreign_pointer(x, out):  # a buffer the plan knows nothing of
        calls.append("foreign")
        module.scale(other.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=0)
        module.scale(out.data_ptr(), other.data_ptr(), x.numel(), 1.0, stream=0)

    def other_stream(x, out):
        calls.append("stream")
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=1234)

    for general in (with_copy, foreign_pointer, other_stream):
        for _ in range(2):
            x = torch.randn(8)
            y, = plans.run(_key(x, general.__name__), (x,), _outputs, general)
            expect = 2 * x + 1 if general is with_copy else 2 * x
            torch.testing.assert_close(y, expect)
        assert plans.get(_key(x, general.__name__)) is GENERAL
    assert calls == ["copy", "copy", "foreign", "foreign", "stream", "stream"]


def test_a_call_that_ran_a_stand_in_makes_no_plan(module):
    """plan.provisional(): a call that ran a stand-in (torch's ops while a kernel builds) stores
    nothing for its key, neither a plan nor GENERAL (its torch ops would have made it GENERAL);
    the key's next call records again, and what it ran then becomes the plan."""
    plans, calls, building = Plans("test"), [], [True]

    def general(x, out):
        calls.append("stand-in" if building[0] else "kernel")
        if building[0]:
            plan.provisional()
            torch.mul(x, 2.0, out=out)
        else:
            module.scale(out.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=0)

    for _ in range(2):
        x = torch.randn(8)
        torch.testing.assert_close(plans.run(_key(x), (x,), _outputs, general)[0], 2 * x)
        assert plans.get(_key(x)) is None
    building[0] = False
    for _ in range(2):
        x = torch.randn(8)
        torch.testing.assert_close(plans.run(_key(x), (x,), _outputs, general)[0], 2 * x)
    assert calls == ["stand-in", "stand-in", "kernel"]  # then the kernel's plan
    assert plans.get(_key(x)) not in (None, GENERAL)
    plan.provisional()  # outside a recording: nothing to mark


def test_a_planned_call_raises_the_entry_points_error(module):
    plans = Plans("test")
    n = [4]

    def general(x, out):
        module.scale(out.data_ptr(), x.data_ptr(), n[0], 2.0, stream=0)

    x = torch.randn(4)
    plans.run(_key(x), (x,), _outputs, general)
    built = plans.get(_key(x))
    built.__globals__["c0_2"] = -1  # the plan's constant n: the function now refuses
    with pytest.raises(LaunchError, match="test \\(planned call\\).*scale"):
        built(x)


def test_keys_hold_what_decides_a_route():
    x = torch.randn(4, 6)
    assert signature(x) != signature(x.t())  # strides
    assert signature(x) != signature(x.double())  # dtype
    assert signature(x) != signature(x.view(6, 4))  # shape
    assert signature(x[:, 1:]) != signature(x[:, :-1])  # address modulo 16 (and strides equal)
    assert signature(x[:, 1:]).__getitem__(slice(0, 4)) == signature(x[:, :-1])[:4]


def test_plans_are_bounded_and_cleared(module):
    plans = Plans("test", capacity=4)

    def general(x, out):
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), 1.0, stream=0)

    for n in range(1, 7):
        x = torch.randn(n)
        plans.run(_key(x), (x,), _outputs, general)
    assert 0 < len(plans) <= 4
    plan.clear_all()
    assert len(plans) == 0


def test_a_key_seen_once_is_not_recorded_with_record_from_2(module):
    """record_from=2: a key's first call runs the general path unrecorded (a signature seen once,
    as a decoding loop's growing keys, pays no recording), its second records the plan, its
    third runs it; the count is bounded and cleared."""
    plans, calls = Plans("test", capacity=8, record_from=2), []

    def general(x, out, a):
        calls.append(a)
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), a, stream=0)

    for i in range(3):
        x = torch.randn(37)
        y, = plans.run(_key(x, 2.0), (x,), _outputs, general, (2.0,))
        torch.testing.assert_close(y, 2 * x)
        assert len(calls) == min(i + 1, 2) and len(plans) == (i >= 1), i
    assert plans.get(_key(x, 2.0)) not in (None, GENERAL)
    for n in range(1, 20):  # keys seen once: none recorded, the count bounded
        x = torch.randn(n)
        torch.testing.assert_close(plans.run(_key(x, 5.0), (x,), _outputs, general, (5.0,))[0],
                                   5 * x)
    assert len(plans) == 1 and len(plans._seen) <= 8
    plans.clear()
    assert len(plans) == 0 and not plans._seen


def test_aliased_inputs_replay_only_while_aliased_and_views_replay_at_their_offsets(module):
    """A plan recorded from inputs that are one tensor (mm(a, a)) runs while they still are;
    another call of its signature (two tensors) takes the general path, never the first input
    twice. A pointer inside a tensor (a view's start, an array's row) replays at the same
    offset from that tensor's new address."""
    plans, calls = Plans("test"), []

    def add(x, y, out):  # out = x + the table y[:4]
        calls.append(1)
        module.shift(out.data_ptr(), x.data_ptr(), y.data_ptr(), x.numel(), stream=0)

    for _ in range(2):
        x = torch.randn(8)
        out, = plans.run((signature(x), signature(x)), (x, x), _outputs, add)
        torch.testing.assert_close(out, x + x[:4].repeat(2))
    assert len(calls) == 1 and "unplanned" in plans.get((signature(x), signature(x))).source
    for _ in range(2):
        x, y = torch.randn(8), torch.randn(8)
        out, = plans.run((signature(x), signature(y)), (x, y), _outputs, add)
        torch.testing.assert_close(out, x + y[:4].repeat(2))
    assert len(calls) == 3  # the general path: the plan's inputs were one tensor

    def second_half(x, out):  # a pointer inside x and one inside out
        calls.append(2)
        n = x.numel() // 2
        module.scale(out.data_ptr() + 4 * n, x.data_ptr() + 4 * n, n, 3.0, stream=0)
        module.scale(out.data_ptr(), x.data_ptr(), n, 1.0, stream=0)

    for _ in range(3):
        x = torch.randn(10)
        out, = plans.run((signature(x), "half"), (x,), _outputs, second_half)
        torch.testing.assert_close(out, torch.cat([x[:5], 3 * x[5:]]))
    assert calls.count(2) == 1 and "i0.data_ptr() + 20" in plans.get((signature(x), "half")).source


def test_a_pointer_passed_as_an_integer_is_never_replayed(module):
    plans = Plans("test")
    source = SOURCE.replace("float* out, const float* x, long long n, float a",
                            "long long out, const float* x, long long n, float a")
    source = source.replace("out[i] = a * x[i]", "((float*)out)[i] = a * x[i]")
    by_int = jit.compile(source, name="plan_test_int")

    def general(x, out):
        by_int.scale(out.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=0)

    for _ in range(2):
        x = torch.randn(6)
        out, = plans.run(_key(x), (x,), _outputs, general)
        torch.testing.assert_close(out, 2 * x)
    assert plans.get(_key(x)) is GENERAL


# --------------------------------------------------------------- the C++ hit path (native)
SOURCE_NAN = r"""
#include <cuda_runtime.h>
extern "C" cudaError_t scale_finite(float* out, const float* x, long long n, float a,
                                    cudaStream_t s) {
  for (long long i = 0; i < n; ++i) {
    if (x[i] != x[i]) return cudaErrorInvalidValue;  // a NaN: refused
    out[i] = a * x[i];
  }
  return cudaSuccess;
}
"""


@pytest.fixture(scope="module")
def ext():
    from vitrail.plan import native
    loaded = native.load(wait=True)
    if loaded is None:
        pytest.fail("the C++ hit path did not build (see the log)")
    return loaded


def _front_op(module, plans, calls):
    """A public function in front of which the C++ hit path sits: scale(x, a) = a * x."""
    from vitrail.plan import native

    def general(x, out, a):
        calls.append(a)
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), a, stream=0)

    @native.front(plans)
    def scale(x, a=2.0, *, tag=None):
        """a * x"""
        key = ("list", *tag) if isinstance(tag, list) else tag  # hashable
        return plans.run((signature(x), a, key), (x,), _outputs, general, (a,))[0]
    return scale


def test_front_functions_run_their_plans_from_cpp(module, ext):
    from vitrail.plan import native
    plans, calls = Plans("native-test"), []
    scale = _front_op(module, plans, calls)
    front = scale.front
    assert scale.__doc__ == "a * x" and front.table is not None
    x = torch.randn(37)
    torch.testing.assert_close(scale(x, 3.0), 3 * x)  # a miss: Python, and the table learns
    assert calls == [3.0] and len(front.table) == 1
    plans._plans.clear()  # from now on only the C++ table can skip the general path
    for _ in range(3):
        x = torch.randn(37)
        torch.testing.assert_close(scale(x, 3.0), 3 * x)
        torch.testing.assert_close(scale(x, a=3.0), 3 * x)  # a keyword is the same key
    assert calls == [3.0]
    assert front.call(x, 3.0, None) is not native.MISS
    # anything that changes the key is a miss, and learned: a value, its type, a shape, strides,
    # the address modulo 16, a keyword's value
    y = torch.randn(64)
    for args, kwargs, expect in [((x, 4.0), {}, 4 * x), ((x, 3), {}, 3 * x),
                                 ((torch.randn(2, 37)[:, 0],), {}, None),
                                 ((y[1:38],), {}, 2 * y[1:38]), ((x, 3.0), {"tag": "t"}, 3 * x)]:
        before = len(calls)
        out = scale(*args, **kwargs)
        if expect is not None:
            torch.testing.assert_close(out, expect)
        assert len(calls) == before + 1, args
    assert len(front.table) == 6
    plans.clear()
    assert len(front.table) == 0


def test_a_cpp_key_learns_at_the_call_that_records_its_plan(module, ext):
    """With record_from=2, the first call's unrecorded general path teaches the C++ table
    nothing (the key stays pending); the second records the plan and the table learns it; the
    third runs from C++."""
    plans, calls = Plans("native-test-2", record_from=2), []
    scale = _front_op(module, plans, calls)
    table = scale.front.table
    for i in range(3):
        x = torch.randn(41)
        torch.testing.assert_close(scale(x, 3.0), 3 * x)
        assert len(table) == (i >= 1) and len(calls) == min(i + 1, 2), i
    plans._plans.clear()  # only the C++ table can skip the general path now
    x = torch.randn(41)
    torch.testing.assert_close(scale(x, 3.0), 3 * x)
    assert len(calls) == 2


def test_tuples_and_lists_of_ints_are_keyed_by_value(module, ext):
    """A stride or padding given as a pair (nn.Conv2d keeps them so) is a C++ key: its values,
    and whether a tuple or a list; anything else in one keeps to Python."""
    from vitrail.plan import native
    plans, calls = Plans("native-test"), []
    scale = _front_op(module, plans, calls)
    front = scale.front
    x = torch.randn(9)
    for tag in ((1, 1), [3, 3], (), (1, 2, 3, 4, 5, 6, 7, 8)):
        torch.testing.assert_close(scale(x, 3.0, tag=tag), 3 * x)  # learned
        before = len(calls)
        torch.testing.assert_close(scale(x, 3.0, tag=tag), 3 * x)
        assert len(calls) == before, tag  # replayed from C++
        assert front.call(x, 3.0, tag) is not native.MISS
    assert len(front.table) == 4
    for other in ((1, 2), [1, 1], (1, 1, 1)):  # another key: a miss, learned
        assert front.call(x, 3.0, other) is native.MISS and front.pending(), other
        scale(x, 3.0, tag=other)
    for never in ((1, 1.0), (True, 1), ((1,), 1), tuple(range(9)), (1, "a"), (2 ** 70, 1)):
        assert front.call(x, 3.0, never) is native.MISS and not front.pending(), never


def test_what_no_key_vouches_for_keeps_to_python(module, ext):
    from vitrail import tune
    plans, calls = Plans("native-test"), []
    scale = _front_op(module, plans, calls)
    front = scale.front
    x = torch.randn(16, requires_grad=True)  # a gradient recorded: never the C++ table
    with torch.no_grad():
        scale(x.detach(), 3.0)
    assert len(front.table) == 1
    assert front.call(x.detach(), 3.0, None) is not plan.native.MISS  # grad mode decides
    assert front.call(x, 3.0, None) is plan.native.MISS and not front.pending()
    with torch.no_grad():
        assert front.call(x, 3.0, None) is not plan.native.MISS

    class Sub(torch.Tensor):
        pass
    assert front.call(x.detach().as_subclass(Sub), 3.0, None) is plan.native.MISS
    assert front.call(x.detach(), object(), None) is plan.native.MISS and not front.pending()
    with tune.settings(policy=tune.PickBest):  # scoped settings: the key does not hold them
        assert front.call(x.detach(), 3.0, None) is plan.native.MISS
    tune.set_defaults(policy=tune.PickAny)  # changed defaults drop every C++ plan
    try:
        assert len(front.table) == 0
    finally:
        tune.reset_defaults()


def test_a_general_key_a_result_that_is_an_input_and_errors_from_cpp(module, ext):
    from vitrail.plan import native
    plans, calls = Plans("native-test"), []
    finite = jit.compile(SOURCE_NAN, name="plan_test_nan")

    def copying(x, out):  # a torch op: the key is general, in C++ too
        calls.append("copy")
        out.copy_(x)

    @native.front(plans)
    def copy_of(x):
        return plans.run((signature(x),), (x,), _outputs, copying)[0]

    for _ in range(2):
        x = torch.randn(5)
        torch.testing.assert_close(copy_of(x), x)
    assert calls == ["copy", "copy"] and len(copy_of.front.table) == 1
    assert copy_of.front.call(x) is native.MISS and not copy_of.front.pending()

    def into(x, out):
        finite.scale_finite(out.data_ptr(), x.data_ptr(), x.numel(), 2.0, stream=0)

    @native.front(plans)
    def scale_into(x, out):
        plans.run((signature(x), signature(out)), (x, out), lambda *a: (), into)
        return out

    x, out = torch.randn(6), torch.empty(6)
    assert scale_into(x, out) is out and len(scale_into.front.table) == 1
    x = torch.randn(6)
    assert scale_into(x, out) is out  # the C++ plan returns the argument it wrote
    torch.testing.assert_close(out, 2 * x)
    x[3] = float("nan")
    with pytest.raises(LaunchError, match="native-test \\(planned call\\).*scale_finite"):
        scale_into(x, out)


def test_a_call_inside_a_recorded_call_is_recorded_not_run_from_cpp(module, ext):
    """While a call is recorded, the C++ tables miss: an op it calls through its front
    function must be seen by the recording, or the outer plan would skip it."""
    from vitrail.plan import native
    plans, calls = Plans("native-test"), []

    def into(x, out):
        calls.append("inner")
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), 5.0, stream=0)

    @native.front(plans)
    def scale_into(x, out):
        plans.run((signature(x), signature(out)), (x, out), lambda *a: (), into)
        return out

    for _ in range(2):  # the second call runs from C++
        scale_into(torch.randn(9), torch.empty(9))
    assert calls == ["inner"]
    outer = Plans("native-test-outer")

    def general(x, out):  # out = 5 * x through scale_into, then doubled in place
        scale_into(x, out)
        module.scale(out.data_ptr(), out.data_ptr(), x.numel(), 2.0, stream=0)

    for _ in range(3):
        x = torch.randn(9)
        out, = outer.run((signature(x),), (x,), _outputs, general)
        torch.testing.assert_close(out, 10 * x)
    assert calls == ["inner", "inner"]  # recorded once, through Python
    source = outer.get((signature(x),)).source
    assert "f0(" in source and "f1(" in source  # both calls are in the outer plan


def test_one_tensor_passed_twice_is_its_own_cpp_key(module, ext):
    """f(a, a) and f(a, b) of one signature are two C++ keys (which tensor arguments start at
    one address is in the key): each replays its own plan, never the first input twice."""
    from vitrail.plan import native
    plans, calls = Plans("native-test"), []

    def general(x, y, out):  # out = x + y[:4] repeated
        calls.append(1)
        module.shift(out.data_ptr(), x.data_ptr(), y.data_ptr(), x.numel(), stream=0)

    @native.front(plans)
    def add(x, y):
        return plans.run((signature(x), signature(y)), (x, y), _outputs, general)[0]

    for _ in range(3):
        x = torch.randn(8)
        torch.testing.assert_close(add(x, x), x + x[:4].repeat(2))
        x, y = torch.randn(8), torch.randn(8)
        torch.testing.assert_close(add(x, y), x + y[:4].repeat(2))
    assert len(add.front.table) == 2 and len(calls) == 2  # one general call per key
    view = x.view(2, 4)[0]  # a view at x's address is that tensor too
    assert add.front.call(x, x) is not native.MISS
    assert add.front.call(x[:8], x) is not native.MISS and view.data_ptr() == x.data_ptr()


def _scale_front(module, name: str, rule):
    """A front function scale(x, a) (x times a, the test module's host function standing in for
    a kernel) with the gradient rule ``rule``, whose Python path under autograd is an
    autograd.Function; and the list of the a of each call its Python path ran."""
    from vitrail.plan import native
    plans, calls = Plans(name), []

    def general(x, out, a):
        calls.append(a)
        module.scale(out.data_ptr(), x.data_ptr(), x.numel(), a, stream=0)

    class Scale(torch.autograd.Function):  # the Python path's autograd
        @staticmethod
        def forward(ctx, x, a):
            ctx.a = a
            return plans.run((signature(x), a), (x,), _outputs, general, (a,))[0]

        @staticmethod
        def backward(ctx, g):
            return scale(g.contiguous(), ctx.a), None

    @native.front(plans, grad=rule)
    def scale(x, a=2.0):
        if torch.is_grad_enabled() and x.requires_grad:
            return Scale.apply(x, a)
        return plans.run((signature(x), a), (x,), _outputs, general, (a,))[0]
    return scale, calls


def test_calls_that_record_gradients_run_from_cpp_with_a_cpp_autograd_node(module, ext):
    """A front with a gradient rule: a call that records gradients is a C++ plan of its own key
    (which tensors require a gradient is in it), run with grad mode off, its output given a C++
    autograd node whose backward calls the rule (here a front function itself); saved tensors
    are checked for in-place changes, and a second backward without retain_graph refuses."""
    from vitrail.plan import native

    def backward(y, g, a):  # y: the saved output (unused but for the version check)
        return scale(g.contiguous(), a)  # (sum's gradient is expanded: stride 0)

    def rule(x, a=2.0):
        return (backward, ((native.OUTPUT, 0), (native.GRAD, 0), (native.VALUE, a)), (0,),
                "vitrail::ScaleBackward")
    scale, calls = _scale_front(module, "native-test", rule)

    x = torch.randn(37, requires_grad=True)
    scale(x, 3.0).sum().backward()  # learns the grad key (and the backward's plain one)
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    assert len(scale.front.table) == 2
    learned = len(calls)
    for k in range(3):
        x = torch.randn(37, requires_grad=True)
        g = torch.randn(37)
        y = scale(x, 3.0)
        assert y.grad_fn is not None and y.grad_fn.name() == "vitrail::ScaleBackward"
        torch.testing.assert_close(y, 3.0 * x.detach())
        got, = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(got, 3.0 * g)
    assert len(calls) == learned  # every later forward and backward ran from C++
    assert scale.front.call(x, 3.0) is not native.MISS
    with torch.no_grad():  # grad mode off: the plain key
        assert scale(x, 3.0).grad_fn is None
    y = scale(x, 3.0)  # through a graph: the gradient flows on to x's history
    z = scale(y, 2.0)
    z.backward(torch.ones(37))
    torch.testing.assert_close(x.grad, torch.full_like(x, 6.0))
    y = scale(x, 3.0)
    y.mul_(2)  # the saved output changed in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = scale(x, 3.0)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_a_rules_steps_run_the_backward_from_cpp(module, ext):
    """A gradient rule with steps: where no graph of the gradients is asked for, the C++ node
    calls each step's front table itself (its Python function only where the table misses,
    which learns the step's key), never the rule's Python backward; with create_graph, the
    Python backward runs. A step's result is the gradient of its input."""
    from vitrail.plan import native
    backwards = []

    def backward(g, a):
        backwards.append(a)
        return scale(g, a)

    def rule(x, a=2.0):
        return (backward, ((native.GRAD, 0), (native.VALUE, a)), (0,), "vitrail::ScaleBackward",
                ((scale, ((native.ARG, 0), (native.VALUE, a)), 0),))
    scale, calls = _scale_front(module, "native-steps", rule)

    x = torch.randn(37, requires_grad=True)
    torch.autograd.grad(scale(x, 3.0), x, torch.randn(37))  # learns the key that records
    for k in range(4):  # the first backward through the steps learns the step's plain key
        x, g = torch.randn(37, requires_grad=True), torch.randn(37)
        y = scale(x, 3.0)
        assert y.grad_fn.name() == "vitrail::ScaleBackward"
        got, = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(got, 3.0 * g)
        if k == 0:
            learned = len(calls)
    assert backwards == [] and len(calls) == learned  # the later ones ran from C++
    y = scale(x, 3.0)
    got, = torch.autograd.grad(y, x, g, create_graph=True)  # a graph: the Python backward
    torch.testing.assert_close(got, 3.0 * g)
    assert backwards == [3.0]
    assert native._with_tables(rule(x, 3.0))[4][0][1] is scale.front.table
    assert len(native._with_tables((backward, (), (0,), "n", ((len, (), 0),)))) == 4  # no table

    def bad(x, a=2.0):  # a step's argument naming no argument of the rule: refused, so the
        return (*rule(x, a)[:4], ((bad_scale, ((native.ARG, 9), (native.VALUE, a)), 0),))
    bad_scale, _ = _scale_front(module, "native-bad-steps", bad)  # key keeps to Python
    for _ in range(2):
        x = torch.randn(37, requires_grad=True)
        y = bad_scale(x, 3.0)
        assert y.grad_fn.name() != "vitrail::ScaleBackward"
        torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], 3.0 * g)
